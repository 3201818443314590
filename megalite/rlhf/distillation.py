"""Distillation from a (served) teacher: its outputs, the forward KL on its support, and log-prob rewards.

The teacher runs on one rank (:class:`~megalite.rlhf.scoring_server.ScoringServer`)
and returns per-token log-probabilities over the full vocabulary, or only the
top-k of them (values + indices) to cut the transfer from ``V`` to ``2k``
numbers per token, plus the log-probability of each actual next token.
The student's logits stay vocab-sharded over TP; only per-token sums cross ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite import topology
from megalite.tensor_parallel.mappings import reduce_from_tensor_parallel_region


@dataclass
class TeacherOutput:
    """Per-token teacher outputs ``[b, s, ...]``; position ``t`` predicts token ``t+1``.

    ``log_probs``: ``[b, s, k]`` (top-k) or ``[b, s, V]`` (full), normalized over the whole
    vocabulary; ``indices``: ``[b, s, k]`` token ids of the top-k, None for full;
    ``token_log_probs``: ``[b, s]`` log-prob of the next input token (0 where it is padding or absent).
    """

    log_probs: torch.Tensor
    indices: torch.Tensor | None
    token_log_probs: torch.Tensor

    @classmethod
    def from_outputs(cls, outputs: tuple) -> "TeacherOutput":
        """From :func:`teacher_fn`'s tuple (as served to a rank)."""
        if len(outputs) == 3:
            return cls(*outputs)
        return cls(outputs[0], None, outputs[1])


def teacher_fn(model: torch.nn.Module, topk: int | None = None):
    """``(ids, mask) -> outputs`` of a single-process GPT ``model`` for a :class:`ScoringServer`.

    Returns ``(top-k log-probs, top-k indices, next-token log-probs)``, or without the
    indices when ``topk`` is None (full vocabulary).
    """
    if topk is not None and (not isinstance(topk, int) or topk < 1):
        raise ValueError(f"teacher top-k must be a positive integer, got {topk!r}")

    def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        logits = model(ids, attention_mask=mask).float()
        if topk is not None and topk > logits.shape[-1]:
            raise ValueError(f"--teacher-topk {topk} exceeds the teacher's vocabulary of {logits.shape[-1]}")
        log_probs = torch.log_softmax(logits, dim=-1)
        token = torch.zeros(ids.shape, dtype=log_probs.dtype, device=log_probs.device)
        token[:, :-1] = log_probs[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * mask[:, 1:]
        if topk is None:
            return log_probs, token
        values, indices = log_probs.topk(topk, dim=-1)
        return values, indices, token

    return run


def student_log_probs_at(logits_shard: torch.Tensor, indices: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Full-vocabulary log-probs of the student at global token ids ``indices [..., k]``, differentiable.

    ``logits_shard [..., v/tp]`` is this TP rank's vocabulary block; the log-sum-exp and
    the gathered logits are summed over TP (identity backward, each rank's own block).
    """
    group = topology.resolve_group(tp_group, "tp")
    group = None if topology.group_size(group) == 1 else group
    logits = logits_shard.float()
    local = logits.shape[-1]
    offset = 0 if group is None else dist.get_rank(group) * local
    top = logits.detach().max(dim=-1, keepdim=True).values
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = reduce_from_tensor_parallel_region((logits - top).exp().sum(dim=-1, keepdim=True), group)
    log_norm = sum_exp.log() + top
    position = indices - offset
    inside = (position >= 0) & (position < local)
    picked = logits.gather(-1, position.clamp(0, local - 1)) * inside
    return reduce_from_tensor_parallel_region(picked, group) - log_norm


def forward_kl(student_logits_shard: torch.Tensor, teacher: TeacherOutput, tp_group=None) -> torch.Tensor:
    """Per-token ``KL(teacher || student)`` on the teacher's support ``[b, s]``.

    With top-k the teacher distribution is renormalized over its k ids; with the full
    vocabulary this is the exact forward KL.
    """
    indices = teacher.indices
    if indices is None:
        vocab = teacher.log_probs.shape[-1]
        indices = torch.arange(vocab, device=teacher.log_probs.device).expand(teacher.log_probs.shape)
    student = student_log_probs_at(student_logits_shard, indices, tp_group)
    target = torch.log_softmax(teacher.log_probs.float(), dim=-1)
    return (target.exp() * (target - student)).sum(dim=-1)


def teacher_rewards(teacher: TeacherOutput, mask: torch.Tensor, coef: float = 1.0) -> torch.Tensor:
    """Per-token rewards ``coef x log p_teacher(next token)`` on ``mask [b, s-1]`` (aligned with ids[:, 1:])."""
    return coef * teacher.token_log_probs[:, :-1].to(mask.device) * mask
