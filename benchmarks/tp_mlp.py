"""TP MLP block (column then row parallel linear): megalite against torch DTensor tensor parallelism.

Both run on the same ranks, shapes and weights in one process group: h=1024,
ffn=4h, tokens b*s=4*256, forward plus backward, fp32 on CPU with gloo.  Prints
the median step time of each, their ratio (target megalite <= 0.9x DTensor),
and the bytes each rank hands to collectives per step next to the analytic
minimum for one block: one all-reduce of b*s*h in forward and one in backward.  The two run
alternately step by step; CPU time summed over ranks is printed beside wall time.

    python benchmarks/tp_mlp.py [--tensor-model-parallel-size 2 4] [--iters 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from megalite import topology
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.testing import run_distributed

H, BATCH, SEQ = 1024, 4, 256
COLLECTIVES = {"allreduce_", "allgather_into_tensor_coalesced", "_allgather_base_", "_reduce_scatter_base_",
               "reduce_scatter_tensor_coalesced", "all_reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor", "allgather_", "reduce_scatter_"}


class CollectiveBytes(TorchDispatchMode):
    """Counts the payload bytes this rank passes to c10d / functional collectives."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.split("::")[0] in ("c10d", "_c10d_functional") and func._schema.name.split("::")[1] in COLLECTIVES:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            size = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            self.bytes += size
            self.calls.append((name, size))
        return func(*args, **(kwargs or {}))


class MegaliteMLP(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.fc1 = ColumnParallelLinear(H, 4 * H, tp_group=group)
        self.fc2 = RowParallelLinear(4 * H, H, tp_group=group)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class PlainMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _full_weights(model, group):
    """megalite's parameters reassembled into full tensors, keyed like PlainMLP's."""
    full = {}
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, param.detach(), group=group)
            full[name] = torch.cat(parts, dim=param.partition_dim)
        else:
            full[name] = param.detach().clone()
    return full


def _dtensor_mlp(tp, weights):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plain = PlainMLP()
    plain.load_state_dict(weights)
    mesh = init_device_mesh("cpu", (tp,))
    return parallelize_module(plain, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _step(model, x, dy):
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).backward(dy)


def _bench(tp, iters):
    topology.initialize(tp=tp)
    group = topology.current().tp.group
    torch.manual_seed(0)
    ours = MegaliteMLP(group)
    theirs = _dtensor_mlp(tp, _full_weights(ours, group))
    # The block's input needs a gradient, as inside a transformer: that is the backward all-reduce.
    x, dy = torch.randn(SEQ, BATCH, H, requires_grad=True), torch.randn(SEQ, BATCH, H)

    with torch.no_grad():
        differs = (ours(x) - theirs(x)).abs().max().item()

    counts = {}
    for name, model in (("megalite", ours), ("dtensor", theirs)):
        _step(model, x, dy)
        with CollectiveBytes() as counter:
            _step(model, x, dy)
        counts[name] = (counter.bytes, [c for c, _ in counter.calls])

    # Interleave the two step by step (alternating which goes first) so machine load hits both alike.
    # Wall time is barrier to barrier; CPU time is summed over ranks (gloo threads included), which
    # other processes on the machine disturb far less.
    times = {"megalite": [], "dtensor": []}
    cpu = {"megalite": [], "dtensor": []}
    for i in range(iters + 1):
        order = (("megalite", ours), ("dtensor", theirs))
        for name, model in order if i % 2 else order[::-1]:
            dist.barrier(group)
            start, cpu_start = time.perf_counter(), time.process_time()
            _step(model, x, dy)
            dist.barrier(group)
            elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(elapsed, group=group)
            if i:
                times[name].append(elapsed[0].item() / tp)
                cpu[name].append(elapsed[1].item())
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items()}, "counts": counts,
            "output_differs": differs, "load": os.getloadavg()[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, nargs="+", default=[2, 4],
                        help="the TP sizes to measure, each beside one rank")
    parser.add_argument("--iters", type=int, default=9)
    args = parser.parse_args()
    minimum = 2 * BATCH * SEQ * H * 4
    print(f"TP MLP h={H} ffn={4 * H} tokens={BATCH}x{SEQ} fp32, CPU/gloo, forward+backward, median of {args.iters}")
    for tp in args.tensor_model_parallel_size:
        result = run_distributed(_bench, tp, tp, args.iters, timeout=1800)[0]
        ours, theirs = result["times"]["megalite"], result["times"]["dtensor"]
        cpu_ours, cpu_theirs = result["cpu"]["megalite"], result["cpu"]["dtensor"]
        print(f"tp={tp}: megalite {ours * 1e3:8.1f} ms   DTensor {theirs * 1e3:8.1f} ms   "
              f"ratio {ours / theirs:.3f}x (target <= 0.90x)   load average {result['load']:.1f}")
        print(f"       CPU time summed over ranks: megalite {cpu_ours * 1e3:8.1f} ms   DTensor {cpu_theirs * 1e3:8.1f} ms"
              f"   ratio {cpu_ours / cpu_theirs:.3f}x")
        for name, (sent, calls) in result["counts"].items():
            print(f"       {name:8s} collective bytes/rank/step {sent:>10d}  analytic minimum {minimum:>10d}  "
                  f"ratio {sent / minimum:.2f}  ({', '.join(calls)})")
        print(f"       same weights and output: max |megalite - DTensor| = {result['output_differs']:.2e}")


if __name__ == "__main__":
    main()
