"""Megatron-LM legacy rank files' model state dicts placed into megalite's global tensors.

Each model entry is the stage's ``state_dict_for_save_checkpoint()``: Megatron-Core names (megalite's own), layer
indices local to the stage (renumbered here: virtual stage, then pipeline stage), and each rank's TP shard.  Every
shard is placed into its global tensor by :func:`megalite.checkpoint.sharding.global_param`, the one global layout,
which already knows the per-rank SwiGLU ``[gate_r; up_r]`` rows, the per-group QKV rows and the vocabulary padding
(cut to the real size).  Transformer Engine names of the fused norms are renamed to the local layers' names and its
``_extra_state`` entries (FP8 metadata, no weights) are dropped.  MoE experts (SequentialMLP,
``mlp.experts.local_experts.<i>.``; GroupedMLP's ``mlp.experts.weight1|2`` first split into those by
:func:`megalite.checkpoint.megatron_buffers.grouped_split`) of each expert rank land at their indices of megalite's
stacked expert weights; the dense tensors, replicated over expert ranks, are read from expert rank 0.  The
optimizer's moments take the same way (:mod:`megalite.checkpoint.megatron_legacy_optim`).
"""

from __future__ import annotations

import re

import torch

from megalite.checkpoint import global_shapes
from megalite.checkpoint.meta import split_dims
from megalite.checkpoint.megatron_buffers import MTP_EMBEDDING_COPY, OUTPUT_COPY, WORD_EMBEDDINGS, grouped_split
from megalite.checkpoint.megatron_distopt import expert_param
from megalite.checkpoint.megatron_names import megalite_name
from megalite.checkpoint.sharding import ShardContext, global_param, local_meta, place

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _layers(chunk: dict) -> int:
    return len({int(m.group(1)) for m in map(_LAYER.match, chunk) if m})


def global_name(name: str, offset: int, stage: int = 0) -> str:
    """megalite's name of the entry ``name`` of pipeline stage ``stage`` whose first layer is global layer
    ``offset``: the layer renumbered; the word embeddings on a stage after the first are the copy of a last stage
    with MTP depths (:data:`MTP_EMBEDDING_COPY`, its name in megalite and in the torch_dist reader)."""
    match = _LAYER.match(name)
    if match is None:
        return MTP_EMBEDDING_COPY if stage > 0 and name == WORD_EMBEDDINGS else name
    rest = name[match.end():]
    return f"decoder.layers.{int(match.group(1)) + offset}.{megalite_name(rest)}"


def layer_offsets(chunks: dict, pp: int, with_total: bool = False):
    """``{(virtual stage, pipeline stage): its first layer's global number}`` of ``{(tp_rank, pp_rank, ep_rank):
    [state dict per virtual stage]}`` (layers are numbered within each chunk; global order is virtual stage, then
    pipeline stage), and with ``with_total`` the number of layers."""
    offsets, total = {}, 0
    for v in range(len(chunks[(0, 0, 0)])):
        for p in range(pp):
            offsets[(v, p)] = total
            total += _layers(chunks[(0, p, 0)][v])
    return (offsets, total) if with_total else offsets


def assemble(config, chunks: dict, tp: int, pp: int, directory: str,
             expert_tp: tuple[int, dict] | None = None) -> dict[str, torch.Tensor]:
    """Global tensors from ``{(tp_rank, pp_rank, ep_rank): [state dict per virtual stage]}`` (each expert rank's
    local experts placed in megalite's stacked expert weights; each dense tensor read from the first file of its
    tensor and pipeline rank, each expert shard from the first file that holds it).  ``expert_tp``: the expert
    tensor-parallel size and each file's expert tensor-parallel rank
    (:func:`megalite.checkpoint.megatron_legacy_files.written_ranks`); by default tp and the file's tensor rank."""
    etp, expert_ranks = expert_tp or (tp, {key: key[0] for key in chunks})
    dense_from, experts_from = {}, {}
    for t, p, e in sorted(chunks):
        dense_from.setdefault((t, p), e)
        experts_from.setdefault((expert_ranks[(t, p, e)], p, e), t)
    dims = split_dims(config)
    expected = global_shapes(config)
    offsets, total = layer_offsets(chunks, pp, with_total=True)
    if total != config.num_layers:
        raise ValueError(f"{directory} holds {total} transformer layers, but the saved args say num_layers "
                         f"{config.num_layers}")
    out, filled = {}, {}
    ep = 1 + max(e for _, _, e in chunks)
    for (t, p, e), per_stage in chunks.items():
        for v, chunk in enumerate(per_stage):
            for key, value in grouped_split(chunk, config.moe.num_experts // ep if config.moe else 1):
                if key.endswith("_extra_state") or value is None:
                    continue
                name = global_name(key, offsets[(v, p)], p)
                if name == MTP_EMBEDDING_COPY or (name == OUTPUT_COPY
                                                  and not config.untie_embeddings_and_output_weights):
                    continue  # the last stage's copy of the word embeddings (tied, or for MTP depths)
                x = expert_ranks[(t, p, e)]
                ctx = ShardContext(tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep, etp_rank=x, etp_size=etp)
                expert = expert_param(name, tuple(value.shape), config.moe.num_experts, dims, config, ctx) \
                    if config.moe is not None else None
                if expert is not None:
                    if experts_from[(x, p, e)] != t:
                        continue  # another tensor rank's copy of these expert shards
                    value = value.view(expert[1])
                    gp = expert[2]
                elif name not in dims:
                    raise ValueError(f"{directory}: {key} (stage {p}, tensor rank {t}) is no parameter of the model "
                                     "the saved args describe")
                elif dense_from[(t, p)] != e:
                    continue  # an expert rank's replica of another's dense tensor
                else:
                    gp = global_param(name, local_meta(value.shape, dims[name]), config,
                                      ShardContext(tp_rank=t, tp_size=tp))
                if gp.alias or (dims.get(gp.name) is None and (x if expert is not None else t) > 0):
                    continue  # a tied output layer's copy, or a TP replica of rank 0's tensor
                if tuple(gp.shape) != expected.get(gp.name):
                    raise ValueError(f"{directory}: {key} of tensor rank {t} has shape {tuple(value.shape)}, which "
                                     f"makes a global {tuple(gp.shape)}; the saved args need {expected.get(gp.name)}")
                target = out.setdefault(gp.name, torch.empty(gp.shape, dtype=value.dtype))
                filled[gp.name] = filled.get(gp.name, 0) + place(target, value, gp.pieces)
    missing = [name for name, shape in expected.items() if filled.get(name, 0) != torch.Size(shape).numel()]
    if missing:
        raise ValueError(f"{directory} does not hold all of {missing[0]} (nor of {len(missing) - 1} other tensors)")
    return out
