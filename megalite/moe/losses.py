"""Router losses and the autograd function that feeds them into the backward pass.

Both losses are written as sums over this rank's tokens divided by the token
count of the whole micro-batch, so when a micro-batch is split over ranks
(sequence parallelism) the per-rank values add up to the micro-batch's loss.
"""

from __future__ import annotations

import torch


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, num_tokens: int, topk: int) -> torch.Tensor:
    """Switch/GShard aux loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``scores`` [T, E] are this rank's full router probabilities (softmax, or the
    sigmoids normalised over all experts); ``counts`` [E] the routed (token,
    slot) assignments per expert over the micro-batch, so f_e = counts_e /
    (num_tokens * topk); P_e is the mean score of expert e over the
    micro-batch's ``num_tokens`` tokens.  Given ``scores`` [T, B, E] and
    ``counts`` [B, E] (B sequences of ``num_tokens`` each) it returns the sum
    of the B sequences' losses.
    """
    num_experts = scores.shape[-1]
    per_expert = scores.sum(0) * counts.to(scores.dtype)
    return per_expert.sum() * (num_experts / (num_tokens * num_tokens * topk))


def sequence_load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, seq_length: int,
                                 topk: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the mean over sequences of each one's load-balancing loss.

    ``scores`` [s, B, E] are this rank's positions of the B sequences (all of
    them, or a sequence/context-parallel share); ``counts`` [B, E] each whole
    sequence's assignments per expert and ``seq_length`` its full length.
    Megatron-Core's ``seq_aux_loss`` computes the same.
    """
    return load_balancing_loss(scores, counts, seq_length, topk) / counts.shape[0]


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
