"""Differentiable collectives with uneven splits, for moving tokens between expert ranks.

Every function here is a no-op on a None group and each forward collective's
adjoint runs in backward, so gradients follow the tokens home.  Uneven
all-gathers and reduce-scatters are built on ``all_to_all_single``, which both
gloo and NCCL support with per-rank split sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Send rows ``x[sum(input_splits[:r]):...]`` to rank r of ``group``; receive ``output_splits`` rows."""
    if group is None:
        return x
    if x.requires_grad:
        return _AllToAll.apply(x, group, output_splits, input_splits)
    return _all_to_all(x, group, output_splits, input_splits)


def gather_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (rank r holds ``sizes[r]``); backward sums the gradients home."""
    if group is None:
        return x
    parts = len(sizes)
    return all_to_all(x.repeat((parts,) + (1,) * (x.dim() - 1)), group, sizes, [x.shape[0]] * parts)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Sum ``x`` (every rank's rows, rank r's block has ``sizes[r]`` rows) over ranks; keep this rank's block."""
    if group is None:
        return x
    parts, mine = len(sizes), sizes[dist.get_rank(group)]
    received = all_to_all(x, group, [mine] * parts, sizes)
    return received.view((parts, mine) + tuple(x.shape[1:])).sum(0)


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Stack an integer tensor of the same shape from every rank: ``[group size, *counts.shape]``."""
    if group is None:
        return counts.unsqueeze(0)
    out = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, counts.contiguous(), group=group)
    return torch.stack(out)
