"""MoE token dispatchers side by side: alltoall vs allgather, on 4 CPU ranks with ep=4.

One MoE layer (8 experts, top-2) per dispatcher, built from the same seed, runs
forward+backward on each rank's own tokens; the two alternate step by step so
that machine load affects both alike.  Prints tokens/s for each, their ratio,
and the hidden-state bytes each rank sent to other EP ranks in one dispatch
beside the analytic volumes under uniform routing: T*h*(ep-1)*(1 - C(E-E/ep, k)/C(E, k))
for alltoall (one row per (token, other rank holding one of its experts)), T*h*(ep-1) for allgather.

    python benchmarks/moe_dispatch.py [--tokens 4096] [--hidden 256] [--ffn 64] [--steps 8]

The default shapes keep the experts small next to the hidden size, so the
dispatch itself (not the expert GEMMs) decides the time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.moe import MoEConfig, MoELayer
from megalite.moe.dispatcher import ranks_per_token
from megalite.testing import run_distributed

EP, EXPERTS, TOPK = 4, 8, 2


def _step(layer, x, g):
    dist.barrier()
    start = time.perf_counter()
    out = layer(x)
    (out * g).sum().backward()
    dist.barrier()
    return time.perf_counter() - start


def _bench(tokens: int, hidden: int, ffn: int, steps: int, warmup: int):
    torch.set_num_threads(1)
    topology.initialize(ep=EP)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(tokens, 1, hidden, generator=gen)
    g = torch.randn(tokens, 1, hidden, generator=gen)
    layers = {}
    for kind in ("alltoall", "allgather"):
        torch.manual_seed(0)
        config = MoEConfig(num_experts=EXPERTS, ffn_hidden_size=ffn, topk=TOPK, dispatcher=kind,
                           grouped_gemm=True, init_method_std=0.02)
        layers[kind] = MoELayer(hidden, config)
    times = {kind: [] for kind in layers}
    for i in range(warmup + steps):
        for kind, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            elapsed = _step(layer, x, g)
            if i >= warmup:
                times[kind].append(elapsed)
    sent = {kind: layer.dispatcher.last_bytes_sent for kind, layer in layers.items()}
    return {"times": times, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    results = run_distributed(_bench, EP, args.tokens, args.hidden, args.ffn, args.steps, args.warmup,
                              timeout=900)
    tokens, hidden, elem = args.tokens, args.hidden, 4
    print(f"ep={EP}, {EXPERTS} experts, top-{TOPK}, {tokens} tokens/rank, h={hidden}, ffn={args.ffn}, "
          f"fp32 gloo, {args.steps} timed forward+backward steps (median)")
    speed = {}
    for kind in ("alltoall", "allgather"):
        per_step = [max(r["times"][kind][i] for r in results) for i in range(args.steps)]
        speed[kind] = EP * tokens / statistics.median(per_step)
        print(f"  {kind:9s}: {speed[kind]:10.0f} tokens/s")
    print(f"  alltoall / allgather speed: {speed['alltoall'] / speed['allgather']:.2f}x")
    # alltoall sends a token once to each other rank holding one of its experts: (ep-1)/ep of the ranks reached.
    reached = ranks_per_token(EXPERTS, TOPK, EP) * (EP - 1) / EP
    analytic = {"alltoall": reached * tokens * hidden * elem,
                "allgather": tokens * hidden * elem * (EP - 1)}
    for kind in ("alltoall", "allgather"):
        sent = [r["sent"][kind] for r in results]
        ratios = [s / analytic[kind] for s in sent]
        print(f"  {kind:9s} bytes sent per rank: {statistics.mean(sent) / 2**20:7.2f} MiB (per rank "
              f"{', '.join(f'{s / 2**20:.2f}' for s in sent)}), analytic {analytic[kind] / 2**20:.2f} MiB, "
              f"ratio {statistics.mean(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
