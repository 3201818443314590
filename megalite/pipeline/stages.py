"""Which pipeline stage each model chunk of each pipeline rank is, and back: the one stage map.

Stages run in global layer order.  Model chunk ``c`` on pipeline rank ``r`` is stage
``c * pp + r`` (Megatron's interleaving; one chunk per rank is plain 1F1B), so a
micro-batch visits every rank once per chunk.  Under the zbv schedule (``v_shape``,
two chunks per rank) chunk 1 on rank ``r`` is stage ``2 * pp - 1 - r`` instead: the
stages go down the ranks and back up, so rank 0 holds both the first and the last
stage.  Layer splits, schedules, timelines and chunk builders all ask this map.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageMap:
    """Stages of ``pp`` pipeline ranks with ``chunks`` model chunks each, in a V when ``v_shape``."""

    pp: int
    chunks: int = 1
    v_shape: bool = False

    def __post_init__(self):
        if self.v_shape and self.chunks != 2:
            raise ValueError(f"a V-shaped layout has 2 model chunks per pipeline rank, got {self.chunks}")

    @classmethod
    def for_schedule(cls, schedule: str | None, pp: int, chunks: int | None = None) -> "StageMap":
        """The map a schedule runs: zbv is the V (two chunks); any other schedule interleaves."""
        v_shape = schedule == "zbv"
        return cls(pp, (2 if v_shape else 1) if chunks is None else chunks, v_shape)

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        """The stage of model chunk ``chunk`` on pipeline rank ``rank``."""
        if self.v_shape and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def place(self, stage: int) -> tuple[int, int]:
        """``(pipeline rank, chunk)`` holding ``stage``."""
        if self.v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage, 1
        return stage % self.pp, stage // self.pp

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return self.place(stage)[0]

    def is_first(self, rank: int, chunk: int) -> bool:
        """Whether the chunk is the first stage (it owns the embedding)."""
        return self.stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        """Whether the chunk is the last stage (it owns the output layer and the loss)."""
        return self.stage(rank, chunk) == self.num_stages - 1

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage: ``pp - 1``, or 0 in the V."""
        return self.rank_of(self.num_stages - 1)


def last_stage_rank(pp: int, schedule: str | None) -> int:
    """The pipeline rank that holds the last stage (and the loss) under ``schedule``."""
    return StageMap.for_schedule(schedule, pp).last_rank
