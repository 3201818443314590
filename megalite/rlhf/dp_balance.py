"""Token-balanced batching for RL updates: rows moved between DP ranks so every rank trains about the same number
of tokens, and micro-batches cut by a token budget instead of a row count.

Rollouts vary in length, so the rows each DP rank generated can hold very different token counts, and the rank
with the most tokens sets the update's pace.  :func:`balanced_partitions` splits the whole batch's rows (sorted
longest first, each given to the rank with the fewest tokens that still has room) into equal-count parts, so the
micro-batch size still divides every rank's share; :func:`balance_batches` gathers the batch over the DP group and
keeps this rank's part.  The loss does not change: megalite's objectives normalize by the global token (or
sequence) count (``ppo.global_normalizer``), so any assignment of rows to ranks gives the same global mean and,
after DDP's all-reduce, the same gradients.  Rebalance after the advantages (GRPO groups are contiguous rows of
one rank).  :func:`token_micro_batches` packs a rank's rows, longest first, into micro-batches of at most
``budget`` padded tokens, each cut to its longest row's columns (right padding only: no real token moves), so
short rows stop paying for the longest row's width; the global normalizer keeps the loss the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def balanced_partitions(lengths: list[int], parts: int) -> list[list[int]]:
    """``parts`` lists of row indices (each sorted, ``len(lengths) / parts`` rows each) whose summed ``lengths``
    are about equal: greedy in order of decreasing length, each row to the least loaded part with room."""
    if parts < 1 or len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows cannot be split into {parts} equal parts")
    size = len(lengths) // parts
    load, members = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < size), key=lambda p: (load[p], p))
        members[part].append(i)
        load[part] += lengths[i]
    return [sorted(m) for m in members]


def _gather_rows(tensor: torch.Tensor, width: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` (right-padded with zeros to ``width`` columns in dim 1), concatenated in rank order."""
    if tensor.dim() > 1 and tensor.shape[1] < width:
        pad = [0, 0] * (tensor.dim() - 2) + [0, width - tensor.shape[1]]
        tensor = F.pad(tensor, pad)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def balance_batches(batches: list[dict], attention_mask: torch.Tensor, group) -> tuple[list[dict], list[int]]:
    """This DP rank's rows of the whole batch after :func:`balanced_partitions` of the rows' token counts
    (``attention_mask`` of this rank's rows, ``[b, s]``; every rank has ``b`` rows), for every dict of row
    tensors in ``batches`` (``[b, s, ...]`` or ``[b, s - 1, ...]``; a narrower rank's columns are right-padded
    with zeros, masked everywhere); also each rank's token count after balancing."""
    size = dist.get_world_size(group)
    widths = torch.tensor([attention_mask.shape[1]], device=attention_mask.device)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=group)
    width = int(widths)
    lengths = _gather_rows(attention_mask, width, group).sum(dim=1).tolist()
    partitions = balanced_partitions(lengths, size)
    mine = torch.tensor(partitions[dist.get_rank(group)], device=attention_mask.device)
    shift = width - attention_mask.shape[1]
    result = []
    for batch in batches:
        result.append({key: _gather_rows(value, value.shape[1] + shift if value.dim() > 1 else 0, group)[mine]
                       for key, value in batch.items()})
    return result, [sum(lengths[i] for i in part) for part in partitions]


def token_micro_batches(batch: dict, budget: int) -> list[dict]:
    """``batch``'s rows (``[b, s, ...]`` and ``[b, s - 1, ...]`` tensors with an ``attention_mask`` ``[b, s]``)
    sorted by their last real column, longest first, and packed greedily into micro-batches of at most
    ``budget`` padded tokens (rows x the micro-batch's columns; a longer row goes alone), each cut after its
    longest row's last real column."""
    if "attention_mask" not in batch:
        raise ValueError("token-budget micro-batches need the batch's attention_mask")
    mask = batch["attention_mask"]
    width = mask.shape[1]
    ends = (mask * torch.arange(1, width + 1, device=mask.device)).amax(dim=1).tolist()
    groups: list[list[int]] = []
    for i in sorted(range(len(ends)), key=lambda i: (-ends[i], i)):
        if groups and (len(groups[-1]) + 1) * ends[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])

    def cut(value: torch.Tensor, rows: torch.Tensor, cols: int) -> torch.Tensor:
        value = value[rows]
        if value.dim() > 1 and value.shape[1] in (width, width - 1):
            value = value[:, :cols - (width - value.shape[1])]
        return value

    micro_batches = []
    for group in groups:
        rows = torch.tensor(group, device=mask.device)
        micro_batches.append({key: cut(value, rows, max(int(ends[group[0]]), 2)) for key, value in batch.items()})
    return micro_batches
