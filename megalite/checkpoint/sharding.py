"""Where each local parameter shard lies inside its global (unsharded, layout-free) tensor.

A global tensor is what a single-process model would hold, in a layout that does not depend on
the parallel sizes:

- tensor-parallel shards (``tensor_model_parallel``/``partition_dim``) are concatenated along
  ``partition_dim``; the grouped QKV layout is already TP-independent;
- the SwiGLU ``linear_fc1`` (the MLP's or an MoE shared expert's, and a SwiGLU expert's fc1) is
  stored as ``[gate; up]``, although each TP rank holds ``[gate_i; up_i]``: its shard maps onto two
  regions;
- the vocabulary rows of the word embedding and output layer are cut to ``config.vocab_size``, so
  the padding (which depends on the TP size) is not stored;
- expert parameters (``expert_parallel``) ``[num_local, ...]`` sit at experts
  ``ep_rank * num_local ...`` of ``[num_experts, ...]``, split over expert-TP like dense shards;
- a tied output layer on the last pipeline stage is the word embedding itself, and so is multi-token
  prediction's copy of it there (``mtp.embedding.word_embeddings.weight``).

A local tensor maps onto its global tensor as a list of :class:`Piece`: a box of the local tensor
and the global coordinates of the box's first element.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from megalite import topology

Box = tuple[tuple[int, int], ...]
"""A rectangular region: ``(start, stop)`` for every dimension."""

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight", "mtp.embedding.word_embeddings.weight")
WORD_EMBEDDING = "embedding.word_embeddings.weight"
MTP_WORD_EMBEDDING = "mtp.embedding.word_embeddings.weight"
"""Multi-token prediction's copy of the word embedding on a separate last pipeline stage."""


@dataclass(frozen=True)
class ShardContext:
    """This rank's coordinates along the axes that shard parameters."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def from_groups(cls, tp_group=None, ep_group=None, expert_tp_group=None) -> "ShardContext":
        """Coordinates in the given groups, defaulting to the current topology's (none: single process)."""
        tp = topology.resolve_group(tp_group, "tp")
        ep = topology.resolve_group(ep_group, "ep")
        etp = topology.resolve_group(expert_tp_group, "expert_tp")
        return cls(topology.group_rank(tp), topology.group_size(tp), topology.group_rank(ep),
                   topology.group_size(ep), topology.group_rank(etp), topology.group_size(etp))


@dataclass(frozen=True)
class Piece:
    """The local box ``local`` is the global region starting at ``offset``."""

    local: Box
    offset: tuple[int, ...]


@dataclass(frozen=True)
class GlobalParam:
    """How one local parameter maps onto the global tensor ``name`` of shape ``shape``.

    ``replicated`` lists the axes ("tp" or "etp") over which identical copies exist, so only
    rank 0 of those axes needs to write it.  ``alias`` marks a copy stored under another
    parameter's name (a tied output layer): it is read, never written.
    """

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    replicated: tuple[str, ...] = ()
    alias: bool = False
    expert: bool = False


def _segments(length: int, rank: int, size: int, gated: bool) -> tuple[list[tuple[int, int, int]], int]:
    """``[(local_start, local_stop, global_start)]`` of one split dimension, and its global length."""
    if not gated:
        return [(0, length, rank * length)], length * size
    if length % 2:
        raise ValueError(f"a gated [gate; up] shard needs an even length along its split dimension, got {length}")
    half = length // 2
    return [(0, half, rank * half), (half, length, size * half + rank * half)], length * size


