"""PPO math: KL penalty estimators, clipped policy and value losses, loss aggregation, whitening.

Every function takes per-token tensors ``[b, t]`` with a 0/1 ``mask`` of the
response tokens that count.  Losses are *sums* divided by a caller-given
``normalizer`` (the global token or sequence count of the whole batch, over
every micro-batch and DP rank), so splitting a batch differently gives the same
total loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import topology

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
ROLLOUT_IS_MODES = ("truncate", "mask")
ROLLOUT_IS_LEVELS = ("token", "sequence")


@dataclass
class PPOConfig:
    """Hyper-parameters of the PPO objective.

    ``clip_eps``/``clip_eps_high``: the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``
    (``clip_eps_high`` defaults to ``clip_eps``; DAPO's clip-higher sets it larger).  ``dual_clip``:
    bound (> 1) on the loss of negative-advantage tokens, ``None`` disables it.  ``kl_coef`` weighs
    the KL to the reference model, estimated by ``kl_estimator`` and clamped to
    ``[-kl_clamp, kl_clamp]``: subtracted from the per-token reward, or with ``use_kl_loss`` added
    to the actor loss instead (GRPO style).  ``rollout_is_cap`` (C): bound on the importance weight
    ``w = pi_old / pi_behaviour`` between the trainer's old log-probs (the policy at the start of the update,
    recomputed by the actor) and the log-probs the rollout engine sampled with (a stale policy, or the same policy
    under other numerics); ``None`` means no correction.  ``rollout_is_mode``: "truncate" (TIS, ``min(w, C)``) or
    "mask" (MIS, ``w`` inside ``[1/C, C]`` and 0 outside).  ``rollout_is_level``: "token" (a weight per token) or
    "sequence" (the product of a response's token ratios, one weight for all its tokens).  See
    :func:`rollout_is_weights`.

    Defaults are what OpenRLHF and verl users expect and what makes examples/rlhf_ppo.py's reward
    rise: ``kl_coef`` 0.01 (OpenRLHF's; TRL uses 0.05, verl 0.001), ``rollout_is_cap`` 2.0 (verl's
    truncated importance sampling cap), dual clip 3.0 (verl's ``clip_ratio_c``).
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = 3.0
    value_clip: float = 0.2
    kl_coef: float = 0.01
    kl_estimator: str = "k3"
    kl_clamp: float = 10.0
    entropy_coef: float = 0.0
    loss_aggregation: str = "token-mean"
    use_kl_loss: bool = False
    rollout_is_cap: float | None = 2.0
    rollout_is_mode: str = "truncate"
    rollout_is_level: str = "token"

    def __post_init__(self):
        if self.clip_eps_high is None:
            self.clip_eps_high = self.clip_eps
        if not 0.0 < self.clip_eps < 1.0 or self.clip_eps_high <= 0.0:
            raise ValueError(f"clip_eps must be in (0, 1) and clip_eps_high positive, got {self.clip_eps} and "
                             f"{self.clip_eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATIONS}, got {self.loss_aggregation!r}")
        if self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be positive, got {self.kl_clamp}")
        if self.rollout_is_cap is not None and self.rollout_is_cap < 1.0:
            raise ValueError(f"rollout_is_cap must be >= 1 (or None), got {self.rollout_is_cap}")
        if self.rollout_is_mode not in ROLLOUT_IS_MODES or self.rollout_is_level not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is_mode must be one of {ROLLOUT_IS_MODES} and rollout_is_level one of "
                             f"{ROLLOUT_IS_LEVELS}, got {self.rollout_is_mode!r} and {self.rollout_is_level!r}")


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3",
               clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r with
    ``log r = log_probs - ref_log_probs`` clamped to ``[-clamp, clamp]`` (so k3's
    exponential stays finite), and the estimate clamped to the same range.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = (log_probs - ref_log_probs).clamp(-clamp, clamp)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    return kl.clamp(-clamp, clamp)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float) -> torch.Tensor:
    """Reduce a per-token loss ``[b, t]`` to a scalar share of the global mean.

    ``token-mean``: the masked sum divided by ``normalizer`` = the global number
    of response tokens.  ``seq-mean-token-sum``: each sequence's sum over its
    tokens, summed, divided by ``normalizer`` = the global number of sequences.
    ``seq-mean-token-mean``: the same with each sequence's mean over its tokens.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if normalizer <= 0:
        raise ValueError(f"loss normalizer must be positive, got {normalizer}")
    mask = mask.to(per_token.dtype)
    if mode != "seq-mean-token-mean":
        return (per_token * mask).sum() / normalizer
    lengths = mask.sum(dim=-1).clamp(min=1.0)
    return ((per_token * mask).sum(dim=-1) / lengths).sum() / normalizer


def global_normalizer(mask: torch.Tensor, mode: str, dp_group=None) -> float:
    """The ``normalizer`` of :func:`aggregate` for a whole batch split over DP ranks.

    ``mask`` is this rank's whole share of the batch (every micro-batch).
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    local = mask.sum() if mode == "token-mean" else torch.tensor(float(mask.shape[0]))
    total = local.detach().to(torch.float64).reshape(1).clone()
    group = topology.resolve_group(dp_group, "dp")
    if topology.group_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.item())


