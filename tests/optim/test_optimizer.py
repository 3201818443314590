import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.checkpoint import load_sharded, save_sharded
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megalite.optim import (ConstantGradScaler, DynamicGradScaler, OptimizerConfig, clip_grad_norm,
                            get_optimizer)
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.testing import run_distributed
from tests.distributed.models import batch, local_rows, mlp, reference_adamw, rel_err

LR, WD, CLIP = 1e-3, 0.01, 0.05


class TPMLP(nn.Module):
    """column-parallel -> gelu -> row-parallel -> layer norm -> replicated head."""

    def __init__(self):
        super().__init__()
        self.fc1 = ColumnParallelLinear(8, 16)
        self.fc2 = RowParallelLinear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.fc2(F.gelu(self.fc1(x)))))


def _reference(seed: int = 0) -> nn.Module:
    """The unsharded TPMLP, drawing its weights from the generator in the same order."""
    torch.manual_seed(seed)
    w1 = torch.empty(16, 8).normal_(0, 0.02)
    w2 = torch.empty(8, 16).normal_(0, 0.02)
    head = nn.Linear(8, 4)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8), head)
    with torch.no_grad():
        ref[0].weight.copy_(w1)
        ref[2].weight.copy_(w2)
        ref[0].bias.zero_()
        ref[2].bias.zero_()
    return ref


def _shard(full: torch.Tensor, param, tp: int, tp_rank: int) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def _zero_parity(tp: int, overlap_param_gather: bool, collectives: str = "auto", steps: int = 5):
    """ZeRO-1 (with clipping) on TPMLP vs. torch AdamW + clip_grad_norm_ in one process."""
    topo = topology.initialize(tp=tp)
    torch.manual_seed(0)
    model = TPMLP()
    ref = _reference()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=64, use_distributed_optimizer=True,
                                                   shard_collectives=collectives))
    opt = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP,
                                        overlap_param_gather=overlap_param_gather), [ddp])
    ref_opt = reference_adamw(ref, LR, WD)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(ddp(local_rows(x, topo.dp.rank, topo.dp.size)), local_rows(y, topo.dp.rank, topo.dp.size)).backward()
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        assert ok
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        ref_opt.step()
        norms.append((norm, ref_norm))
    ddp.finish_param_sync()
    errors = {n: rel_err(p, _shard(r, p, tp, topo.tp.rank))
              for (n, p), r in zip(model.named_parameters(), ref.parameters())}
    return errors, norms


@pytest.mark.parametrize("dp, tp, overlap, collectives", [
    (2, 1, True, "auto"), (4, 1, False, "auto"), (2, 2, False, "auto"),
    (2, 1, True, "scatter_gather"), (4, 1, False, "scatter_gather"), (2, 2, False, "reduce_broadcast")])
def test_zero1_matches_torch_adamw(dp, tp, overlap, collectives):
    for errors, norms in run_distributed(_zero_parity, dp * tp, tp, overlap, collectives, timeout=180):
        assert max(errors.values()) <= 1e-6, errors
        for norm, ref_norm in norms:
            assert abs(norm - ref_norm) <= 1e-6 * ref_norm
        assert norms[0][1] > CLIP, "clipping was not exercised"


def _clip_tp():
    topo = topology.initialize(tp=2)
    torch.manual_seed(0)
    model = TPMLP()
    ref = _reference()
    ddp = DistributedDataParallel(model)
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    finalize_model_grads([ddp])
    norm = clip_grad_norm(list(model.parameters()), 0.01)
    F.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01).item()
    errors = [rel_err(p.main_grad, _shard(r.grad, p, 2, topo.tp.rank)) for p, r in zip(model.parameters(), ref.parameters())]
    return norm, ref_norm, max(errors)


def test_clip_grad_norm_equals_torch_on_unsharded_model():
    for norm, ref_norm, err in run_distributed(_clip_tp, 2, timeout=180):
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm and ref_norm > 0.01
        assert err <= 1e-6


def test_clip_grad_norm_single_process_uses_grad():
    model, ref = mlp(), mlp()
    x, y = batch(0)
    for m in (model, ref):
        F.mse_loss(m(x), y).backward()
    norm = clip_grad_norm(model.parameters(), 0.1)
    assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item(), rel=1e-6)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="max_norm must be positive, got 0"):
        clip_grad_norm(model.parameters(), 0)


def _train_steps(ddp, opt, steps, dp_rank, dp_size):
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(ddp(local_rows(x, dp_rank, dp_size)), local_rows(y, dp_rank, dp_size)).backward()
        finalize_model_grads([ddp])
        assert opt.step()[0]


def _zero_model():
    model = mlp()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=100, use_distributed_optimizer=True))
    opt = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [ddp])
    return model, ddp, opt


def _save_at_dp(directory):
    topo = topology.initialize()
    model, ddp, opt = _zero_model()
    _train_steps(ddp, opt, range(2), topo.dp.rank, topo.dp.size)
    save_sharded(directory, 2, [ddp], opt)


