"""The planner (issue 40): its speed, and its step-time predictions against steps measured on this machine.

``python benchmarks/plan.py`` times ``megalite.plan.search.plan`` in process (after the imports) on Llama 3
405B over 16,384 H100s and prints how many layouts it considered and the top one.  The bound is 10 s on the
project's 2-core machine.  There is no peer to run beside it: Megatron-LM and torchtitan estimate the memory
of one given layout and do not search.

``python benchmarks/plan.py --measure`` runs ``--calibrate`` into a temporary profile, then trains a small GPT
on CPU ranks (gloo, one thread per rank) at 10 layouts of at most 2 ranks, so each rank has a core of this
2-core machine to itself, and one of 4 ranks (tp2 dp2), more ranks than cores, which the planner prices as all
ranks' work over the cores.  It prints the planner's predicted step time (and its parts) beside the measured
median for each (wall clock of the slowest rank, and CPU time: the slowest rank's process CPU time, or all ranks'
over the cores where that is more), the median and worst error, and whether the planner's top-ranked layout is
within 10% of the fastest measured.  On a machine shared with other jobs the wall clock is stretched by the load
(printed before and after); the CPU time is what the step costs without that contention, but it leaves out the time a
rank waits (the pipeline bubble, a collective's partner), so it is a lower bound of the uncontended step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.hardware import load_hardware  # noqa: E402
from megalite.plan.__main__ import preset_config  # noqa: E402
from megalite.plan.search import plan  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--vocab-size", "2000",
         "--seq-length", "256", "--max-position-embeddings", "256", "--global-batch-size", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
LAYOUTS = [  # (name, ranks, flags)
    ("1 rank, mbs 1", 1, ["--micro-batch-size", "1"]),
    ("1 rank, mbs 4", 1, ["--micro-batch-size", "4"]),
    ("1 rank, mbs 4, selective recompute", 1, ["--micro-batch-size", "4", "--recompute-granularity", "selective"]),
    ("1 rank, mbs 2, full recompute", 1, ["--micro-batch-size", "2", "--recompute-granularity", "full"]),
    ("dp2, mbs 2", 2, ["--micro-batch-size", "2"]),
    ("dp2 ZeRO-1, mbs 4", 2, ["--micro-batch-size", "4", "--use-distributed-optimizer"]),
    ("dp2 FSDP2, mbs 2", 2, ["--micro-batch-size", "2", "--use-torch-fsdp2"]),
    ("tp2 SP, mbs 2", 2, ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2, mbs 1", 2, ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]),
    ("cp2 p2p, mbs 2", 2, ["--micro-batch-size", "2", "--context-parallel-size", "2"]),
    ("tp2 dp2, 4 ranks on the cores, mbs 2", 4, ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2"]),
]


def speed() -> None:
    config, hw = preset_config("llama3-405b"), load_hardware("h100")
    for run in range(3):
        start = time.perf_counter()
        result = plan(config, 16384, hw, seq_length=8192, global_batch_size=2048)
        elapsed = time.perf_counter() - start
        best = result.ranked[0]
        print(f"run {run}: {elapsed:.2f} s, {result.considered} layouts considered, {len(result.ranked)} fit; "
              f"best {best.tokens_per_s_per_gpu:.0f} tokens/s/GPU, MFU {best.mfu:.1%}: {' '.join(best.layout.flags())}")


def _train_steps(flags: list[str], steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps after one warm-up step, on this rank."""
    import torch
    import torch.distributed as dist

    from megalite import topology
    from megalite.context_parallel import prepare_batch
    from megalite.training import gpt, setup
    from megalite.training.arguments import lr_schedule_settings, validate_args
    from megalite.training.flags import packing_config, parse_args
    from megalite.training.lr_schedule import LRScheduler
    from megalite.training.trainer import Trainer

    torch.set_num_threads(1)
    args = validate_args(parse_args(flags), dist.get_world_size())
    topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                               cp=args.context_parallel_size)
    chunks = setup.build_model(gpt.model_provider, args, topo)
    optimizer = setup.build_optimizer(args, chunks)
    trainer = Trainer(args, topo, chunks, optimizer, LRScheduler(optimizer, lr_schedule_settings(args)),
                      gpt.forward_step)
    generator = torch.Generator().manual_seed(topo.dp.rank)
    shape = (args.micro_batch_size, args.seq_length + 1)
    samples = [torch.randint(0, args.vocab_size, shape, generator=generator) for _ in range(64)]
    if topo.cp.size == 1:
        data = iter([{"tokens": tokens} for tokens in samples])
    else:
        data = iter([prepare_batch(tokens, packing_config(args), topo.cp.size, topo.cp.rank) for tokens in samples])
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train_step(data, step + 1)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    trainer.logger.close()
    return times[1:]


def measure(steps: int, profile: str | None) -> None:
    from megalite.plan.calibrate import calibrate
    from megalite.plan.estimate import estimate
    from megalite.plan.layout import Layout
    from megalite.testing import run_distributed
    from megalite.training.arguments import validate_args
    from megalite.training.flags import gpt_config, parse_args

    if profile is None:
        profile = os.path.join(tempfile.mkdtemp(), "cpu-calibrated.json")
        calibrate(profile)
    hw = load_hardware(profile)
    rows = []
    for name, ranks, extra in LAYOUTS:
        flags = MODEL + extra
        args = validate_args(parse_args(flags), ranks)
        config, layout = gpt_config(args), Layout.from_args(args, ranks)
        predicted = estimate(config, layout, hw, args.seq_length, args.global_batch_size)
        per_rank = run_distributed(_train_steps, ranks, flags, steps, timeout=600)
        # A step ends when its last rank does.
        measured = statistics.median(max(wall for wall, _ in step) for step in zip(*per_rank))
        # CPU: the slowest rank's, or, with more ranks than cores, all ranks' work over the cores.
        cores = os.cpu_count() or 1
        cpu = statistics.median(max(max(c for _, c in step), sum(c for _, c in step) / cores)
                                for step in zip(*per_rank))
        rows.append((name, predicted, measured, cpu))
        parts = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in predicted.time.items() if seconds > 0)
        print(f"{name}: predicted {predicted.step_time_s:.3f} s ({parts}), measured {measured:.3f} s "
              f"({predicted.step_time_s / measured - 1:+.1%}), CPU {cpu:.3f} s "
              f"({predicted.step_time_s / cpu - 1:+.1%})", flush=True)
    # The planner's ranking (search.plan) is by the same estimate's tokens/s/GPU, which for a fixed job orders
    # layouts of one GPU count as their step time does; these mix one and two ranks, so rank by step time.
    top = min(rows, key=lambda row: row[1].step_time_s)
    for column, label in ((2, "wall"), (3, "CPU")):
        errors = [abs(row[1].step_time_s / row[column] - 1) for row in rows]
        fastest = min(rows, key=lambda row: row[column])
        print(f"{label}: error median {statistics.median(errors):.1%}, worst {max(errors):.1%} (bound 25%); "
              f"top-ranked (predicted fastest) {top[0]}: {top[column]:.3f} s, fastest measured {fastest[0]}: "
              f"{fastest[column]:.3f} s, ratio {top[column] / fastest[column]:.3f} (bound 1.10)")
    print(f"load average after: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="predicted vs measured step time on this machine")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per layout (--measure)")
    parser.add_argument("--profile", default=None, help="a calibrated profile to use instead of calibrating")
    options = parser.parse_args()
    if options.measure:
        print(f"load average before: {os.getloadavg()}")
        measure(options.steps, options.profile)
    else:
        speed()


if __name__ == "__main__":
    main()
