"""megalite DistributedDataParallel vs torch's DistributedDataParallel, same ranks, one run.

A ~50M-parameter MLP stack (fp32) trains with AdamW and clipping at dp=4 on CPU/gloo (or one GPU
per rank under NCCL).  Both sides live on the same ranks: each is built and warmed up in turn (peak
RSS growth is measured there), then their steps alternate.  The script prints the median step time
(slowest rank), the median CPU time summed over ranks, the ratios megalite/torch, and the
optimizer state per rank.

    python benchmarks/ddp.py [--data-parallel-size 4] [--steps 6] [--width 2048] [--layers 12] [--bucket-size N]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.testing import run_distributed
from megalite.topology import device

LR, CLIP = 1e-4, 1.0
TORCH_BUCKET = 25 * 2**20 // 4


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks).to(device())


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def time_interleaved(steps_by_name: dict, steps: int) -> dict:
    """Alternate the sides step by step; per side the median slowest-rank wall time and rank-summed CPU time."""
    times = {name: ([], []) for name in steps_by_name}
    names = list(steps_by_name)
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            steps_by_name[name]()
            if device().type == "cuda":
                torch.cuda.synchronize()
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            times[name][0].append(wall.item())
            times[name][1].append(cpu.item())
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in times.items()}


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v) and v.numel() > 1)


def megalite_side(width, layers, batch, zero: bool, bucket_size: int):
    """(step function, optimizer state dict, peak RSS holder) for megalite DDP + AdamW."""
    model = build(width, layers)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=bucket_size, use_distributed_optimizer=zero))
    opt = get_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP), [ddp])
    x = torch.randn(batch, width, device=device())
    peak = [0.0]

    def step():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        ddp.finish_grad_sync()
        peak[0] = max(peak[0], rss_mib())
        opt.step()
        peak[0] = max(peak[0], rss_mib())

    return step, opt.optimizer.state, peak


def torch_side(width, layers, batch, zero: bool, bucket_size: int):
    """(step function, optimizer state dict, peak RSS holder) for torch DDP + fused AdamW (or ZeRO)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = build(width, layers)
    ddp = TorchDDP(model, bucket_cap_mb=bucket_size * 4 / 2**20)
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)
        state = opt.optim.state
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        state = opt.state
    x = torch.randn(batch, width, device=device())
    peak = [0.0]

    def step():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        peak[0] = max(peak[0], rss_mib())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        peak[0] = max(peak[0], rss_mib())

    return step, state, peak


def compare(width, layers, batch, steps, zero: bool, bucket_size: int):
    """Rank function: build each side and warm it up (memory is measured here), then time them interleaved."""
    torch.set_num_threads(1)
    topology.initialize()
    results, step_fns = {}, {}
    for name, side in (("torch", torch_side), ("megalite", megalite_side)):
        gc.collect()
        base = rss_mib()
        step, state, peak = side(width, layers, batch, zero, bucket_size)
        for _ in range(2):
            step()
        results[name] = [None, None, state_bytes(state), peak[0] - base]
        step_fns[name] = step
    for name, (wall, cpu) in time_interleaved(step_fns, steps).items():
        results[name][:2] = wall, cpu
    results["params"] = sum(p.numel() for p in build(width, layers).parameters())
    results["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["load"] = os.getloadavg()[0]
    return results


def report(title: str, per_rank: list[dict]) -> None:
    r0 = per_rank[0]
    print(f"{title}: {r0['params'] / 1e6:.1f}M params, dp={len(per_rank)}, load average {r0['load']:.1f}")
    for name in ("torch", "megalite"):
        seconds, cpu = r0[name][:2]
        opt_mib = max(r[name][2] for r in per_rank) / 2**20
        rss = max(r[name][3] for r in per_rank)
        print(f"  {name:9s} step {seconds * 1e3:8.1f} ms   CPU/step (all ranks) {cpu * 1e3:8.1f} ms   "
              f"optimizer state/rank {opt_mib:8.1f} MiB   peak RSS growth/rank {rss:8.1f} MiB")
    print(f"  step time ratio megalite/torch: {r0['megalite'][0] / r0['torch'][0]:.3f}   "
          f"CPU time ratio: {r0['megalite'][1] / r0['torch'][1]:.3f}")


def main(zero: bool = False) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-parallel-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bucket-size", type=int, default=TORCH_BUCKET,
                        help="gradient bucket in fp32 elements, used by both sides (default: torch DDP's 25 MiB)")
    args = parser.parse_args()
    per_rank = run_distributed(compare, args.data_parallel_size, args.width, args.layers, args.batch, args.steps, zero,
                               args.bucket_size, timeout=900)
    print(f"gradient buckets of {args.bucket_size} fp32 elements ({args.bucket_size * 4 / 2**20:.1f} MiB) on both sides")
    report("ZeRO-1: megalite DistributedOptimizer vs torch ZeroRedundancyOptimizer" if zero
           else "DDP: megalite vs torch DistributedDataParallel", per_rank)
    if zero:
        r0 = per_rank[0]
        full = 8 * r0["params"]
        worst = max(r["megalite"][2] for r in per_rank)
        print(f"  megalite ZeRO-1 optimizer state/rank vs plain DDP's ({full / 2**20:.1f} MiB): "
              f"{worst / full:.4f} (target <= {1 / len(per_rank) * 1.01:.4f})")


if __name__ == "__main__":
    main()
