"""GPT split over pipeline stages (with DDP, TP and interleaving) matches the single-rank model."""

import pytest
import torch

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel
from megalite.moe import set_aux_loss_scale
from megalite.pipeline import broadcast_from_last_stage, forward_backward, split_layers
from megalite.testing import run_distributed

SEQ, BATCH, VOCAB, HIDDEN, LR, ITERS = 8, 2, 64, 32, 0.5, 2
REL = 1e-5


def _config(num_layers):
    return GPTConfig(vocab_size=VOCAB, num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4,
                     max_position_embeddings=SEQ, make_vocab_size_divisible_by=1)


def _microbatches(iteration, count):
    g = torch.Generator().manual_seed(100 + iteration)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(count)]


def _forward_step(data_iterator, chunk):
    tokens = next(data_iterator)
    per_token = chunk(input_ids=tokens[:, :-1], labels=tokens[:, 1:])

    def loss_func(output):
        loss = output.mean()
        return loss, {"loss": loss.detach()}

    return per_token, loss_func


def _reference(config, global_m):
    """Per-iteration micro-batch losses and first-iteration grads of the whole model on one rank."""
    model = GPTModel(config)
    set_aux_loss_scale(model, 1.0 / global_m)
    losses, grads = [], None
    for it in range(ITERS):
        batches = _microbatches(it, global_m)
        row = []
        for tokens in batches:
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean()
            (loss / global_m).backward()
            row.append(loss.item())
        losses.append(row)
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return losses, grads


def _reference_name(name):
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name


def _shard(full, param, tp, tp_rank):
    if getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def _gpt_pipeline(tp, pp, vpp, m, num_layers, known_shape, first=None, stage_layers=None):
    """Run ITERS SGD iterations through forward_backward; return the rel. errors against one rank.

    ``first`` sets the first stage's layer count (the rest split evenly over the other stages);
    ``stage_layers`` every stage's (as a Megatron ``--pipeline-model-parallel-layout`` does)."""
    dp = torch.distributed.get_world_size() // (tp * pp)
    ref_losses, ref_grads = _reference(_config(num_layers), dp * m)
    topo = topology.initialize(tp=tp, pp=pp, vpp=vpp)
    rank, chunks_per_rank = topo.pp.rank, vpp or 1
    config = _config(num_layers)
    chunks = []
    for c, layer_range in enumerate(split_layers(num_layers, pp, vpp, first, stage_layers=stage_layers)[rank]):
        model = GPTModel(config, pre_process=rank == 0 and c == 0,
                         post_process=rank == pp - 1 and c == chunks_per_rank - 1, layer_range=layer_range)
        chunks.append(DistributedDataParallel(model, DDPConfig(bucket_size=2000)))
    shape = (SEQ, BATCH, HIDDEN) if known_shape else None
    loss_err, grad_err = 0.0, 0.0
    for it in range(ITERS):
        mine = _microbatches(it, dp * m)[topo.dp.rank * m:(topo.dp.rank + 1) * m]
        iterators = [iter(mine) for _ in chunks]
        metrics = forward_backward(_forward_step, iterators if vpp else iterators[0], chunks if vpp else chunks[0],
                                   m, tensor_shape=shape, finalize_grads_func=finalize_model_grads)
        losses = broadcast_from_last_stage([mt["loss"].item() for mt in metrics])
        want = ref_losses[it][topo.dp.rank * m:(topo.dp.rank + 1) * m]
        loss_err = max(loss_err, max(abs(a - b) / abs(b) for a, b in zip(losses, want)))
        with torch.no_grad():
            for chunk in chunks:
                for name, p in chunk.module.named_parameters():
                    if it == 0:
                        ref = _shard(ref_grads[_reference_name(name)], p, tp, topo.tp.rank)
                        grad_err = max(grad_err, ((p.main_grad - ref).norm() / ref.norm()).item())
                    p -= LR * p.main_grad
                chunk.zero_grad_buffer()
    return loss_err, grad_err


def _two_stage_cases():
    return [_gpt_pipeline(1, 2, None, 4, 4, known_shape=True), _gpt_pipeline(1, 2, 2, 4, 4, known_shape=False),
            _gpt_pipeline(1, 2, None, 2, 3, known_shape=True, first=1),
            _gpt_pipeline(1, 2, 2, 2, 5, known_shape=True, stage_layers=[1, 3, 0, 1])]


@pytest.mark.parametrize("world, fn, args", [
    (2, _two_stage_cases, ()),
    (4, _gpt_pipeline, (1, 4, None, 4, 4, False)),
    (8, _gpt_pipeline, (2, 2, None, 2, 2, True)),
], ids=["pp2-pp2xvpp2-uneven-stages", "pp4", "tp2xdp2xpp2"])
def test_gpt_pipeline_matches_single_rank(world, fn, args):
    for rank, result in enumerate(run_distributed(fn, world, *args, timeout=240)):
        for loss_err, grad_err in (result if isinstance(result, list) else [result]):
            assert loss_err <= REL and grad_err <= REL, (rank, loss_err, grad_err)
