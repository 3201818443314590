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


class _InFlight:
    """The pending collective of one asynchronous all-to-all (forward's, then backward's) and its output."""

    def __init__(self):
        self.work = self.sent = self.received = None

    def start(self, x, group, output_splits, input_splits):
        self.sent = x.contiguous()
        self.received = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        self.work = dist.all_to_all_single(self.received, self.sent, output_splits, input_splits, group=group,
                                           async_op=True)
        return self.received

    def wait(self):
        self.work.wait()
        received, self.work = self.received, None
        self.sent = self.received = None
        return received


class _AllToAllStart(torch.autograd.Function):
    """Issue the all-to-all and return its output buffer unread; backward waits for the gradient's and
    returns it."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, flight):
        ctx.flight = flight
        return flight.start(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return ctx.flight.wait(), None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    """Wait for the forward all-to-all.  Backward issues the gradient's reverse all-to-all and passes the
    incoming gradient on unchanged (a placeholder of the right shape), so the nodes autograd runs before
    :class:`_AllToAllStart`'s backward, which waits, overlap the exchange."""

    @staticmethod
    def forward(ctx, received, group, output_splits, input_splits, flight):
        ctx.group, ctx.output_splits, ctx.input_splits, ctx.flight = group, output_splits, input_splits, flight
        return flight.wait().view_as(received)

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.start(grad, ctx.group, ctx.input_splits, ctx.output_splits)
        return grad, None, None, None, None


class PendingAllToAll:
    """An all-to-all in flight (from :func:`all_to_all_start`); :meth:`wait` returns its output."""

    def __init__(self, x, group, output_splits, input_splits):
        self._args, self._flight = (group, output_splits, input_splits), _InFlight()
        if group is None:
            self._out = x
        elif x.requires_grad:
            self._out = _AllToAllStart.apply(x, group, output_splits, input_splits, self._flight)
        else:
            self._out = self._flight.start(x, group, output_splits, input_splits)

    def wait(self) -> torch.Tensor:
        if self._args[0] is None:
            return self._out
        if self._out.requires_grad:
            return _AllToAllWait.apply(self._out, *self._args, self._flight)
        return self._flight.wait()


def all_to_all_start(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> PendingAllToAll:
    """:func:`all_to_all` issued asynchronously: compute may run until ``.wait()``; the result is the same.

    With gradients, the backward pass mirrors it: the gradient's all-to-all is issued by the wait's
    backward and waited for in the start's, so whatever autograd runs between those two nodes (the
    work the forward ran between start and wait, by its sequence numbers) overlaps it.
    """
    return PendingAllToAll(x, group, output_splits, input_splits)


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
