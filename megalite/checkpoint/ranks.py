"""How the ranks that write or read one checkpoint share outcomes (in-memory object collectives).

A write by one process inside a distributed run passes :data:`NO_GROUP` and runs no collective.
"""

from __future__ import annotations

import torch.distributed as dist

NO_GROUP = object()
"""Marks a write by one process inside a distributed run: no collective at all."""


def rank_and_size(group) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size; ``(0, 1)`` without a process group or with NO_GROUP."""
    if not dist.is_initialized() or group is NO_GROUP:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_object(value, group):
    """Every rank's ``value`` (in-memory exchange between the job's own ranks)."""
    if rank_and_size(group)[1] == 1:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def broadcast_from_zero(value, group):
    """Group rank 0's ``value``, on every rank of ``group``."""
    if rank_and_size(group)[1] == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]
