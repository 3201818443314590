"""Stream a TP/EP/PP-sharded GPT's weights as full global tensors, or under Hugging Face names.

For inference engines that take weight updates name by name.  Each parameter is gathered over the
axes that shard it (TP; expert-TP and EP for experts) and each rank's shard is placed in the global
tensor where the checkpoint layout puts it (:func:`megalite.checkpoint.sharding.global_param`:
vocabulary padding dropped, SwiGLU's per-rank ``[gate_i; up_i]`` regrouped, experts at their global
index), then broadcast from the pipeline stage that holds it.  :func:`export_hf_weights` names and
splits each tensor with the Hugging Face converter (:func:`megalite.checkpoint.hf.megalite_tensor_to_hf`).
One tensor at a time, so at most one full tensor is alive per call.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint.hf import hf_family, megalite_tensor_to_hf
from megalite.checkpoint.sharding import ShardContext, box_slices, global_param
from megalite.distributed.unwrap import unwrap

_AXES = {"tp": ("tp_rank", "tp_size"), "etp": ("etp_rank", "etp_size"), "ep": ("ep_rank", "ep_size")}


def _sharding_axes(param: torch.Tensor) -> tuple[str, ...]:
    """The axes whose ranks hold different pieces of ``param``."""
    split = ("etp",) if getattr(param, "expert_parallel", False) else ("tp",)
    axes = split if getattr(param, "tensor_model_parallel", False) else ()
    return axes + (("ep",) if getattr(param, "expert_parallel", False) else ())


def _full_tensor(name: str, param: torch.Tensor, config, ctx: ShardContext, groups: dict) -> torch.Tensor:
    """The global tensor of local parameter ``name``: every shard gathered and put at its global place."""
    shards = [(ctx, param.detach())]
    for axis in _sharding_axes(param):
        rank_field, size_field = _AXES[axis]
        size = getattr(ctx, size_field)
        if size == 1:
            continue
        local = torch.stack([tensor for _, tensor in shards]).contiguous()
        gathered = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(gathered, local, group=groups[axis])
        shards = [(dataclasses.replace(coords, **{rank_field: r}), block[i])
                  for r, block in enumerate(gathered) for i, (coords, _) in enumerate(shards)]
    layout = global_param(name, param, config, ctx)
    full = torch.empty(layout.shape, dtype=param.dtype, device=param.device)
    for coords, tensor in shards:
        for piece in global_param(name, param, config, coords).pieces:
            box = tuple((start, start + hi - lo) for start, (lo, hi) in zip(piece.offset, piece.local))
            full[box_slices(box)] = tensor[box_slices(piece.local)]
    return full


@torch.no_grad()
def export_global_weights(model_chunks, pp_group=None, ep_group=None,
                          expert_tp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(global_name, full_tensor)`` for every global model tensor, on every rank of the replica.

    ``model_chunks`` is this rank's chunk (optionally DDP-wrapped) or its list of chunks.  The
    tensors are the checkpoint's global tensors, the same under any TP / EP / expert-TP / PP layout;
    groups default to the current topology's.  Every rank of the model replica (TP x EP x PP) must
    consume the whole iterator (it runs collectives).  A tied output layer is not repeated.
    """
    models = [unwrap(chunk) for chunk in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
    config = models[0].config
    groups = {"tp": models[0].tp_group, "ep": topology.resolve_group(ep_group, "ep"),
              "etp": topology.resolve_group(expert_tp_group, "expert_tp")}
    ctx = ShardContext.from_groups(groups["tp"], groups["ep"], groups["etp"])
    pp_group = topology.resolve_group(pp_group, "pp")
    params = {}
    for model in models:  # parameters and persistent buffers (a router's expert_bias), as checkpoints hold them
        for name, param in model.state_dict(keep_vars=True).items():
            layout = global_param(name, param, config, ctx)
            if not layout.alias:
                params[layout.name] = (name, param, layout.shape)
    mine = [(global_name, shape, param.dtype) for global_name, (_, param, shape) in params.items()]
    listing = [mine]
    if topology.group_size(pp_group) > 1:
        listing = [None] * topology.group_size(pp_group)
        dist.all_gather_object(listing, mine, group=pp_group)
    me = topology.group_rank(pp_group)
    device = next(models[0].parameters()).device
    for stage, entries in enumerate(listing):
        for global_name, shape, dtype in entries:
            if stage == me:
                name, param, _ = params[global_name]
                full = _full_tensor(name, param, config, ctx, groups)
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            if len(listing) > 1:
                dist.broadcast(full, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            yield global_name, full


def export_hf_weights(model_chunks, pp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight, on every rank of the model replica (TP x PP).

    :func:`export_global_weights` named and split by the Hugging Face converter.  A model with no
    Hugging Face family (e.g. GELU experts) raises ValueError before any collective.
    """
    model = unwrap(model_chunks[0] if isinstance(model_chunks, (list, tuple)) else model_chunks)
    hf_family(model.config)
    for name, full in export_global_weights(model_chunks, pp_group):
        yield from megalite_tensor_to_hf(model.config, name, full)
