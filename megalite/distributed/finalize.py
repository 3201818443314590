"""The gradient reductions that follow the last micro-batch of an iteration."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megalite.topology import group_size, resolve_group


def _all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    if not tensors or group_size(group) == 1:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(reduced)


def finalize_model_grads(model_chunks: list, tp_group=None, embedding_group=None) -> None:
    """Finish the DP reductions of every chunk, then the TP and embedding gradient sums.

    Gradients of ``sequence_parallel`` parameters (replicated over TP, partial per rank) are summed
    over ``tp_group``; those of ``shared_embedding`` parameters over ``embedding_group`` (the first
    and last pipeline stage), so tied weights receive one gradient.
    """
    tp_group = resolve_group(tp_group, "tp")
    embedding_group = resolve_group(embedding_group, "embedding")
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    params = [p for chunk in model_chunks for p in chunk.module.parameters() if p.requires_grad]
    _all_reduce_coalesced([p.main_grad for p in params if getattr(p, "sequence_parallel", False)], tp_group)
    _all_reduce_coalesced([p.main_grad for p in params if getattr(p, "shared_embedding", False)], embedding_group)
