"""How a decoder's layers are split over pipeline stages and virtual chunks.

Stages run layers in global order; which (rank, chunk) holds which stage is
:class:`megalite.pipeline.stages.StageMap` (interleaved, or the zbv schedule's V).
"""

from __future__ import annotations

from collections.abc import Sequence

from megalite.pipeline.stages import StageMap


def _check_count(name: str, value, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")


def _stage_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Number of layers of each pipeline rank, first to last."""
    if pp == 1:
        for name, value in (("first", first), ("last", last)):
            if value is not None and value != num_layers:
                raise ValueError(f"with one pipeline stage the {name} stage holds all {num_layers} layers, "
                                 f"got {name}={value}")
        return [num_layers]
    fixed = {}
    if first is not None:
        fixed[0] = first
    if last is not None:
        fixed[pp - 1] = last
    rest = num_layers - sum(fixed.values())
    middle = pp - len(fixed)
    if rest < 0:
        raise ValueError(f"first={first} and last={last} pipeline-stage layers exceed num_layers={num_layers}")
    if middle == 0:
        if rest:
            raise ValueError(f"first={first} + last={last} layers != num_layers={num_layers} with pp={pp}")
        return [fixed[0], fixed[pp - 1]]
    if rest % middle:
        if fixed:
            raise ValueError(f"the {rest} layers left after first={first}, last={last} do not divide evenly "
                             f"over the other {middle} pipeline stages")
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline size pp={pp}; "
                         f"give first/last stage layer counts to split unevenly")
    return [fixed.get(r, rest // middle) for r in range(pp)]


def _virtual_counts(num_layers: int, stages: StageMap, first: int | None, last: int | None,
                    stage_layers) -> list[int]:
    """Number of layers of each stage, in stage order: ``stage_layers`` as given, else each rank's count
    (:func:`_stage_counts`) spread evenly over its chunks."""
    if stage_layers is not None:
        if first is not None or last is not None:
            raise ValueError(f"give either per-stage layer counts or first/last stage layer counts, not both "
                             f"(stage_layers={list(stage_layers)}, first={first}, last={last})")
        counts = list(stage_layers)
        for count in counts:
            _check_count("a stage's layer count", count, allow_zero=True)
        if len(counts) != stages.num_stages:
            raise ValueError(f"{len(counts)} per-stage layer counts for {stages.num_stages} stages "
                             f"(pp={stages.pp} x vpp={stages.chunks})")
        if sum(counts) != num_layers:
            raise ValueError(f"the per-stage layer counts {counts} sum to {sum(counts)}, not num_layers={num_layers}")
        return counts
    per_rank = _stage_counts(num_layers, stages.pp, first, last)
    for rank, count in enumerate(per_rank):
        if count % stages.chunks:
            raise ValueError(f"pipeline stage {rank} has {count} layers, not divisible by vpp={stages.chunks} "
                             f"model chunks (num_layers={num_layers}, pp={stages.pp})")
    return [per_rank[stages.rank_of(stage)] // stages.chunks for stage in range(stages.num_stages)]


def split_layers(num_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
                 last: int | None = None, v_shape: bool = False,
                 stage_layers: Sequence[int] | None = None) -> list[list[tuple[int, int]]]:
    """Global layer range ``(start, end)`` of every model chunk: ``result[pp_rank][chunk]``.

    Layers spread evenly over the ``pp`` stages unless ``first``/``last`` fix
    the layer count of the first/last pipeline stage; the other stages then
    share the rest evenly.  With ``vpp`` chunks per rank, each rank's layers
    divide evenly over its chunks.  ``stage_layers`` instead gives the layer count
    of every stage (``pp x vpp`` of them, in stage order, zero allowed), as a
    Megatron ``--pipeline-model-parallel-layout`` does.  ``v_shape`` places the two chunks of each rank
    in a V (see :class:`StageMap`).  Raises ValueError naming the numbers when
    the split is not even.
    """
    _check_count("num_layers", num_layers, allow_zero=False)
    _check_count("pp", pp, allow_zero=False)
    chunks = 1 if vpp is None else vpp
    _check_count("vpp", chunks, allow_zero=False)
    for name, value in (("first", first), ("last", last)):
        if value is not None:
            _check_count(name, value, allow_zero=True)
    stages = StageMap(pp, chunks, v_shape)
    counts = _virtual_counts(num_layers, stages, first, last, stage_layers)
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    start = 0
    for virtual, size in enumerate(counts):
        ranges[stages.rank_of(virtual)].append((start, start + size))
        start += size
    return ranges
