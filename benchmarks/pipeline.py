"""megalite pipeline schedules vs torch.distributed.pipelining, same 4-stage model, same ranks, one run.

Four pipeline ranks (gloo on CPU, or one GPU per rank under NCCL) train an MLP stack split into 4 stages
(8 virtual stages when interleaved or V-shaped) on m=8 micro-batches.  The blocks are megalite's column-
and row-parallel linears (tp=1), whose weight gradients the zero-bubble schedules defer.  Pairs compared,
alternating step by step: megalite 1F1B vs torch Schedule1F1B, interleaved 1F1B vs
ScheduleInterleaved1F1B, zero-bubble-h1 vs ScheduleInterleavedZeroBubble (one stage per rank), zbv vs
ScheduleZBVZeroBubble.  Prints the median step time of the slowest rank, the ratio megalite/torch, the
median CPU time summed over ranks (gloo threads included; far less disturbed by other load on the
machine), the grad difference between the two sides (same weights, same data), and one line per schedule
``bubble <schedule> measured <x> analytic <y>`` (megalite's measured bubble of one extra step; the
analytic value assumes equal F, B and W times).  Writes Gantt charts (when matplotlib is installed) and,
with --trace-dir, Chrome traces of that step with tools/plot_pipeline.py.

    python benchmarks/pipeline.py [--steps 6] [--hidden 256] [--seq-length 64] [--batch 4] [--png-dir benchmarks]
                                  [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from extras import missing
from megalite import topology
from megalite.pipeline import (PipelineRecorder, StageMap, analytic_bubble, bubble_fraction, build_chunks,
                               forward_backward)
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megalite.testing import run_distributed
from megalite.topology import device

# (megalite schedule, model chunks per rank, torch schedule class, PNG name)
SCHEDULES = (("1f1b", 1, Schedule1F1B, "pipeline_1f1b.png"),
             ("interleaved-1f1b", 2, ScheduleInterleaved1F1B, "pipeline_interleaved.png"),
             ("zero-bubble-h1", 1, ScheduleInterleavedZeroBubble, "pipeline_zb_h1.png"),
             ("zbv", 2, ScheduleZBVZeroBubble, "pipeline_zbv.png"))

PP, M, LAYERS_PER_VIRTUAL_STAGE_MAX = 4, 8, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = ColumnParallelLinear(hidden, 4 * hidden), RowParallelLinear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Stage(nn.Module):
    """A run of blocks; megalite feeds non-first stages through set_input_tensor."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x=None):
        return self.blocks(self.input_tensor if x is None else x)


def stage_modules(hidden, schedule, vpp, pp_group):
    """This rank's stage modules, cut from one seeded full model (8 blocks) by ``pipeline.build_chunks``."""
    torch.manual_seed(0)
    blocks = [Block(hidden) for _ in range(PP * LAYERS_PER_VIRTUAL_STAGE_MAX)]
    for b in blocks:
        b.to(device())
    return build_chunks(lambda *, layer_range, **_: Stage(blocks[slice(*layer_range)]), len(blocks), pp_group,
                        vpp=vpp, schedule=schedule)


def stage_index(schedule, rank, chunk):
    return StageMap.for_schedule(schedule, PP).stage(rank, chunk)


def make_data(hidden, seq, batch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * batch, seq, hidden, generator=g).to(device())
    y = torch.randn(M * batch, seq, hidden, generator=g).to(device())
    return x, y


def megalite_step(schedule, chunks, x, y, batch, rank, recorder=None):
    """One forward_backward over M micro-batches; activations are [s, b, h] between stages."""
    mbs = [(x[i * batch:(i + 1) * batch].transpose(0, 1), y[i * batch:(i + 1) * batch].transpose(0, 1))
           for i in range(M)]
    stages = [stage_index(schedule, rank, c) for c in range(len(chunks))]
    first = chunks[stages.index(0)] if 0 in stages else None
    last = chunks[stages.index(PP * len(chunks) - 1)] if PP * len(chunks) - 1 in stages else None

    def forward_step(data_iterator, chunk):
        inp, target = next(data_iterator)
        out = chunk(inp if chunk is first else None)
        return out, (lambda o: (nn.functional.mse_loss(o, target), {})) if chunk is last else None

    iterators = [iter(mbs) for _ in chunks]
    shape = (x.shape[1], batch, x.shape[2])
    several = len(chunks) > 1
    forward_backward(forward_step, iterators if several else iterators[0], chunks if several else chunks[0],
                     M, tensor_shape=shape, recorder=recorder, schedule=schedule)


def torch_schedule(schedule, torch_class, chunks, hidden, seq, batch, rank, group):
    vpp = len(chunks)
    stages = []
    for c, chunk in enumerate(chunks):
        index = stage_index(schedule, rank, c)
        # Received activations must require grad so that input grads flow back upstream.
        example = torch.empty(batch, seq, hidden, device=device(), requires_grad=index > 0)
        stages.append(PipelineStage(chunk, index, PP * vpp, device(), input_args=example, group=group))
    loss = nn.functional.mse_loss
    return torch_class(stages[0] if torch_class is Schedule1F1B else stages, M, loss_fn=loss)


