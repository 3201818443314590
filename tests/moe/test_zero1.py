"""A small MoE GPT trained with DDP and ZeRO-1 at ep=2 on 4 ranks (expert-DP = 2) against one process.

Clipping is active at every step, so an expert gradient reduced over the wrong group, or its
norm counted more than once, shows up in the grad norm and in the updated weights.
"""

import contextlib

import torch

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.models import GPTModel
from megalite.moe import set_aux_loss_scale
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.testing import run_distributed
from tests.moe.test_gpt_moe import VOCAB, _config, _expert_shard

STEPS, WORLD, ROWS = 2, 4, 2


def _tokens(step):
    return torch.randint(0, VOCAB, (WORLD * ROWS, 9), generator=torch.Generator().manual_seed(50 + step))


def _train(micro_batches, distributed):
    """Weights and grad norms after STEPS steps; each step accumulates ``micro_batches`` (row ranges) of the
    global batch as a trainer would: loss and router losses divided by their number."""
    chunk = DistributedDataParallel(GPTModel(_config("llama")), DDPConfig(use_distributed_optimizer=distributed))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.05), [chunk])
    set_aux_loss_scale(chunk.module, 1.0 / len(micro_batches))
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for i, rows in enumerate(micro_batches):
            tokens = _tokens(step)[rows]
            with chunk.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (chunk(tokens[:, :-1], labels=tokens[:, 1:]).mean() / len(micro_batches)).backward()
        chunk.finish_grad_sync()
        applied, norm, _ = optimizer.step()
        assert applied
        norms.append(norm)
    return {n: p.detach().clone() for n, p in chunk.module.named_parameters()}, norms


def _rank():
    ref_weights, ref_norms = _train([slice(d * ROWS, (d + 1) * ROWS) for d in range(WORLD)], distributed=False)
    topo = topology.initialize(ep=2)
    assert topo.expert_dp.size == 2 and topo.dp.size == WORLD
    rank = topo.dp.rank
    weights, norms = _train([slice(rank * ROWS, (rank + 1) * ROWS)], distributed=True)
    errors = {"norm": max(abs(a - b) for a, b in zip(norms, ref_norms))}
    for name, weight in weights.items():
        expected = ref_weights[name]
        if "experts" in name:
            expected = _expert_shard(name, expected, topo, _config("llama"))
        errors[name] = (weight - expected).abs().max().item()
    assert min(ref_norms) > 0.05, f"clipping never engaged: {ref_norms}"
    return errors


def test_moe_zero1_with_expert_data_parallel_matches_one_process():
    for rank, errors in enumerate(run_distributed(_rank, WORLD, timeout=180)):
        name, worst = max(errors.items(), key=lambda item: item[1])
        assert worst <= 1e-5, f"rank {rank}: {name} off by {worst}"