def _resume_at_dp(directory):
    topo = topology.initialize()
    model, ddp, opt = _zero_model()
    load_sharded(directory, [ddp], opt)
    _train_steps(ddp, opt, range(2, 5), topo.dp.rank, topo.dp.size)
    ref = mlp()
    ref_opt = reference_adamw(ref, LR, WD)
    for step in range(5):
        x, y = batch(step)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
    return max(rel_err(p, r) for p, r in zip(model.parameters(), ref.parameters()))


def test_resharded_resume_dp4_to_dp2(tmp_path):
    run_distributed(_save_at_dp, 4, str(tmp_path), timeout=180)
    for err in run_distributed(_resume_at_dp, 2, str(tmp_path), timeout=180):
        assert err <= 1e-6


def _state_bytes(opt) -> int:
    """Bytes of Adam moments plus main parameters that do not alias the model parameters."""
    total = 0
    for shard in opt.shards:
        for value in opt.optimizer.state[shard.main].values():
            total += value.numel() * value.element_size() if value.numel() > 1 else 0
        if shard.main.untyped_storage().data_ptr() != shard.param.untyped_storage().data_ptr():
            total += shard.main.numel() * shard.main.element_size()
    return total


def _one_step(sharded: bool, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 48)).to(dtype)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=1000, use_distributed_optimizer=sharded))
    opt = get_optimizer(OptimizerConfig(bf16=dtype == torch.bfloat16), [ddp])
    ddp(torch.randn(4, 64, dtype=dtype)).float().square().mean().backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]
    return sum(p.numel() for p in model.parameters()), _state_bytes(opt)


def _memory():
    topology.initialize()
    return {str(dtype): (_one_step(False, dtype), _one_step(True, dtype)) for dtype in (torch.float32, torch.bfloat16)}


def test_zero1_optimizer_state_is_sharded():
    dp = 4
    for result in run_distributed(_memory, dp, timeout=180):
        (n, plain), (_, zero) = result["torch.bfloat16"]
        assert plain == 12 * n
        assert zero <= 12 * n / dp * 1.01 + 256
        (n, plain), (_, zero) = result["torch.float32"]
        assert plain == 8 * n
        assert zero <= 8 * n / dp * 1.01 + 256


def _fp16_skip():
    topology.initialize()
    model = mlp(dtype=torch.float16)
    ddp = DistributedDataParallel(model)
    opt = get_optimizer(OptimizerConfig(fp16=True, initial_loss_scale=2.0 ** 10, hysteresis=1), [ddp])
    outcomes = []
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        opt.scale_loss(F.mse_loss(ddp(x.half()).float(), y)).backward()
        ddp.finish_grad_sync()
        if step == 1 and dist.get_rank() == 1:
            model[0].weight.main_grad[0, 0] = float("inf")
        ok, norm, _ = opt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        outcomes.append((ok, norm is None, changed, opt.get_loss_scale()))
    assert all(s.main.dtype == torch.float32 for s in opt.shards)
    return outcomes


def test_fp16_scaler_skips_step_with_inf_on_any_rank_and_backs_off():
    for outcomes in run_distributed(_fp16_skip, 2, timeout=180):
        assert outcomes == [(True, False, True, 1024.0), (False, True, False, 512.0), (True, False, True, 512.0)]


