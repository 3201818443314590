"""Autograd-aware collectives over a tensor-parallel group.

Each mapping is a pair of conjugate collectives: what it does in forward, its
adjoint does in backward.  The last dimension is the hidden (TP-split) one;
dimension 0 is the sequence dimension of the ``[s, b, h]`` layout, split by
sequence parallelism.  A None or size-1 group makes every mapping an identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import batch_invariant, topology
from megalite.collectives import all_gather_single, reduce_scatter_single


def _size(group) -> int:
    return topology.group_size(group)


def _check_divisible(length: int, parts: int, what: str) -> None:
    if length % parts:
        raise ValueError(f"{what} of size {length} is not divisible by the tensor-parallel size {parts}")


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over ``group`` into a new tensor (``x`` is left untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous block of the last dimension."""
    parts = _size(group)
    _check_divisible(x.shape[-1], parts, "last dimension")
    chunk = x.shape[-1] // parts
    rank = topology.group_rank(group)
    return x[..., rank * chunk:(rank + 1) * chunk].contiguous()


def gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension."""
    stacked = gather_first(x, group).view((_size(group),) + tuple(x.shape))
    return torch.cat(stacked.unbind(0), dim=-1)


def split_first(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous block of dimension 0."""
    parts = _size(group)
    _check_divisible(x.shape[0], parts, "dimension 0")
    chunk = x.shape[0] // parts
    rank = topology.group_rank(group)
    return x[rank * chunk:(rank + 1) * chunk].contiguous()


def gather_first(x: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's ``x`` along dimension 0 (optionally returning the work handle)."""
    parts = _size(group)
    out = torch.empty((parts * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_first(x: torch.Tensor, group, async_op: bool = False):
    """Sum ``x`` over ``group`` and keep this rank's block of dimension 0."""
    parts = _size(group)
    _check_divisible(x.shape[0], parts, "dimension 0")
    out = torch.empty((x.shape[0] // parts,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if batch_invariant.enabled():
            return batch_invariant.all_reduce(x, group)
        if not inplace:
            return all_reduce(x, group)
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first(grad, ctx.group), None, None
        return split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


def _resolve(group):
    group = topology.resolve_group(group, "tp")
    return None if _size(group) == 1 else group


def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    group = _resolve(group)
    return x if group is None else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None, *, inplace: bool = False) -> torch.Tensor:
    """All-reduce forward; identity backward (output of a row-parallel layer).

    ``inplace=True`` sums into ``x`` itself (when contiguous), saving a copy; only for a
    fresh partial result that nothing else reads, such as a row-parallel layer's product.
    """
    group = _resolve(group)
    return x if group is None else _ReduceFromRegion.apply(x, group, inplace and x.is_contiguous())


def scatter_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's block of the last dimension; all-gather the gradient."""
    group = _resolve(group)
    if group is not None:
        _check_divisible(x.shape[-1], _size(group), "last dimension")
    return x if group is None else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension; the gradient keeps this rank's block."""
    group = _resolve(group)
    return x if group is None else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's block of dimension 0; all-gather the gradient."""
    group = _resolve(group)
    if group is not None:
        _check_divisible(x.shape[0], _size(group), "sequence dimension 0")
    return x if group is None else _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along dimension 0.

    Backward reduce-scatters the gradient when the consumer is tensor-parallel
    (each rank holds a partial gradient), or just splits it when every rank
    already holds the full gradient (``tensor_parallel_output_grad=False``).
    """
    group = _resolve(group)
    return x if group is None else _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along dimension 0; all-gather the gradient."""
    group = _resolve(group)
    if group is not None:
        _check_divisible(x.shape[0], _size(group), "sequence dimension 0")
    return x if group is None else _ReduceScatterToSequenceRegion.apply(x, group)