def rollout_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       cap: float, mode: str = "truncate", level: str = "token") -> torch.Tensor:
    """Importance weights ``[b, t]`` (no gradient) correcting a loss on tokens sampled by the rollout policy
    (``rollout_log_probs``) towards the old policy (``old_log_probs``), over the 0/1 ``mask`` of response tokens.

    ``w = exp(old - rollout)`` per token, or at ``level="sequence"`` ``exp(sum_t mask * (old - rollout))`` for
    every token of a row.  ``mode="truncate"`` (TIS): ``min(w, cap)``; ``mode="mask"`` (MIS): ``w`` where
    ``1/cap <= w <= cap``, else 0.  The log-ratio is clamped to ``[-log(1e30), log(1e30)]`` first, so every weight is
    finite.  Outside ``mask`` the weight is 1 (those tokens carry no loss).
    """
    if mode not in ROLLOUT_IS_MODES or level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"mode must be one of {ROLLOUT_IS_MODES} and level one of {ROLLOUT_IS_LEVELS}, got "
                         f"{mode!r} and {level!r}")
    mask = mask.to(old_log_probs.dtype)
    log_ratio = (old_log_probs - rollout_log_probs).detach() * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio.clamp(-69.0, 69.0))
    if mode == "truncate":
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where((ratio >= 1.0 / cap) & (ratio <= cap), ratio, torch.zeros_like(ratio))
    return torch.where(mask > 0, weights, torch.ones_like(weights))


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, config: PPOConfig, normalizer: float,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate loss with dual clip; returns ``(loss, metrics)``.

    Per token: ``max(-A r, -A clip(r, 1 - eps, 1 + eps_high))``, and for ``A < 0``
    additionally at most ``-A * dual_clip``; times ``is_weights`` when given
    (see :func:`rollout_is_weights`).
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_eps, 1.0 + config.clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    if config.dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * config.dual_clip), loss)
    if is_weights is not None:
        loss = loss * is_weights
    m = mask.to(loss.dtype)
    count = m.sum().clamp(min=1.0)
    with torch.no_grad():
        metrics = {"clip_fraction": float(((clipped > unclipped).to(m.dtype) * m).sum() / count),
                   "approx_kl": float((-log_ratio * m).sum() / count)}
    return aggregate(loss, mask, config.loss_aggregation, normalizer), metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               config: PPOConfig, normalizer: float) -> torch.Tensor:
    """Clipped value loss ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, +-c) - R)^2)``."""
    clipped = old_values + (values - old_values).clamp(-config.value_clip, config.value_clip)
    loss = 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())
    return aggregate(loss, mask, config.loss_aggregation, normalizer)


@torch.no_grad()
def whiten(values: torch.Tensor, mask: torch.Tensor, dp_group=None, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Normalize the masked entries to zero mean and unit (unbiased) variance across DP ranks.

    With ``shift_mean=False`` the mean is added back (only the scale changes).
    Entries outside the mask come back as 0.
    """
    m = mask.to(values.dtype)
    stats = torch.stack([(values * m).sum(), m.sum()]).to(torch.float64)
    group = topology.resolve_group(dp_group, "dp")
    if topology.group_size(group) > 1:
        dist.all_reduce(stats, group=group)
    total, count = stats[0], stats[1]
    if count < 2:
        raise ValueError(f"whitening needs at least 2 masked entries over all DP ranks, got {int(count)}")
    mean = total / count
    centered = (values.to(torch.float64) - mean) * m
    var = centered.square().sum().reshape(1)
    if topology.group_size(group) > 1:
        dist.all_reduce(var, group=group)
    var = var[0] / (count - 1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * m).to(values.dtype)
