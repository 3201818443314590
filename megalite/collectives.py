"""The flat-tensor collectives under whichever name the running torch has.

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` (the old names warn);
torch 2.11 has only the old names.  Both take ``(output, input, group=,
async_op=)``.  Look them up at call time so tests can wrap ``torch.distributed``'s.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    """Concatenate every rank's ``input`` along dim 0 into ``output``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` over ranks and keep this rank's dim-0 slice in ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
