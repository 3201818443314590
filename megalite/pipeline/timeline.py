"""Per-rank timeline of a pipeline schedule, for Gantt charts and bubble measurement."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager


class PipelineRecorder:
    """Logs each forward ('F') and backward ('B') with its micro-batch, chunk and wall-clock span.

    ``events`` holds ``(kind, microbatch, chunk, t_start, t_end)`` tuples in
    execution order; ``stage`` is the pipeline rank (set by the schedule).
    Times come from ``time.time()`` so timelines of ranks on one host align.
    """

    def __init__(self, stage: int | None = None, events=None):
        self.stage = stage
        self.events: list[tuple[str, int, int, float, float]] = list(events or [])

    @contextmanager
    def record(self, kind: str, microbatch: int, chunk: int):
        start = time.time()
        try:
            yield
        finally:
            self.events.append((kind, microbatch, chunk, start, time.time()))

    def order(self) -> list[tuple[str, int, int]]:
        """The ops in execution order, without times."""
        return [(kind, mb, chunk) for kind, mb, chunk, _, _ in self.events]

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"stage": self.stage, "events": [list(e) for e in self.events]}, f)

    @classmethod
    def load(cls, path) -> "PipelineRecorder":
        with open(path) as f:
            data = json.load(f)
        return cls(data["stage"], [tuple(e) for e in data["events"]])


def bubble_fraction(recorders) -> float:
    """Mean idle share of the stages over the whole run's span (first start to last end)."""
    spans = [(s, e) for r in recorders for _, _, _, s, e in r.events]
    if not spans:
        raise ValueError("no events recorded")
    begin = min(s for s, _ in spans)
    total = max(e for _, e in spans) - begin
    if total <= 0:
        raise ValueError(f"recorded span is {total} s; nothing to measure")
    idle = [1.0 - sum(e - s for _, _, _, s, e in r.events) / total for r in recorders]
    return sum(idle) / len(idle)
