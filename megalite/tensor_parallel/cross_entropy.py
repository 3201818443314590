"""Losses over vocabulary-sharded logits that never gather the full vocabulary.

Each rank holds logits ``[..., v/tp]`` for its contiguous vocabulary block.
Only per-token statistics cross ranks: the max (for stability), the sum of
exponentials and the target logit (one stacked all-reduce).  Math is fp32
whatever the logits dtype; gradients come back in the logits dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology


def _all_reduce_(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _shifted_logits(logits_shard: torch.Tensor, group) -> torch.Tensor:
    """fp32 logits minus the global per-token max."""
    logits = logits_shard.float()
    global_max = _all_reduce_(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
    return logits - global_max.unsqueeze(-1)


def _resolve(tp_group):
    group = topology.resolve_group(tp_group, "tp")
    return None if topology.group_size(group) == 1 else group


def _check_target(logits_shard: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits shape "
                         f"{tuple(logits_shard.shape)} without its last (vocabulary) dimension")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, label_smoothing, group):
        shifted = _shifted_logits(logits_shard, group)
        shard = shifted.shape[-1]
        vocab = shard * topology.group_size(group)
        start = topology.group_rank(group) * shard
        in_shard = (target >= start) & (target < start + shard)
        local_target = (target - start).masked_fill(~in_shard, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        exp = shifted.exp()
        stats = [target_logit, exp.sum(dim=-1)]
        if label_smoothing:
            stats.append(shifted.sum(dim=-1))
        stats = _all_reduce_(torch.stack(stats), group)
        log_z = stats[1].log()
        loss = log_z - stats[0]
        if label_smoothing:
            mean_log_prob = stats[2] / vocab - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        softmax = exp.div_(stats[1].unsqueeze(-1))
        ctx.save_for_backward(softmax, in_shard, local_target)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_shard, local_target = ctx.saved_tensors
        grad = softmax.clone()
        hit = in_shard.to(grad.dtype).unsqueeze(-1) * (1.0 - ctx.label_smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        if ctx.label_smoothing:
            grad.sub_(ctx.label_smoothing / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, group):
        shifted = _shifted_logits(logits_shard, group)
        exp = shifted.exp()
        # Masked (-inf) logits have zero probability and contribute nothing, not 0 * -inf.
        weighted = torch.where(exp > 0, exp * shifted, 0.0)
        stats = _all_reduce_(torch.stack([exp.sum(dim=-1), weighted.sum(dim=-1)]), group)
        mean_logit = stats[1] / stats[0]
        probs = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(probs, shifted, mean_logit)
        ctx.dtype = logits_shard.dtype
        return stats[0].log() - mean_logit

    @staticmethod
    def backward(ctx, grad_entropy):
        probs, shifted, mean_logit = ctx.saved_tensors
        grad = torch.where(probs > 0, probs * (mean_logit.unsqueeze(-1) - shifted), 0.0)
        grad = grad * grad_entropy.unsqueeze(-1)
        return grad.to(ctx.dtype), None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                                 tp_group=None) -> torch.Tensor:
    """Per-token cross entropy ``[...]`` (fp32) of vocabulary-sharded logits ``[..., v/tp]``.

    Matches ``F.cross_entropy(full_logits, target, reduction="none",
    label_smoothing=...)``.  Targets outside ``[0, v)`` (e.g. padding marked
    -100) get ``logsumexp`` as loss; mask them in the caller.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    _check_target(logits_shard, target)
    group = _resolve(tp_group)
    vocab = logits_shard.shape[-1]
    if group is None and not bool(((target < 0) | (target >= vocab)).any()):
        # One rank holds the whole vocabulary: torch's fused log-softmax + NLL makes fewer passes
        # over the logits.  Out-of-range targets keep the general path and its documented loss.
        return F.cross_entropy(logits_shard.float().reshape(-1, vocab), target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, float(label_smoothing), group)


def vocab_parallel_log_probs(logits_shard: torch.Tensor, target: torch.Tensor, tp_group=None,
                             rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token ``log p(target)`` ``[...]`` (fp32) of vocabulary-sharded logits.

    ``rows`` (``target``'s shape): ``logits_shard`` is ``[u, v/tp]`` and ``target[i]`` is scored against row
    ``rows[i]``, the same values as ``logits_shard[rows]`` gives.  On one rank a row that several targets read is
    normalized once (one log-softmax over the ``u`` rows, then one gather); under TP the rows are gathered first.
    """
    if rows is None:
        return -vocab_parallel_cross_entropy(logits_shard, target, tp_group=tp_group)
    if tuple(rows.shape) != tuple(target.shape) or logits_shard.dim() != 2:
        raise ValueError(f"rows {tuple(rows.shape)} must match target {tuple(target.shape)} and index the rows of "
                         f"[u, v] logits, got {tuple(logits_shard.shape)}")
    vocab = logits_shard.shape[-1]
    if _resolve(tp_group) is None and not bool(((target < 0) | (target >= vocab)).any()):
        return F.log_softmax(logits_shard.float(), dim=-1)[rows, target]
    return -vocab_parallel_cross_entropy(logits_shard[rows], target, tp_group=tp_group)


def vocab_parallel_entropy(logits_shard: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token entropy ``[...]`` (fp32) of the softmax over vocabulary-sharded logits."""
    return _VocabParallelEntropy.apply(logits_shard, _resolve(tp_group))
