"""Advantage estimators: GAE (with a critic) and the critic-free GRPO, RLOO and REINFORCE++.

Inputs are per-token rewards ``[b, t]`` (the sequence score on its last
response token, minus the KL penalty per token when the KL sits in the reward)
and the response ``mask [b, t]``.  The outcome estimators (grpo, rloo) use each
sequence's summed reward; the ``group_size`` samples of one prompt are
consecutive rows, and a group never spans DP ranks, so group statistics are
local.  GAE and REINFORCE++ whiten over the whole batch across DP.  Advantages
are 0 outside the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.rlhf.ppo import whiten

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")
GROUP_ESTIMATORS = ("grpo", "rloo")


@dataclass
class AdvantageConfig:
    """Which estimator, and its parameters.

    ``group_size``: samples per prompt (grpo and rloo need >= 2).  ``gamma``/``lam``:
    discount and GAE lambda (REINFORCE++ uses ``gamma``).  ``norm_by_std``: GRPO
    divides by the group's standard deviation (Dr. GRPO turns this off).  ``gamma = lam = 1``
    as in verl and OpenRLHF: the reward of an LLM response comes at its last token, and
    examples/rlhf_ppo.py's reward rises with it.
    """

    estimator: str = "gae"
    group_size: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.estimator!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size (samples per prompt) must be a positive integer, got {self.group_size!r}")
        if self.estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"advantage estimator {self.estimator!r} needs at least 2 samples per prompt, "
                             f"got {self.group_size}")

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and returns ``[b, t]`` over the masked tokens.

    Masked-out positions are skipped: the recursion links each response token
    to the next *unmasked* one, and the value after the last one is 0.
    Advantages and returns are 0 outside the mask.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = m[:, t] * gae + (1.0 - m[:, t]) * last_gae
        next_value = m[:, t] * values[:, t] + (1.0 - m[:, t]) * next_value
        advantages[:, t] = m[:, t] * gae
    return advantages, (advantages + values) * m


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over the masked tokens (masked positions are skipped, 0 there)."""
    m = mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = m[:, t] * (rewards[:, t] + gamma * running) + (1.0 - m[:, t]) * running
        returns[:, t] = m[:, t] * running
    return returns


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1 or scores.shape[0] % group_size:
        raise ValueError(f"{tuple(scores.shape)} scores do not split into groups of {group_size} samples per prompt")
    return scores.reshape(-1, group_size)


@torch.no_grad()
def grpo_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """``(s_i - mean_group) / (std_group + eps)`` (unbiased std; no division without ``norm_by_std``) per token."""
    groups = _groups(scores, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1, 1) * mask.to(scores.dtype)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """``s_i - mean of the other samples of the group`` per token (leave-one-out baseline)."""
    groups = _groups(scores, group_size)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).reshape(-1, 1) * mask.to(scores.dtype)


@torch.no_grad()
def compute_advantages(config: AdvantageConfig, rewards: torch.Tensor, mask: torch.Tensor,
                       values: torch.Tensor | None = None, dp_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(advantages, returns)`` ``[b, t]`` for per-token ``rewards``; returns are None without a critic.

    gae: GAE over ``values``, whitened across DP.  reinforce_plus_plus: discounted
    returns whitened across DP.  grpo/rloo: the group estimate of each row's summed reward.
    """
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if config.estimator == "gae":
        if values is None:
            raise ValueError("the gae estimator needs critic values")
        advantages, returns = compute_gae(rewards, values, mask, config.gamma, config.lam)
        return whiten(advantages, mask, dp_group), returns
    if config.estimator == "reinforce_plus_plus":
        return whiten(discounted_returns(rewards, mask, config.gamma), mask, dp_group), None
    scores = (rewards * mask.to(rewards.dtype)).sum(dim=1)
    if config.estimator == "grpo":
        return grpo_advantages(scores, mask, config.group_size, config.norm_by_std, config.eps), None
    return rloo_advantages(scores, mask, config.group_size), None
