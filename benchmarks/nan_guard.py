"""Cost of the NaN/inf guard (``--check-for-nan-in-loss-and-grad``): GPT training steps with and without it.

One process (the guard's all-reduce then costs nothing, which flatters it slightly; at scale it is one
int32 per rank): a DDP-wrapped GPTModel trains with megalite's AdamW and clipping; each step either
runs ``NanGuard.check`` over the grad buffers before ``optimizer.step()`` or not.  Rounds alternate
so machine noise hits both alike.  Prints the median step times and the ratio guarded / unguarded.

    python benchmarks/nan_guard.py [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite import topology  # noqa: E402
from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.optim import OptimizerConfig, get_optimizer  # noqa: E402
from megalite.training.nan_guard import NanGuard, NanGuardConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    topo = topology.initialize()
    config = GPTConfig(vocab_size=8000, num_layers=4, hidden_size=256, num_attention_heads=8,
                       max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    chunk = DistributedDataParallel(GPTModel(config), DDPConfig(), topo.dp.group, topo.expert_dp.group)
    optimizer = get_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0), [chunk])
    guard = NanGuard(NanGuardConfig())
    ids = torch.randint(0, 8000, (4, 129))

    def step(iteration: int, guarded: bool) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = chunk(ids[:, :-1], ids[:, 1:]).mean()
        loss.backward()
        finalize_model_grads([chunk], topo.tp.group, topo.embedding.group)
        if guarded:
            guard.check(iteration, float(loss.detach()), [b.grad_data for b in chunk.buffers])
        optimizer.step()
        return time.perf_counter() - start

    times = {True: [], False: []}
    for iteration in range(2 * args.steps + 4):
        guarded = iteration % 2 == 0
        seconds = step(iteration, guarded)
        if iteration >= 4:
            times[guarded].append(seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    params = sum(p.numel() for p in chunk.parameters())
    print(f"GPT {params / 1e6:.1f}M params, batch 4 x 128, {args.steps} steps each")
    print(f"step without guard  {off * 1000:8.1f} ms")
    print(f"step with guard     {on * 1000:8.1f} ms")
    print(f"ratio guarded / unguarded: {on / off:.3f}")
    topology.destroy()


if __name__ == "__main__":
    main()
