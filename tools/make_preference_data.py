"""Write the synthetic arithmetic preference set (JSON lines of prompt/chosen/rejected).

    python tools/make_preference_data.py --output data/arithmetic_preferences.jsonl --pairs 4000

Each prompt is "a+b="; the right answer is chosen over an answer off by 1 to 3.
examples/train_reward_model.py builds the same set itself when given no --data-path.
"""

from __future__ import annotations

import os
import sys

from megalite.cli import run_cli
from megalite.flags import ArgumentParser
from megalite.rlhf.reward_model import write_arithmetic_preferences


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the JSON lines file to write")
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=9)
    args = p.parse_args(argv)
    if args.pairs < 1:
        raise ValueError(f"--pairs must be positive, got {args.pairs}")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_arithmetic_preferences(args.output, args.pairs, args.seed, args.max_operand)
    print(f"wrote {args.pairs} pairs to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
