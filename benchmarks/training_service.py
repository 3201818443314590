"""TrainingService overhead of Ray actors against local processes: start-up time and time per training step.

Both backends run the same small GPT at tp2 (2 CPU workers, gloo) on the same batches.  A step is
``forward_backward`` + ``optim_step``, either awaited one call at a time (a driver that needs each result
before the next call: every call pays the round trip) or pipelined (all steps queued, then awaited together).
The first steps warm up and are not timed.  Printed: seconds to start, ms per step, and ray / local.

    python benchmarks/training_service.py [--steps 20] [--hidden 64] [--seq-length 32] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extras import require  # noqa: E402
from megalite.models import GPTConfig  # noqa: E402
from megalite.optim import OptimizerConfig  # noqa: E402
from megalite.rlhf import ParallelLayout, TrainingService  # noqa: E402

WARMUP = 2


def batch(step: int, args) -> dict:
    ids = torch.randint(1, args.vocab, (args.batch, args.seq_length + 1), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(args.batch, args.seq_length)}


async def measure(backend: str, args, directory: str) -> dict:
    model = GPTConfig(num_layers=2, hidden_size=args.hidden, num_attention_heads=4, vocab_size=args.vocab,
                      max_position_embeddings=args.seq_length + 1, hidden_dropout=0.0, attention_dropout=0.0)
    start = time.perf_counter()
    service = await TrainingService.options(procs=2, backend=backend).as_service(
        model=model, optimizer=OptimizerConfig(lr=1e-3), loss_fn="language_model",
        parallel=ParallelLayout(tp=2, micro_batch_size=args.batch), checkpoint_dir=os.path.join(directory, backend))
    result = {"start_s": time.perf_counter() - start}
    try:
        for step in range(WARMUP):
            await service.forward_backward(batch(step, args))
            await service.optim_step()
        start = time.perf_counter()
        for step in range(args.steps):
            await service.forward_backward(batch(step, args))
            await service.optim_step()
        result["awaited_ms"] = (time.perf_counter() - start) / args.steps * 1e3
        start = time.perf_counter()
        calls = []
        for step in range(args.steps):
            calls += [service.forward_backward(batch(step, args)), service.optim_step()]
        await asyncio.gather(*calls)
        result["pipelined_ms"] = (time.perf_counter() - start) / args.steps * 1e3
    finally:
        await service.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()
    require("ray", "ray", "the Ray-vs-local comparison")
    with tempfile.TemporaryDirectory() as directory:
        results = {backend: asyncio.run(measure(backend, args, directory)) for backend in ("local", "ray")}
    print(f"tp2, 2 CPU workers, hidden {args.hidden}, seq {args.seq_length}, batch {args.batch}, {args.steps} steps")
    print(f"{'':18s}{'local':>10s}{'ray':>10s}{'ray/local':>11s}")
    for key, label in (("start_s", "start (s)"), ("awaited_ms", "awaited ms/step"),
                       ("pipelined_ms", "pipelined ms/step")):
        local, remote = results["local"][key], results["ray"][key]
        print(f"{label:18s}{local:10.2f}{remote:10.2f}{remote / local:10.2f}x")


if __name__ == "__main__":
    main()
