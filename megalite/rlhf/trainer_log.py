"""What the RL trainer prints: one short line per iteration, a separate line per evaluation, and sample completions.

Every metric still goes to the metrics file (JSON lines) and TensorBoard through ``MetricsLogger``; the console
shows only what a user watches: reward mean and std, KL to the reference, entropy, response length, policy and value
loss, and throughput.  ``--eval-interval`` runs greedy decoding on a fixed prompt set (``--prompt-data``'s held-out
records) with the same reward function (:func:`evaluate`; logged as ``valid_*``, TensorBoard ``valid/*``), before RL
and every that many iterations, and with ``--eval-samples N`` pass@1 and pass@N of N sampled responses per prompt
(:func:`pass_at_k`); ``--sample-interval`` prints a few prompts with their sampled responses and rewards.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from megalite.rlhf.rollout_batch import Rollout
from megalite.rlhf.rollouts import decode, draw_prompts, sample_shard
from megalite.rlhf.scoring import score_batches
from megalite.rlhf.update import dp_mean

SHOWN = (("reward", "reward {:.3f}"), ("reward_std", "±{:.3f}"), ("attempt_reward", "attempt {:.3f}"),
         ("guide_reward", "guide {:+.3f}"), ("kl", "kl {:.4f}"), ("entropy", "entropy {:.3f}"),
         ("response_length", "len {:.1f}"), ("policy_loss", "pg {:.4f}"), ("value_loss", "vf {:.4f}"),
         ("samples_per_s", "{:.1f} samples/s"))
"""The console line's metrics and formats, in order (a metric the run does not have is left out)."""


def iteration_line(iteration: int, train_iters: int, metrics: dict) -> str:
    parts = [f"rl {iteration}/{train_iters}"]
    for key, fmt in SHOWN:
        if key in metrics:
            text = fmt.format(metrics[key])
            if key == "reward_std":
                parts[-1] += f" {text}"
            else:
                parts.append(text)
    return " | ".join(parts)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` pass (Chen et al., 2021): the chance that
    ``k`` of the ``n`` drawn without replacement include a passing one, ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(sample, args, sampling, reward, topo, device, iteration: int) -> dict:
    """Greedy responses to this DP rank's fixed evaluation prompts (its share of ``--prompt-data``'s held-out
    records, else drawn from their own seed, the same every evaluation), scored by ``reward``: ``valid_reward``
    and ``valid_response_length``, means over every DP rank's prompts.  With ``--eval-samples N`` also N sampled
    responses per prompt (a sample passes with reward >= 1): ``valid_pass@1`` and ``valid_pass@N``, the mean
    over prompts of :func:`pass_at_k`."""
    rng = random.Random(args.seed * 1000 + 500009 + topo.dp.rank)
    prompts, n = None, None
    if args.prompt_set is not None:
        prompts, n = args.prompt_set.eval_prompts(topo.dp.rank, topo.dp.size), 1
    elif args.eval_samples:
        prompts, n = draw_prompts(args, rng), 1
    rollout = decode(sample_shard(sample, args, replace(sampling, greedy=True), rng, 0, 0, topo.dp.rank, device,
                                  prompts, n))
    scores = score_batches(reward, [(rollout.prompts, rollout.responses)])[0]
    count = dp_mean(float(len(scores)), topo, device)
    metrics = {"valid_reward": dp_mean(float(scores.sum()), topo, device) / count,
               "valid_response_length": dp_mean(float(rollout.response_mask.sum()), topo, device) / count}
    if args.eval_samples:
        samples = args.eval_samples
        rollout = decode(sample_shard(sample, args, sampling, rng, 0, 1, topo.dp.rank, device,
                                      rollout.prompts, samples))
        passed = (score_batches(reward, [(rollout.prompts, rollout.responses)])[0] >= 1.0).view(-1, samples)
        for k in sorted({1, samples}):
            total = sum(pass_at_k(samples, int(c), k) for c in passed.sum(dim=1).tolist())
            metrics[f"valid_pass@{k}"] = dp_mean(total, topo, device) / count
    return metrics


def eval_line(iteration: int, metrics: dict) -> str:
    passes = "".join(f" | {key[len('valid_'):]} {value:.3f}" for key, value in metrics.items()
                     if key.startswith("valid_pass@"))
    return (f"eval {iteration} | reward {metrics['valid_reward']:.3f} | "
            f"len {metrics['valid_response_length']:.1f} (greedy){passes}")


def sample_lines(rollout: Rollout, count: int = 3) -> list[str]:
    """The first ``count`` rows of ``rollout`` as ``prompt -> response (reward r)``."""
    rewards = rollout.rewards.tolist() if rollout.rewards is not None else [float("nan")] * len(rollout)
    return [f"  sample {rollout.iteration}: {p!r} -> {r!r} (reward {s:.3f})"
            for p, r, s in list(zip(rollout.prompts, rollout.responses, rewards))[:count]]
