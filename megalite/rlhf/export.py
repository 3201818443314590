"""Stream a TP/PP-sharded GPT's weights as full tensors under Hugging Face names.

For inference engines that take weight updates name by name: each parameter
is all-gathered over TP, made the checkpoint's global tensor (vocabulary
padding dropped, SwiGLU's per-rank [gate; up] blocks regrouped), broadcast from
the pipeline stage that holds it, and named and split by the Hugging Face
converter (megalite.checkpoint.hf), one at a time, so at most one full tensor
is alive per call.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint.hf import megalite_tensor_to_hf
from megalite.distributed.unwrap import unwrap


def _global_tensor(name: str, full: torch.Tensor, config, tp: int) -> torch.Tensor:
    """A TP-gathered tensor as the checkpoint's global tensor: vocabulary padding dropped, and
    SwiGLU's per-rank ``[gate_i; up_i]`` blocks regrouped into ``[gate; up]``."""
    if "word_embeddings" in name or "output_layer" in name:
        return full[:config.vocab_size]
    if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")) and config.activation == "swiglu":
        return full.view(tp, 2, -1, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    return full


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _gather_tp(param: torch.Tensor, tp_group) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or topology.group_size(tp_group) == 1:
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(topology.group_size(tp_group))]
    dist.all_gather(parts, param.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)


@torch.no_grad()
def export_hf_weights(model_chunk, pp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight, on every rank of the model replica (TP x PP).

    Every rank of the replica must consume the whole iterator (it runs collectives).
    A weight tied to the embedding (the output layer of a tied config) is not repeated.
    """
    model = unwrap(model_chunk)
    config, tp_group = model.config, model.tp_group
    tp = topology.group_size(tp_group)
    pp_group = topology.resolve_group(pp_group, "pp")
    tied = not config.untie_embeddings_and_output_weights
    params = {n: p for n, p in model.named_parameters() if not (tied and n == "output_layer.weight")}
    mine = [(n, _full_shape(p, tp), p.dtype) for n, p in params.items()]
    listing = [mine]
    if topology.group_size(pp_group) > 1:
        listing = [None] * topology.group_size(pp_group)
        dist.all_gather_object(listing, mine, group=pp_group)
    me = topology.group_rank(pp_group)
    device = next(model.parameters()).device
    for stage, entries in enumerate(listing):
        for name, shape, dtype in entries:
            if stage == me:
                full = _gather_tp(params[name], tp_group)
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            if len(listing) > 1:
                dist.broadcast(full.contiguous() if stage == me else full, src=dist.get_global_rank(pp_group, stage),
                               group=pp_group)
            yield from megalite_tensor_to_hf(config, name, _global_tensor(name, full, config, tp))
