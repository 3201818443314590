import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.testing import run_distributed
from tests.distributed.models import batch, local_rows, mlp, reference_adamw, rel_err

LR, WD, STEPS = 1e-2, 0.01, 5


def _train(overlap: bool, accum: int, bucket_size):
    """5 DDP steps on this rank's rows vs. one process on the global batch; returns errors and params."""
    rank, size = topology.current().dp.rank, topology.current().dp.size
    model = mlp()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=bucket_size, overlap_grad_reduce=overlap))
    opt = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=0.0), [ddp])
    ref_opt = reference_adamw(ref, LR, WD)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        micro = local_rows(x, rank, size).chunk(accum), local_rows(y, rank, size).chunk(accum)
        for i, (xm, ym) in enumerate(zip(*micro)):
            loss = F.mse_loss(ddp(xm), ym) / accum
            if i < accum - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        ddp.finish_grad_sync()
        assert all(p.grad is None for p in model.parameters())
        assert opt.step()[0]
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    errors = {n: rel_err(p, r) for (n, p), r in zip(model.named_parameters(), ref.parameters())}
    return errors, [p.detach().tolist() for p in model.parameters()]


def _train_modes():
    topology.initialize()
    return [_train(True, 1, 100), _train(False, 1, None), _train(True, 2, 200)]


def _check(results):
    for errors, _ in results:
        assert max(errors.values()) <= 1e-6, errors
    for _, params in results[1:]:
        assert params == results[0][1], "DP ranks diverged"


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_matches_single_process(dp):
    overlapped, plain, accumulated = zip(*run_distributed(_train_modes, dp, timeout=180))
    for results in (overlapped, plain, accumulated):
        _check(results)
    for a, b in zip(overlapped[0][1], plain[0][1]):
        assert rel_err(torch.tensor(a), torch.tensor(b)) <= 1e-6


def test_main_grad_buffer_layout_single_process():
    model = mlp()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=200))
    ref = copy.deepcopy(model)
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    params = list(model.parameters())
    (buffer,) = ddp.buffers
    assert buffer.params == params[::-1]
    assert buffer.grad_data.numel() == sum(p.numel() for p in params)
    assert len(buffer.buckets) > 1
    for p, r in zip(params, ref.parameters()):
        assert p.grad is None
        assert p.main_grad.data_ptr() >= buffer.grad_data.data_ptr()
        torch.testing.assert_close(p.main_grad, r.grad, rtol=0, atol=1e-7)
    ddp.finish_grad_sync()
    ddp.scale_gradients(0.5)
    torch.testing.assert_close(params[0].main_grad, 0.5 * next(ref.parameters()).grad, rtol=0, atol=1e-7)
    ddp.zero_grad_buffer()
    assert not buffer.grad_data.any()


def test_dropped_wrapper_frees_its_model_and_buffers():
    """The gradient hooks must not keep the wrapper alive: a parameter's hook holding it is a cycle the garbage
    collector cannot see through, which kept every finished model's weights and gradient buffers allocated
    (on a GPU, device memory until the process ended)."""
    model = mlp()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=200))
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    refs = [weakref.ref(ddp), weakref.ref(model), weakref.ref(ddp.buffers[0]), weakref.ref(next(model.parameters()))]
    del model, ddp
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_bad_config_and_second_backward_without_no_sync():
    with pytest.raises(ValueError, match="bucket_size must be a positive number of elements or None, got 0"):
        DDPConfig(bucket_size=0)
    ddp = DistributedDataParallel(mlp(), DDPConfig(bucket_size=None))
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        F.mse_loss(ddp(x), y).backward()


def _expert_and_finalize():
    """ep=2 on 4 ranks: expert grads average over expert_dp (size 2) scaled by 1/dp (4);
    sequence-parallel grads sum over TP; shared embeddings sum over the embedding group."""
    topo = topology.initialize(ep=2)
    me = dist.get_rank()
    model = torch.nn.Linear(3, 2)
    model.weight.expert_parallel = True
    model.bias.sequence_parallel = True
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=None))
    ddp(torch.ones(1, 3) * (me + 1)).sum().backward()
    finalize_model_grads([ddp])
    edp = topo.expert_dp.ranks
    expected_w = torch.full((2, 3), float(sum(r + 1 for r in edp)) / topo.dp.size)
    torch.testing.assert_close(model.weight.main_grad, expected_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.bias.main_grad, torch.ones(2), rtol=0, atol=1e-6)
    return edp


def test_expert_grads_reduce_over_expert_dp():
    results = run_distributed(_expert_and_finalize, 4, timeout=180)
    assert results[0] == [0, 2] and results[1] == [1, 3]