def test_bf16_params_get_fp32_main_copies():
    model = mlp(dtype=torch.bfloat16)
    ref = mlp()
    ddp = DistributedDataParallel(model)
    opt = get_optimizer(OptimizerConfig(bf16=True, lr=LR, clip_grad=0.0), [ddp])
    ref_opt = reference_adamw(ref, LR, 0.01)
    x, y = batch(0)
    F.mse_loss(ddp(x.bfloat16()).float(), y).backward()
    assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())
    ok, norm, zeros = opt.step()
    assert ok and norm is None and zeros is None and opt.scale_loss(torch.tensor(3.0)).item() == 3.0
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    for s in opt.shards:
        assert s.main.dtype == torch.float32
        torch.testing.assert_close(s.param.view(-1), s.main.bfloat16(), rtol=0, atol=0)
    for s, r in zip(sorted(opt.shards, key=lambda s: s.key), sorted(zip([n for n, _ in ref.named_parameters()], ref.parameters()))):
        assert s.key.startswith(r[0] + "@")
        torch.testing.assert_close(s.main.view(r[1].shape), r[1], rtol=0, atol=0.02)


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler(16.0, min_scale=4.0, growth_interval=2, hysteresis=2)
    trace = []
    for found_inf in (True, True, True, True, False, False, False, False):
        scaler.update(found_inf)
        trace.append(scaler.scale)
    assert trace == [16.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 16.0]
    restored = DynamicGradScaler(1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    constant = ConstantGradScaler(8.0)
    constant.update(True)
    assert constant.scale == 8.0
    with pytest.raises(ValueError, match="min_scale=4.0, initial_scale=2.0"):
        DynamicGradScaler(2.0, min_scale=4.0)


def test_static_loss_scale_is_constant_and_dynamic_is_default():
    """``loss_scale`` gives a fixed scale that survives overflows; leaving it None keeps the dynamic one."""
    model = mlp(dtype=torch.float16)
    opt = get_optimizer(OptimizerConfig(fp16=True, loss_scale=128.0, lr=LR), [DistributedDataParallel(model)])
    assert isinstance(opt.scaler, ConstantGradScaler) and opt.get_loss_scale() == 128.0
    assert opt.scale_loss(torch.tensor(2.0)).item() == 256.0
    next(model.parameters()).main_grad.fill_(float("inf"))
    ok, _, _ = opt.step()
    assert not ok and opt.get_loss_scale() == 128.0
    dynamic = get_optimizer(OptimizerConfig(fp16=True, initial_loss_scale=64.0),
                            [DistributedDataParallel(mlp(dtype=torch.float16))])
    assert isinstance(dynamic.scaler, DynamicGradScaler) and dynamic.get_loss_scale() == 64.0


def test_bad_input():
    with pytest.raises(ValueError, match="bf16=True and fp16=True"):
        OptimizerConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="loss_scale must be positive or None .*got 0.0"):
        OptimizerConfig(fp16=True, loss_scale=0.0)
    with pytest.raises(ValueError, match="model chunk 0 is a Sequential"):
        get_optimizer(OptimizerConfig(), [mlp()])
    ddp = DistributedDataParallel(mlp())
    opt = get_optimizer(OptimizerConfig(), [ddp])
    sd = opt.sharded_state_dict()
    key = next(iter(sd["entries"]))
    sd["entries"][key]["main"] = sd["entries"][key]["main"][:3]
    with pytest.raises(ValueError, match=r"covers 3 of the \d+ elements"):
        opt.load_sharded_state_dict(sd)


def test_same_layout_state_dict_round_trip():
    ddp = DistributedDataParallel(mlp())
    opt = get_optimizer(OptimizerConfig(lr=LR), [ddp])
    x, y = batch(0)
    F.mse_loss(ddp(x), y).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    other = get_optimizer(OptimizerConfig(lr=LR), [DistributedDataParallel(mlp(seed=1))])
    other.load_state_dict(sd)
    for a, b in zip(opt.shards, other.shards):
        torch.testing.assert_close(a.main, b.main, rtol=0, atol=0)
        torch.testing.assert_close(opt.optimizer.state[a.main]["exp_avg"], other.optimizer.state[b.main]["exp_avg"])


def test_lr_set_after_load_state_dict_reaches_the_update():
    opt = get_optimizer(OptimizerConfig(lr=LR), [DistributedDataParallel(mlp())])
    other = get_optimizer(OptimizerConfig(lr=LR), [DistributedDataParallel(mlp(seed=1))])
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group in other.param_groups:
        group["lr"] = 0.123
    assert [g["lr"] for g in other.optimizer.param_groups] == [0.123] * len(other.optimizer.param_groups)


def _norm_and_zeros(sharded: bool):
    """params_norm and num_zeros_in_grad of TPMLP vs. the single-process model, before and after a step."""
    topo = topology.initialize(tp=2)
    torch.manual_seed(0)
    model = TPMLP()
    ref = _reference()
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=64, use_distributed_optimizer=sharded))
    opt = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, log_num_zeros_in_grad=True), [ddp])
    x, y = batch(0)
    x[:, :3] = 0  # fc1's weight gradient is exactly zero in 3 of its 8 input columns: 48 zeros
    before = opt.params_norm()
    opt.zero_grad()
    F.mse_loss(ddp(local_rows(x, topo.dp.rank, topo.dp.size)), local_rows(y, topo.dp.rank, topo.dp.size)).backward()
    finalize_model_grads([ddp])
    ok, _, num_zeros = opt.step()
    ddp.finish_param_sync()
    after = opt.params_norm()
    F.mse_loss(ref(x), y).backward()
    ref_zeros = sum(int((p.grad == 0).sum()) for p in ref.parameters())
    ref_before = torch.cat([p.detach().flatten() for p in ref.parameters()]).norm().item()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    reference_adamw(ref, LR, WD).step()
    ref_after = torch.cat([p.detach().flatten() for p in ref.parameters()]).norm().item()
    return ok, (before, ref_before), (after, ref_after), (num_zeros, ref_zeros)


@pytest.mark.parametrize("sharded", [False, True])
def test_params_norm_and_num_zeros_match_one_process(sharded):
    for ok, *pairs, (num_zeros, ref_zeros) in run_distributed(_norm_and_zeros, 4, sharded, timeout=180):
        assert ok and num_zeros == ref_zeros >= 48
        for norm, ref_norm in pairs:
            assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
