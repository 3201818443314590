"""Rollout engine reuse: one persistent ``RolloutEngine`` (built once, weights updated in place) vs a fresh engine per
call (``engine_generate``, what every RL iteration did before), in one run on the same model, prompts and seeds.

Each timed call follows an in-place weight change (as after an optimizer step), samples ``--prompts`` arithmetic
prompts x ``--n-samples-per-prompt`` and the two sides alternate; the script checks that both give the same tokens
and prints the median seconds per call and the ratio.

    python benchmarks/rl_engine.py [--hidden-size 64] [--num-layers 2] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.rlhf.arithmetic import TOKENIZER, problem, prompt_width  # noqa: E402
from megalite.rlhf.generation import RolloutEngine, SamplingConfig, engine_generate  # noqa: E402
from megalite.rlhf.rollouts import left_pad  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers,
                               hidden_size=args.hidden_size, num_attention_heads=4, max_position_embeddings=16,
                               make_vocab_size_divisible_by=8)).eval()
    rng = random.Random(0)
    prompts = [TOKENIZER.tokenize(problem(rng, 9)) for _ in range(args.prompts)
               for _ in range(args.n_samples_per_prompt)]
    ids, mask = left_pad(prompts, TOKENIZER.pad, prompt_width(9))
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad)
    persistent = RolloutEngine(model)
    sides = {"per-call engine": lambda g: engine_generate(model, ids, mask, sampling, g),
             "persistent engine": lambda g: persistent.generate(ids, mask, sampling, g)}
    times = {name: [] for name in sides}
    for call in range(args.calls + 1):
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1.0 + 1e-3)
        outputs = {}
        for name in (list(sides) if call % 2 else list(reversed(sides))):
            start = time.perf_counter()
            outputs[name] = sides[name](torch.Generator().manual_seed(call))
            if call:  # the first call of each side warms up
                times[name].append(time.perf_counter() - start)
        a, b = outputs.values()
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_probs, b.log_probs)
    old, new = (statistics.median(times[name]) for name in sides)
    print(f"hidden {args.hidden_size}, {args.num_layers} layers, {len(prompts)} rows x {args.max_new_tokens} new "
          f"tokens, {args.calls} calls each, engines built by the persistent side: {persistent.builds}")
    print(f"per-call engine {old * 1e3:.1f} ms/call | persistent engine {new * 1e3:.1f} ms/call | "
          f"speed-up {old / new:.2f}x")


if __name__ == "__main__":
    main()