def torch_step(schedule, torch_schedule, x, y, rank):
    """Rank 0 feeds the inputs; the rank of the last stage (rank 0 under zbv) gets the targets."""
    last = 0 if schedule == "zbv" else PP - 1
    kwargs = {"target": y, "losses": []} if rank == last else {}
    if rank == 0:
        torch_schedule.step(x, **kwargs)
    else:
        torch_schedule.step(**kwargs)


def grads(chunks):
    return [p.grad.clone() for c in chunks for p in c.parameters()]


def zero(chunks):
    for c in chunks:
        for p in c.parameters():
            p.grad = None


def bench(steps, hidden, seq, batch):
    topo = topology.initialize(pp=PP)
    rank, group = topo.pp.rank, topo.pp.group
    x, y = make_data(hidden, seq, batch)
    results = {}
    for schedule, vpp, torch_class, _ in SCHEDULES:
        mine = stage_modules(hidden, schedule, vpp, group)
        theirs = stage_modules(hidden, schedule, vpp, group)
        theirs_schedule = torch_schedule(schedule, torch_class, theirs, hidden, seq, batch, rank, group)
        times = {"megalite": [], "torch": []}
        cpu = {"megalite": [], "torch": []}
        for step in range(steps + 2):
            for name in ("megalite", "torch") if step % 2 == 0 else ("torch", "megalite"):
                chunks = mine if name == "megalite" else theirs
                zero(chunks)
                dist.barrier(group)
                start, cpu_start = time.perf_counter(), time.process_time()
                if name == "megalite":
                    megalite_step(schedule, chunks, x, y, batch, rank)
                else:
                    torch_step(schedule, theirs_schedule, x, y, rank)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                cpu_time = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(cpu_time, group=group)
                if step >= 2:
                    times[name].append(elapsed.item())
                    cpu[name].append(cpu_time.item())
        diff = max((a - b).abs().max().item() for a, b in zip(grads(mine), grads(theirs)))
        zero(mine)
        recorder = PipelineRecorder()
        dist.barrier(group)
        megalite_step(schedule, mine, x, y, batch, rank, recorder)
        diff_t = torch.tensor([diff])
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX, group=group)
        results[schedule] = {"megalite": statistics.median(times["megalite"]),
                             "torch": statistics.median(times["torch"]),
                             "cpu": {k: statistics.median(v) for k, v in cpu.items()},
                             "grad_diff": diff_t.item(), "events": recorder.events, "load": os.getloadavg()[0]}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--png-dir", default=os.path.join(ROOT, "benchmarks"))
    parser.add_argument("--trace-dir", default=None, help="also write each Gantt step as a Chrome trace JSON here")
    args = parser.parse_args()
    per_rank = run_distributed(bench, PP, args.steps, args.hidden, args.seq_length, args.batch, timeout=900)

    spec = importlib.util.spec_from_file_location("plot_pipeline", os.path.join(ROOT, "tools", "plot_pipeline.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    install = missing("matplotlib", "plot") if args.png_dir else None
    if install:
        print(f"note: no Gantt charts without matplotlib ({install})")
    draw = bool(args.png_dir) and not install
    print(f"pp={PP}, m={M}, hidden={args.hidden}, micro-batch {args.batch}x{args.seq_length} tokens, "
          f"{args.steps} timed steps (median of the slowest rank), device={device()}")
    print(f"{'schedule':<18}{'torch':>12}{'megalite':>12}{'ratio':>8}{'max |grad diff|':>18}{'bubble':>9}"
          f"{'CPU torch':>12}{'CPU megalite':>14}{'CPU ratio':>11}{'load':>6}")
    bubbles = {}
    for schedule, vpp, _, png in SCHEDULES:
        r = per_rank[0][schedule]
        recorders = [PipelineRecorder(rank, res[schedule]["events"], schedule=schedule)
                     for rank, res in enumerate(per_rank)]
        bubbles[schedule] = bubble = bubble_fraction(recorders)
        print(f"{schedule:<18}{r['torch'] * 1e3:>10.1f}ms{r['megalite'] * 1e3:>10.1f}ms"
              f"{r['megalite'] / r['torch']:>8.3f}{r['grad_diff']:>18.2e}{bubble:>9.3f}"
              f"{r['cpu']['torch'] * 1e3:>10.1f}ms{r['cpu']['megalite'] * 1e3:>12.1f}ms"
              f"{r['cpu']['megalite'] / r['cpu']['torch']:>11.3f}{r['load']:>6.1f}")
        if draw:
            path = os.path.join(args.png_dir, png)
            plot.plot(recorders, path, f"megalite {schedule}, pp={PP}, m={M}: measured bubble {bubble:.1%}")
            print(f"  Gantt chart of one megalite step: {path}")
        if args.trace_dir:
            path = os.path.join(args.trace_dir, os.path.splitext(png)[0] + ".trace.json")
            with open(path, "w") as f:
                json.dump(plot.chrome_trace(recorders), f)
            print(f"  Chrome trace of that step: {path}")
    for schedule, vpp, _, _ in SCHEDULES:
        analytic = analytic_bubble(schedule, PP, M, vpp)
        print(f"bubble {schedule} measured {bubbles[schedule]:.4f} analytic {analytic:.4f}")


if __name__ == "__main__":
    main()
