"""Rewards: a callable named on the command line, DAPO's overlong shaping and group filter, token rewards.

A reward function is ``fn(prompt: str, response: str) -> float`` (the response
text is cut at end-of-document) named as ``module:function``.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from megalite.data.synthetic import arithmetic_answer
from megalite.rlhf.ppo import kl_penalty


def load_reward_fn(spec: str) -> Callable[[str, str], float]:
    """Import ``module:function``; one ValueError naming the spec when it cannot be found or called."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function must be given as module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import reward module {module_name!r} of {spec!r}: {error}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def arithmetic_reward(prompt: str, response: str) -> float:
    """1 for the right answer to an "a+b=" prompt, else 0 (the RL trainer's default --reward-fn)."""
    return float(response == arithmetic_answer(prompt))


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per sequence: 0 up to ``max_length - buffer`` tokens, then
    falling linearly to ``-factor`` at ``max_length``, and ``-factor`` beyond."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    over = (lengths.to(torch.float32) - (max_length - buffer)).clamp(min=0.0) / buffer
    return -factor * over.clamp(max=1.0)


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: per group of ``group_size`` consecutive rows, True unless all scores are equal."""
    if scores.dim() != 1 or scores.shape[0] % group_size:
        raise ValueError(f"{tuple(scores.shape)} scores do not split into groups of {group_size} samples per prompt")
    groups = scores.reshape(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, log_probs: torch.Tensor | None = None,
                  ref_log_probs: torch.Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                  kl_clamp: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``[b, t]``: each sequence's score on its last masked token, minus
    ``kl_coef`` x the KL estimate on every masked token (KL in the reward); also the masked KL."""
    m = mask.to(torch.float32)
    last = (m.cumsum(dim=1) == m.sum(dim=1, keepdim=True)) & (m > 0)
    rewards = last.to(torch.float32) * scores.to(torch.float32)[:, None]
    kl = torch.zeros_like(rewards)
    if ref_log_probs is not None:
        kl = kl_penalty(log_probs, ref_log_probs, kl_estimator, kl_clamp) * m
        rewards = rewards - kl_coef * kl
    return rewards, kl