def _finalize_tp_and_embedding():
    topo = topology.initialize(tp=2, pp=2)
    me = dist.get_rank()
    model = torch.nn.Linear(2, 2, bias=True)
    model.bias.sequence_parallel = True
    model.weight.shared_embedding = True
    ddp = DistributedDataParallel(model)
    ddp(torch.ones(1, 2) * (me + 1)).sum().backward()
    finalize_model_grads([ddp])
    tp_sum = float(len(topo.tp.ranks))
    emb_sum = float(sum(r + 1 for r in topo.embedding.ranks))
    torch.testing.assert_close(model.bias.main_grad, torch.full((2,), tp_sum), rtol=0, atol=1e-6)
    torch.testing.assert_close(model.weight.main_grad, torch.full((2, 2), emb_sum), rtol=0, atol=1e-6)


def test_finalize_sums_sequence_parallel_and_shared_embedding_grads():
    run_distributed(_finalize_tp_and_embedding, 4, timeout=180)


def _sharded_embedding_sum():
    """pp=2 x dp=2 with ZeRO-1: the tied embedding sits at different buffer offsets on the first and
    last stage, yet each rank's shard of its grad must be the DP mean summed over both stages."""
    topo = topology.initialize(pp=2)
    me = dist.get_rank()
    embedding = torch.nn.Parameter(torch.zeros(5, 3))
    embedding.shared_embedding = True
    other = torch.nn.Parameter(torch.zeros(7))
    model = torch.nn.Module()
    if topo.is_first_stage():
        model.embedding, model.other = embedding, other
    else:
        model.other, model.embedding = other, embedding
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=None, use_distributed_optimizer=True))
    coeff = torch.arange(15.0).view(5, 3)
    ((embedding * coeff).sum() * (me + 1) + other.sum()).backward()
    finalize_model_grads([ddp])
    buffer = next(b for b in ddp.buffers if embedding in b.range_of)
    lo, hi = buffer.local_range(embedding)
    stage_means = [sum(r + 1 for r in dp_ranks) / topo.dp.size for dp_ranks in topo.all_groups["dp"]]
    expected = coeff.view(-1) * sum(stage_means)
    torch.testing.assert_close(embedding.main_grad.view(-1)[lo:hi], expected[lo:hi], rtol=0, atol=1e-5)


def test_zero1_shards_of_tied_embedding_sum_over_stages():
    run_distributed(_sharded_embedding_sum, 4, timeout=180)


def _expert_grads_with_single_rank_expert_dp():
    """ep=2 on 2 ranks: expert-DP has one rank, yet expert grads are still averaged over dense DP."""
    topo = topology.initialize(ep=2)
    assert topo.expert_dp.size == 1 and topo.dp.size == 2
    weight = torch.nn.Parameter(torch.zeros(3))
    weight.expert_parallel = True
    model = torch.nn.Module()
    model.weight = weight
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=None))
    (weight.sum() * (dist.get_rank() + 1)).backward()
    finalize_model_grads([ddp])
    torch.testing.assert_close(weight.main_grad, torch.full((3,), (dist.get_rank() + 1) / 2), rtol=0, atol=1e-6)


def test_expert_grads_scaled_when_expert_dp_is_one_rank():
    run_distributed(_expert_grads_with_single_rank_expert_dp, 2, timeout=180)


def test_unknown_shard_collectives_is_rejected():
    with pytest.raises(ValueError, match="shard_collectives must be auto, scatter_gather or reduce_broadcast, got 'x'"):
        DDPConfig(shard_collectives="x")


def _launch_timing():
    """Which buckets have a collective in flight: none during no_sync micro-batches; with overlap, the
    first bucket (the last layers) is launched while backward still runs through the first layer."""
    topo = topology.initialize()
    model = mlp()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=100, overlap_grad_reduce=True))
    (buffer,) = ddp.buffers
    seen = {}

    def launched():
        return [b.grad_handle is not None for b in buffer.buckets]

    def record(grad):
        seen.setdefault("inside backward", launched())

    def watch(module, args, out):
        out.register_hook(record)

    model[0].register_forward_hook(watch)
    x, y = batch(0)
    xs, ys = local_rows(x, topo.dp.rank, 2).chunk(2), local_rows(y, topo.dp.rank, 2).chunk(2)
    with ddp.no_sync():
        F.mse_loss(ddp(xs[0]), ys[0]).backward()
    seen["after no_sync"] = launched()
    seen.pop("inside backward")
    F.mse_loss(ddp(xs[1]), ys[1]).backward()
    seen["after last backward"] = launched()
    ddp.finish_grad_sync()
    return len(buffer.buckets), seen


def test_buckets_launch_during_last_backward_only():
    for count, seen in run_distributed(_launch_timing, 2, timeout=180):
        assert count >= 3
        assert seen["after no_sync"] == [False] * count
        assert seen["inside backward"][0] and not seen["inside backward"][-1], seen
        assert seen["after last backward"] == [True] * count
