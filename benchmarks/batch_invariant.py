"""The cost of batch-invariant mode (``GPTConfig.batch_invariant``): the same model and weights with and without it,
in one run, on the three RL phases it touches.

- rollout: one persistent ``RolloutEngine`` samples ``--prompts`` left-padded prompts (``--new-tokens`` each);
- score: the actor's forward-only log-probs of those rollouts (``pipeline_log_probs``, micro-batches of 8);
- train: one forward + backward of the actor's log-probs over the batch.

The sides alternate per repeat; the script checks the invariant side's engine log-probs equal its actor's exactly
(and reports the plain side's gap), then prints the median seconds of each phase and the invariant/plain ratio.

    python benchmarks/batch_invariant.py [--hidden-size 64] [--num-layers 2] [--prompts 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.models import GPTConfig, GPTModel  # noqa: E402
from megalite.rlhf.actor import invariant_vocab, pipeline_log_probs, token_log_probs  # noqa: E402
from megalite.rlhf.generation import RolloutEngine, SamplingConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-width", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {}
    for flag in (False, True):
        models[flag] = GPTModel(GPTConfig(
            vocab_size=args.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=4, max_position_embeddings=args.prompt_width + args.new_tokens,
            position_embedding_type="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
            make_vocab_size_divisible_by=8, batch_invariant=flag))
    models[True].load_state_dict(models[False].state_dict())
    g = torch.Generator().manual_seed(1)
    width = args.prompt_width
    lengths = torch.randint(1, width + 1, (args.prompts,), generator=g)
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    ids = torch.randint(1, args.vocab_size, (args.prompts, width), generator=g) * mask
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    engines = {flag: RolloutEngine(model) for flag, model in models.items()}
    times = {flag: {"rollout": [], "score": [], "train": []} for flag in models}
    gaps = {}
    for repeat in range(args.repeats + 1):
        for flag in ((False, True) if repeat % 2 else (True, False)):
            model, phase = models[flag], {}
            start = time.perf_counter()
            out = engines[flag].generate(ids, mask, sampling, torch.Generator().manual_seed(repeat))
            phase["rollout"] = time.perf_counter() - start
            micro = [{"input_ids": out.tokens[i:i + 8], "attention_mask": out.attention_mask[i:i + 8]}
                     for i in range(0, args.prompts, 8)]
            start = time.perf_counter()
            scored, _ = pipeline_log_probs(model, micro)
            phase["score"] = time.perf_counter() - start
            start = time.perf_counter()
            logits = model(out.tokens, attention_mask=out.attention_mask)
            trained, _ = token_log_probs(logits[:, :-1], out.tokens[:, 1:], invariant_vocab=invariant_vocab(model))
            trained[:, width - 1:].mul(out.response_mask).sum().backward()
            model.zero_grad(set_to_none=True)
            phase["train"] = time.perf_counter() - start
            keep = out.response_mask.bool()
            gaps[flag] = float((scored[:, width - 1:][keep] - out.log_probs[keep]).abs().max())
            if repeat:  # the first round warms up
                for name, seconds in phase.items():
                    times[flag][name].append(seconds)
    if gaps[True] != 0.0:
        raise SystemExit(f"batch-invariant engine and actor log-probs differ by {gaps[True]}")
    print(f"hidden {args.hidden_size}, {args.num_layers} layers, {args.prompts} prompts x {args.new_tokens} new "
          f"tokens, {args.repeats} repeats; engine-actor log-prob gap: plain {gaps[False]:.3g}, invariant 0")
    print(f"{'phase':<8} {'plain':>10} {'invariant':>10} {'ratio':>7}")
    for name in ("rollout", "score", "train"):
        plain, invariant = (statistics.median(times[flag][name]) for flag in (False, True))
        print(f"{name:<8} {plain * 1e3:>8.1f}ms {invariant * 1e3:>8.1f}ms {invariant / plain:>6.2f}x")


if __name__ == "__main__":
    main()
