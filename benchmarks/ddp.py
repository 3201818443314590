"""megalite DistributedDataParallel vs torch's DistributedDataParallel, same ranks, one run.

A ~50M-parameter MLP stack (fp32) trains with AdamW and clipping at dp=4 on CPU/gloo (or one GPU
per rank under NCCL).  Each side runs in turn on the same ranks; the script prints the median step
time (slowest rank), the ratio megalite/torch, and the optimizer-state and peak RSS per rank.

    python benchmarks/ddp.py [--dp 4] [--steps 4] [--width 2048] [--layers 12]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from megalite import topology
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.testing import device, run_distributed

LR, CLIP = 1e-4, 1.0


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks).to(device())


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def time_steps(step, steps: int, warmup: int = 2) -> float:
    """Median over ``steps`` of the slowest rank's step time, in seconds."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if device().type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if torch.is_tensor(v) and v.numel() > 1)


def megalite_side(width, layers, batch, steps, zero: bool):
    model = build(width, layers)
    ddp = DistributedDataParallel(model, DDPConfig(use_distributed_optimizer=zero))
    opt = get_optimizer(OptimizerConfig(lr=LR, clip_grad=CLIP, use_distributed_optimizer=zero), [ddp])
    x = torch.randn(batch, width, device=device())
    peak = [0.0]

    def step():
        opt.zero_grad()
        ddp(x).square().mean().backward()
        ddp.finish_grad_sync()
        peak[0] = max(peak[0], rss_mib())
        opt.step()
        peak[0] = max(peak[0], rss_mib())

    seconds = time_steps(step, steps)
    return seconds, state_bytes(opt.optimizer.state), peak[0]


def torch_side(width, layers, batch, steps, zero: bool):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = build(width, layers)
    ddp = TorchDDP(model)
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

    seconds = time_steps(step, steps)
    return seconds, state_bytes(state), peak[0]


def compare(width, layers, batch, steps, zero: bool):
    """Rank function: the torch side, then the megalite side, on the same ranks."""
    torch.set_num_threads(1)
    topology.initialize()
    results = {}
    for name, side in (("torch", torch_side), ("megalite", megalite_side)):
        base = rss_mib()
        seconds, opt_bytes, peak = side(width, layers, batch, steps, zero)
        results[name] = (seconds, opt_bytes, peak - base)
        gc.collect()
    results["params"] = sum(p.numel() for p in build(width, layers).parameters())
    results["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def report(title: str, per_rank: list[dict]) -> None:
    r0 = per_rank[0]
    print(f"{title}: {r0['params'] / 1e6:.1f}M params, dp={len(per_rank)}")
    for name in ("torch", "megalite"):
        seconds = r0[name][0]
        opt_mib = max(r[name][1] for r in per_rank) / 2**20
        rss = max(r[name][2] for r in per_rank)
        print(f"  {name:9s} step {seconds * 1e3:8.1f} ms   optimizer state/rank {opt_mib:8.1f} MiB   "
              f"peak RSS growth/rank {rss:8.1f} MiB")
    print(f"  step time ratio megalite/torch: {r0['megalite'][0] / r0['torch'][0]:.3f}")


def main(zero: bool = False) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    per_rank = run_distributed(compare, args.dp, args.width, args.layers, args.batch, args.steps, zero, timeout=900)
    report("ZeRO-1: megalite DistributedOptimizer vs torch ZeroRedundancyOptimizer" if zero
           else "DDP: megalite vs torch DistributedDataParallel", per_rank)
    if zero:
        r0 = per_rank[0]
        full = 8 * r0["params"]
        worst = max(r["megalite"][1] for r in per_rank)
        print(f"  megalite ZeRO-1 optimizer state/rank vs plain DDP's ({full / 2**20:.1f} MiB): "
              f"{worst / full:.4f} (target <= {1 / len(per_rank) * 1.01:.4f})")


if __name__ == "__main__":
    main()
