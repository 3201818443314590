"""Scoring-server (teacher on one rank) benchmark: bytes moved, memory of owner / non-owner / every-rank-copy, prefetch on/off.

On ``--world`` ranks (gloo on CPU, NCCL on GPUs), each rank trains a small student GPT by forward KL to a
larger teacher GPT.  The teacher is served from rank 0 (full vocabulary, then top-k) or, as the peer, every
rank holds its own copy (the replicated fallback).  Printed per mode:

- bytes moved per iteration (all ranks, inputs + results) beside the analytic amount: the inputs
  ``ids, mask`` (int64) of the non-owners to the owner, and per token ``V`` fp32 log-probs (full) or ``k``
  fp32 values + ``k`` int64 indices (top-k), plus one fp32 next-token log-prob, back to them;
- memory: teacher weights + transport buffers (tensor bytes) and the process's peak RSS growth, on the
  owner and a non-owner (CUDA peak allocated bytes on GPU);
- step time (waiting for the teacher included; the first step warms up) with prefetch on (depth 1: the
  teacher works on batch i+1 while the student trains on i) and off,
  and the ratio to the every-rank-copy peer.

    python benchmarks/scoring_server.py [--world 2] [--vocab 8192] [--topk 16] [--iters 8]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite import topology  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.rlhf.scoring_server import ScoringServer, Prefetcher  # noqa: E402
from megalite.rlhf.distillation import TeacherOutput, forward_kl, teacher_fn  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(args, mode: str, topk, depth: int) -> dict:
    rank = dist.get_rank()
    device = topology.device()
    torch.set_num_threads(1)
    rss_start = _rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    single = dist.new_subgroups(group_size=1)[0]
    holds = mode == "replicated" or rank == 0
    teacher_weights = 0
    fn = None
    if holds:
        teacher = GPTModel(GPTConfig(vocab_size=args.vocab, num_layers=args.teacher_layers,
                                     hidden_size=args.teacher_hidden, num_attention_heads=4,
                                     max_position_embeddings=args.seq_length, seed=1), tp_group=single).to(device).eval()
        teacher_weights = sum(p.numel() * p.element_size() for p in teacher.parameters())
        fn = teacher_fn(teacher, topk)
    student = GPTModel(GPTConfig(vocab_size=args.vocab, num_layers=1, hidden_size=64, num_attention_heads=4,
                                 max_position_embeddings=args.seq_length, seed=2), tp_group=single).to(device)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-3)
    central = ScoringServer(fn, owner=0, replicated=mode == "replicated", device=device)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq_length), generator=g),
                torch.ones(args.batch, args.seq_length, dtype=torch.long)) for _ in range(args.iters + 1)]
    starts = []
    for (ids, mask), outputs in Prefetcher(central, batches, depth=depth):
        starts.append(time.perf_counter())
        logits = student(ids.to(device), attention_mask=mask.to(device))
        teacher = TeacherOutput.from_outputs(tuple(o.to(device) for o in outputs))
        forward_kl(logits, teacher).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    starts.append(time.perf_counter())
    dist.barrier()
    central.close()
    buffers = sum(b.numel() * b.element_size() for b in central._buffers.values())
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes() - rss_start
    return {"bytes": (central.bytes_sent + central.bytes_received) / (args.iters + 1),
            "sent": central.bytes_sent / (args.iters + 1), "weights": teacher_weights, "buffers": buffers,
            "peak": peak, "step_ms": 1e3 * (starts[-1] - starts[1]) / (len(starts) - 2)}


def analytic_bytes(args, topk, world: int) -> float:
    """Inputs from the non-owners plus their results, per iteration."""
    tokens = args.batch * args.seq_length
    per_token = (args.vocab * 4 if topk is None else topk * (4 + 8)) + 4
    return (world - 1) * tokens * (2 * 8 + per_token)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--teacher-hidden", type=int, default=256)
    p.add_argument("--teacher-layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args(argv)
    mib = 2 ** 20
    print(f"world {args.world}, teacher h{args.teacher_hidden} x {args.teacher_layers} layers, vocab {args.vocab}, "
          f"{args.batch} x {args.seq_length} tokens per rank; GPT-2 vocabulary scale (50257, 8 x 1024 tokens): full "
          f"log-probs {8 * 1024 * 50257 * 4 / 1e6:.0f} MB per rank per iteration, top-{args.topk} "
          f"{8 * 1024 * args.topk * 12 / 1e6:.1f} MB")
    peer_ms = None
    for label, mode, topk in (("every rank holds a copy (peer)", "replicated", None),
                              ("scoring server, full vocabulary", "served", None),
                              (f"scoring server, top-{args.topk}", "served", args.topk)):
        timings = {}
        for depth in (1, 0):
            results = run_distributed(_rank, args.world, args, mode, topk, depth, timeout=1200)
            timings[depth] = max(r["step_ms"] for r in results)
        owner, other = results[0], results[-1]
        moved = sum(r["sent"] for r in results)
        peer_ms = timings[1] if peer_ms is None else peer_ms
        print(f"\n{label}")
        print(f"  bytes moved per iteration: {moved / mib:.2f} MiB (analytic "
              f"{(0 if mode == 'replicated' else analytic_bytes(args, topk, args.world)) / mib:.2f} MiB)")
        print(f"  owner:     teacher weights {owner['weights'] / mib:.1f} MiB, buffers {owner['buffers'] / mib:.1f} "
              f"MiB, peak growth {owner['peak'] / mib:.1f} MiB")
        print(f"  non-owner: teacher weights {other['weights'] / mib:.1f} MiB, buffers {other['buffers'] / mib:.1f} "
              f"MiB, peak growth {other['peak'] / mib:.1f} MiB")
        print(f"  step time: prefetch on {timings[1]:.1f} ms, off {timings[0]:.1f} ms; "
              f"ratio to peer (prefetch on) {timings[1] / peer_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