def global_param(name: str, param: torch.Tensor, config, ctx: ShardContext) -> GlobalParam:
    """The global tensor and pieces of local parameter ``name`` (``config``: the model's GPTConfig or None)."""
    shape = tuple(param.shape)
    expert = bool(getattr(param, "expert_parallel", False))
    split_dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    gated = False
    if config is not None:
        if expert and config.moe is not None:
            gated = config.moe.activation == "swiglu" and name.endswith(("experts.fc1_weight", "experts.fc1_bias"))
        else:
            gated = config.activation == "swiglu" and name.endswith((".linear_fc1.weight", ".linear_fc1.bias"))
    rank, size = (ctx.etp_rank, ctx.etp_size) if expert else (ctx.tp_rank, ctx.tp_size)

    per_dim, global_shape = [], []
    for dim, length in enumerate(shape):
        if dim == split_dim:
            segments, total = _segments(length, rank, size, gated)
        elif expert and dim == 0:
            segments, total = [(0, length, ctx.ep_rank * length)], length * ctx.ep_size
        else:
            segments, total = [(0, length, 0)], length
        per_dim.append(segments)
        global_shape.append(total)

    alias = False
    global_name = name
    if config is not None and name in VOCAB_PARAMS:
        global_shape[0] = config.vocab_size
        per_dim[0] = [(lo, min(hi, lo + config.vocab_size - g), g) for lo, hi, g in per_dim[0]
                      if g < config.vocab_size]
        if name == MTP_WORD_EMBEDDING or (name == "output_layer.weight"
                                           and not config.untie_embeddings_and_output_weights):
            global_name, alias = WORD_EMBEDDING, True

    pieces = tuple(Piece(tuple((lo, hi) for lo, hi, _ in combo), tuple(g for _, _, g in combo))
                   for combo in itertools.product(*per_dim))
    replicated = () if split_dim is not None else (("etp",) if expert else ("tp",))
    return GlobalParam(global_name, tuple(global_shape), pieces, replicated, alias, expert)


def local_meta(shape: tuple[int, ...], split_dim: int | None) -> torch.Tensor:
    """A meta tensor of a local shard's ``shape`` split along ``split_dim`` (None: replicated), carrying the
    attributes :func:`global_param` reads: a shard read from a file rather than held by a model."""
    local = torch.empty(tuple(shape), device="meta")
    local.tensor_model_parallel, local.partition_dim = split_dim is not None, split_dim
    return local


def place(target: torch.Tensor, local: torch.Tensor, pieces: tuple[Piece, ...]) -> int:
    """Copy each piece of the local shard ``local`` into the global tensor ``target``; returns the elements copied."""
    copied = 0
    for piece in pieces:
        part = local[box_slices(piece.local)]
        target[tuple(slice(o, o + n) for o, n in zip(piece.offset, part.shape))] = part
        copied += part.numel()
    return copied


def flat_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[Box, int]]:
    """Split the flat range ``[lo, hi)`` of a row-major ``shape`` into boxes, each a contiguous run.

    Returns ``[(box, flat_start)]`` in order; a ZeRO-1 shard of a parameter is such a range.
    """
    if not shape:
        return [((), lo)] if hi > lo else []
    inner = 1
    for size in shape[1:]:
        inner *= size
    boxes: list[tuple[Box, int]] = []
    position = lo
    while position < hi:
        row, within = divmod(position, inner)
        if within == 0 and hi - position >= inner:
            rows = (hi - position) // inner
            boxes.append((((row, row + rows),) + tuple((0, s) for s in shape[1:]), position))
            position += rows * inner
        else:
            stop = min(hi, (row + 1) * inner)
            for box, start in flat_boxes(within, stop - row * inner, shape[1:]):
                boxes.append((((row, row + 1),) + box, start + row * inner))
            position = stop
    return boxes


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None."""
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def box_slices(box: Box, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
    """Index of ``box`` in a tensor whose first element sits at ``origin`` (default: zeros)."""
    origin = origin or (0,) * len(box)
    return tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin))


def regions(box: Box, pieces: tuple[Piece, ...]):
    """For a local ``box``, yield ``(part, global_offset)``: its parts that lie in a piece, in global coordinates."""
    for piece in pieces:
        part = intersect(box, piece.local)
        if part is None:
            continue
        yield part, tuple(off + lo - plo for off, (lo, _), (plo, _) in zip(piece.offset, part, piece.local))
