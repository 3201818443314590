"""Placement and offload benchmark: per-phase memory and iteration time of the RL trainer (megalite.rlhf.trainer)
without and with offload, in one run.

PPO with a critic, a target critic (``--target-critic-tau``), a reward model (an untrained critic checkpoint of
the actor's size, written here) and the reference, at ``--hidden-size`` / ``--num-layers``, on ``--world`` ranks
at TP = world (gloo on CPU, NCCL on GPUs).  Four runs: no offload (the peer: everything stays on the device),
``--offload-frozen-models``, ``--offload-optimizer`` and both.  Printed per run, on rank 0: each phase's
device bytes (the models' tensors on the compute device; largest over the iterations after the first, when
the optimizer state exists) and what it saves against no offload, the pool bytes, the CUDA peak per phase on
GPU, the host seconds per iteration spent moving state (``time_offload_s``: the copies, measured where they
happen) and the seconds per iteration (median and minimum after the first, the minimum being the least
disturbed by other load) with the ratio of the medians to no offload.  The runs' losses, rewards and weights
are identical (tests/rlhf/test_placement.py).

    python benchmarks/rl_offload.py [--world 1] [--hidden-size 256] [--num-layers 4] [--iters 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.checkpoint import save_sharded  # noqa: E402
from megalite.data.tokenizer import ByteTokenizer  # noqa: E402
from megalite.models import GPTConfig  # noqa: E402
from megalite.rlhf import CriticModel  # noqa: E402
from megalite.rlhf.trainer import RLTrainer  # noqa: E402
from megalite.rlhf.trainer_config import parse_args  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

RUNS = {"none": [], "frozen models": ["--offload-frozen-models"], "optimizer": ["--offload-optimizer"],
        "both": ["--offload-frozen-models", "--offload-optimizer"]}
PHASES = ("generation", "scoring", "training")
MIB = 2 ** 20


def _example(argv) -> int:
    return RLTrainer(parse_args(argv)).train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        reward_model = os.path.join(directory, "reward_model")
        save_sharded(reward_model, 0, [CriticModel(GPTConfig(
            vocab_size=ByteTokenizer().vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=4, max_position_embeddings=16, make_vocab_size_divisible_by=8))])
        base = ["--tensor-model-parallel-size", str(args.world), "--hidden-size", str(args.hidden_size),
                "--num-layers", str(args.num_layers), "--pretrain-iters", "1", "--train-iters", str(args.iters),
                "--global-batch-size", "64", "--micro-batch-size", "16", "--pretrain-global-batch-size", "16",
                "--ppo-epochs", "1", "--target-critic-tau", "0.1", "--reward-model", reward_model,
                "--tensorboard-dir", ""]
        records = {}
        for name, extra in RUNS.items():
            path = os.path.join(directory, f"{len(records)}.jsonl")
            run_distributed(_example, args.world, base + extra + ["--metrics-file", path], timeout=1800)
            records[name] = [json.loads(line) for line in open(path)][1:]
    gpu = "mem_generation_peak_bytes" in records["none"][0]

    def largest(name, key):
        return max(r[key] for r in records[name])

    print(f"\nworld {args.world}, hidden {args.hidden_size}, {args.num_layers} layers; MiB on rank 0, iterations "
          f"2-{args.iters}")
    head = ["offload"] + [f"{p} device (saved)" for p in PHASES] + ["pool"]
    head += [f"{p} peak" for p in PHASES] if gpu else []
    head += ["offload s/iteration", "s/iteration (min)", "ratio"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    seconds = {name: statistics.median(r["time_iteration_s"] for r in rs) for name, rs in records.items()}
    fastest = {name: min(r["time_iteration_s"] for r in rs) for name, rs in records.items()}
    moving = {name: statistics.median(r["time_offload_s"] for r in rs) for name, rs in records.items()}
    for name in RUNS:
        row = [name]
        for phase in PHASES:
            key = f"mem_{phase}_device_bytes"
            row.append(f"{largest(name, key) / MIB:.2f} ({(largest('none', key) - largest(name, key)) / MIB:.2f})")
        row.append(f"{max(largest(name, f'mem_{p}_pool_bytes') for p in PHASES) / MIB:.2f}")
        if gpu:
            row += [f"{largest(name, f'mem_{p}_peak_bytes') / MIB:.2f}" for p in PHASES]
        row += [f"{moving[name]:.4f}", f"{seconds[name]:.3f} ({fastest[name]:.3f})",
                f"{seconds[name] / seconds['none']:.2f}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
