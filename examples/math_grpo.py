"""SFT then GRPO on the shipped math task, with the held-out verifier accuracy after each.

    python examples/math_grpo.py                      # level 1: SFT, then GRPO; prints both accuracies
    python examples/math_grpo.py --level 2 --max-new-tokens 80 --pretrain-iters 600
    torchrun --nproc_per_node 2 examples/math_grpo.py --tensor-model-parallel-size 2

It writes the synthetic word problems (``megalite.rlhf.math_task``, ``--count`` of ``--task-seed``) and runs the RL
trainer on them with ``--prompt-data``: the actor's warm-up is SFT on the worked completions (``--pretrain-iters``
steps), then GRPO scores each sampled response against its record's answer with math-verify
(``megalite.rlhf.verifiers.answer_reward``).  The last ``--held-out-prompts`` problems are never trained on; they are
answered greedily after SFT (iteration 0) and every ``--eval-interval`` iterations, and the accuracies after SFT and
after GRPO are printed at the end.  Any other RL trainer flag (``--help`` lists them) overrides the recipe's.

The recipe's defaults are ``--level 1`` (one one-digit step), 300 SFT steps, then 16 GRPO iterations of 16 prompts x 8
samples with ``--dynamic-sampling`` (groups all right or all wrong carry no GRPO signal; it draws more until the
batch holds mixed ones).  Measured (2-core CPU shared with other jobs, 64 held-out problems, task seed 0, one run
each, 5-13 minutes):

- level 1, defaults, ``--held-out-prompts 256`` (the machine otherwise idle, 5 minutes): SFT 0.500 -> GRPO 0.777.
- level 1, defaults: SFT 0.359 -> GRPO 0.391; with ``--seed 1``: 0.312 -> 0.359; with ``--pretrain-iters 150``:
  0.219 -> 0.250 (also with ``--actor-lr 1e-3``).
- level 1 without ``--dynamic-sampling`` (8 prompts x 8 samples, 16-20 iterations): no rise; 0.359 -> 0.312 or
  0.219 (``--actor-lr 1e-4`` / ``2e-4``), 0.359 -> 0.250 with ``--temperature 1.3``, 0.219 -> 0.219 / 0.234
  (``--pretrain-iters 150``, ``--actor-lr 5e-4`` / ``1e-3``): most groups are all right or all wrong.
- two-digit one-step problems: SFT 0.078; level 3 (``--pretrain-iters 600``, 7 minutes): SFT 0.042, too sparse a
  reward for GRPO to move.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from megalite.cli import run_cli
from megalite.rlhf.math_task import LEVELS, write_math_task
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args

RECIPE = ["--tensor-model-parallel-size", "1", "--hidden-size", "64", "--num-layers", "2",
          "--num-attention-heads", "4", "--pretrain-iters", "300", "--pretrain-global-batch-size", "32",
          "--micro-batch-size", "16", "--global-batch-size", "16", "--n-samples-per-prompt", "8",
          "--dynamic-sampling",
          "--advantage-estimator", "grpo", "--max-new-tokens", "48", "--held-out-prompts", "64",
          "--train-iters", "16", "--eval-interval", "8", "--tensorboard-dir", ""]
"""A tiny byte-level GPT and a batch that run SFT and GRPO on two CPU cores in a few minutes (the defaults; a
level-1 completion takes at most 46 tokens: give ``--max-new-tokens 80`` for level 2, ``110`` for level 3)."""


def accuracies(metrics_file: str) -> list[tuple[int, float]]:
    """``(iteration, held-out accuracy)`` of each evaluation in the metrics file, in order."""
    with open(metrics_file, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [(r["iteration"], r["valid_reward"]) for r in records if "valid_reward" in r]


def main(argv=None) -> int:
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--count", type=int, default=2000, help="problems written (the held-out ones included)")
    task.add_argument("--task-seed", type=int, default=0, help="the problem set's seed")
    task.add_argument("--level", type=int, default=1, help=f"the problems' difficulty, one of {sorted(LEVELS)}")
    task.add_argument("--workdir", help="where the task file and metrics go (default: a temporary directory)")
    ours, rest = task.parse_known_args(argv)
    if ours.count <= 0:
        raise ValueError(f"--count must be positive, got {ours.count}")
    if ours.level not in LEVELS:
        raise ValueError(f"--level must be one of {sorted(LEVELS)}, got {ours.level}")
    workdir = ours.workdir or tempfile.mkdtemp(prefix="math_grpo_")
    os.makedirs(workdir, exist_ok=True)
    data, metrics = os.path.join(workdir, "math.jsonl"), os.path.join(workdir, "metrics.jsonl")
    args = parse_args(RECIPE + ["--prompt-data", data, "--metrics-file", metrics] + rest,
                      description=__doc__.splitlines()[0])
    if not args.eval_interval:
        raise ValueError("the recipe reports held-out accuracy: give --eval-interval a positive value")
    rank = int(os.environ.get("RANK", "0"))
    # every rank writes the same (deterministic) file whole, so no rank reads a half-written one and none need wait
    write_math_task(f"{data}.{rank}", ours.count, ours.task_seed, ours.level)
    os.replace(f"{data}.{rank}", data)
    status = RLTrainer(args).train()
    if rank == 0:
        print(summary(args.held_out_prompts, accuracies(metrics)), flush=True)
    return status


def summary(held_out: int, evaluations: list[tuple[int, float]]) -> str:
    """The closing line: the accuracy of the first evaluation (after SFT) and of the last (after GRPO)."""
    (_, after_sft), (last, after_grpo) = evaluations[0], evaluations[-1]
    return (f"held-out verifier accuracy ({held_out} problems, greedy): after SFT {after_sft:.3f}, "
            f"after GRPO (iteration {last}) {after_grpo:.3f}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
