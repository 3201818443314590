"""Contiguous gradient (and, for ZeRO-1, parameter) storage split into communication buckets.

A :class:`GradBuffer` lays its parameters out back to back in the order their gradients become
ready in backward (the reverse of registration order), gives each parameter a ``main_grad`` view
into the flat gradient tensor, and groups consecutive parameters into :class:`Bucket` s of about
``bucket_size`` elements.  Each bucket is averaged over its data-parallel group with one collective:
an all-reduce, or a reduce-scatter when the buffer is sharded for the distributed optimizer.  A
sharded buffer also owns the parameters' storage, so updated shards are all-gathered in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.collectives import all_gather_single, reduce_scatter_single
from megalite.topology import group_rank, group_size


class Bucket:
    """Parameters occupying ``[start, end)`` of a buffer, reduced by one collective."""

    def __init__(self, index: int, params: list, start: int, end: int, buffer: "GradBuffer"):
        self.index = index
        self.params = params
        self.start = start
        self.end = end
        self.grad = buffer.grad_data[start:end]
        self.param = None if buffer.param_data is None else buffer.param_data[start:end]
        self.shard_size = (end - start) // buffer.dp_size
        self.pending: set = set()
        self.grad_handle = None
        self.launched = False
        self.param_handle = None

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s equal slice of this bucket's view ``flat``."""
        return flat[rank * self.shard_size:(rank + 1) * self.shard_size]


class GradBuffer:
    """Flat gradient storage for parameters sharing a dtype and a data-parallel group.

    params: the parameters in backward order.
    scale: factor applied before the sum-reduction (1/DP size, so the result is the DP mean).
    shard: pad every bucket to a multiple of the group size, reduce-scatter instead of
        all-reduce, and move the parameters into a flat buffer that can be all-gathered.
    shard_collectives: see :class:`~megalite.distributed.DDPConfig`.
    """

    def __init__(self, params: list, grad_dtype: torch.dtype, group, scale: float,
                 bucket_size: int | None, shard: bool, shard_collectives: str = "auto"):
        self.group = group
        self.dp_size = group_size(group)
        self.dp_rank = group_rank(group)
        self.scale = scale
        self.shard = shard
        if shard_collectives == "auto":
            gloo = group is not None and dist.get_backend(group) == "gloo"
            shard_collectives = "reduce_broadcast" if gloo else "scatter_gather"
        self.reduce_broadcast = shard_collectives == "reduce_broadcast"
        self.params = params
        device = params[0].device

        ranges, bucket_bounds, bucket_params = [], [], []
        offset = bucket_start = 0
        current: list = []

        def close_bucket():
            nonlocal offset, bucket_start, current
            if shard:
                offset += -offset % self.dp_size
            bucket_bounds.append((bucket_start, offset))
            bucket_params.append(current)
            bucket_start, current = offset, []

        for p in params:
            # A tied embedding gets a bucket of its own, so its ZeRO-1 shards cover the same elements
            # on the first and the last pipeline stage, whose shards finalize_model_grads sums.
            alone = getattr(p, "shared_embedding", False)
            if alone and current:
                close_bucket()
            ranges.append((offset, offset + p.numel()))
            offset += p.numel()
            current.append(p)
            if alone or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close_bucket()
        if current:
            close_bucket()
        self.numel = offset

        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if shard:
            self.param_data = torch.zeros(self.numel, dtype=params[0].dtype, device=device)
        self.buckets = [Bucket(i, ps, s, e, self) for i, (ps, (s, e)) in enumerate(zip(bucket_params, bucket_bounds))]

        self.range_of = dict(zip(params, ranges))
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        for p, (start, end) in self.range_of.items():
            p.main_grad = self.grad_data[start:end].view(p.shape)
            if shard:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view
        self.reset()

    def reset(self) -> None:
        """Forget which gradients arrived; called once a reduction round has finished."""
        for bucket in self.buckets:
            bucket.pending = set(bucket.params)
            bucket.launched = False
            bucket.grad_handle = None
        self._next = 0

    def mark_ready(self, param) -> None:
        """Record that ``param``'s gradient is final and launch every complete bucket, in order."""
        bucket = self.bucket_of[param]
        if bucket.launched:
            raise RuntimeError(
                f"a gradient of shape {tuple(param.shape)} arrived after its bucket's reduction started; "
                "wrap every micro-batch but the last in no_sync()")
        bucket.pending.discard(param)
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self._next = bucket.index + 1
        # Scale even without a collective: an expert buffer whose expert-DP group has one rank
        # still averages over the dense DP replicas.
        if self.scale != 1.0:
            bucket.grad.mul_(self.scale)
        if self.dp_size == 1:
            return
        if self.shard and not self.reduce_broadcast:
            out = bucket.shard(bucket.grad, self.dp_rank)
            bucket.grad_handle = reduce_scatter_single(out, bucket.grad, group=self.group, async_op=True)
        else:
            bucket.grad_handle = dist.all_reduce(bucket.grad, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Launch the buckets not yet launched, wait for all reductions, and reset."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
        self.reset()

    def local_range(self, param) -> tuple[int, int] | None:
        """The part ``(lo, hi)`` of ``param.view(-1)`` this rank updates, or None when it owns none."""
        start, end = self.range_of[param]
        if not self.shard:
            return 0, end - start
        bucket = self.bucket_of[param]
        own_lo = bucket.start + self.dp_rank * bucket.shard_size
        own_hi = own_lo + bucket.shard_size
        lo, hi = max(start, own_lo), min(end, own_hi)
        if lo >= hi:
            return None
        return lo - start, hi - start

    def start_param_sync(self) -> None:
        """All-gather every bucket's updated parameter shards, asynchronously, in forward order."""
        if self.dp_size == 1:
            return
        for bucket in reversed(self.buckets):
            if self.reduce_broadcast:
                bucket.param_handle = [
                    dist.broadcast(bucket.shard(bucket.param, r), dist.get_global_rank(self.group, r),
                                   group=self.group, async_op=True)
                    for r in range(self.dp_size)]
            else:
                local = bucket.shard(bucket.param, self.dp_rank).clone()
                bucket.param_handle = [all_gather_single(bucket.param, local, group=self.group, async_op=True)]

    def wait_param_sync(self, bucket: Bucket) -> None:
        if bucket.param_handle is not None:
            for handle in bucket.param_handle:
                handle.wait()
            bucket.param_handle = None

    def finish_param_sync(self) -> None:
        for bucket in self.buckets:
            self.wait_param_sync(bucket)
