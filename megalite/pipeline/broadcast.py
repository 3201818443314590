"""Bring values computed on the last pipeline stage (losses, metrics) to every stage."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.topology import group_rank, group_size, resolve_group


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def broadcast_from_last_stage(values, pp_group=None, last_rank=None):
    """Return the last pipeline stage's ``values`` on every rank of the pipeline group.

    ``values`` is any picklable object (e.g. the metrics list returned by
    forward_backward); tensors in it arrive on the CPU.  Other stages' argument
    is ignored.  Without a pipeline (size 1) the values come back unchanged.
    ``last_rank`` is the pp rank holding the last stage (default ``pp - 1``; 0
    under the zbv schedule, see ``schedules.last_stage_rank``).
    """
    group = resolve_group(pp_group, "pp")
    size = group_size(group)
    if size == 1:
        return values
    src = size - 1 if last_rank is None else last_rank
    box = [_to_cpu(values) if group_rank(group) == src else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]
