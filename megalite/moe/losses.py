"""Router losses and the autograd function that feeds them into the backward pass.

Both losses are written as sums over this rank's tokens divided by the token
count of the whole micro-batch, so when a micro-batch is split over ranks
(sequence parallelism) the per-rank values add up to the micro-batch's loss.
"""

from __future__ import annotations

import torch


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """Switch/GShard aux loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``scores`` [T, E] are this rank's full softmax router probabilities;
    ``counts`` [E] the routed (token, slot) assignments per expert over the
    micro-batch, so f_e = counts_e / (num_tokens * topk); P_e is the mean score
    of expert e over the micro-batch's ``num_tokens`` tokens.
    """
    num_experts = scores.shape[1]
    per_expert = scores.sum(0) * counts.to(scores.dtype)
    return per_expert.sum() * (num_experts / (num_tokens * num_tokens * topk))


def z_loss(logits: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean over the micro-batch of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().sum() / num_tokens


class _AddLossGrad(torch.autograd.Function):
    """Identity on ``x``; in backward, also sends ``scale`` as the gradient of ``loss``."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``x`` such that backward through it adds ``scale * d(loss)`` to the graph.

    This lets a layer contribute a regularizer without the training loop adding
    it to the loss (Megatron's aux-loss auto-scaler).
    """
    if not loss.requires_grad or scale == 0:
        return x
    return _AddLossGrad.apply(x, loss, scale)
