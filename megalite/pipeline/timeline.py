"""Per-rank timeline of a pipeline schedule, for Gantt charts and bubble measurement."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

from megalite.pipeline.stages import StageMap
from megalite.pipeline.zero_bubble import simulate, zbv_order


class PipelineRecorder:
    """Logs each forward ('F'), backward ('B') and deferred weight-gradient pass ('W') with its
    micro-batch, chunk and wall-clock span.

    ``events`` holds ``(kind, microbatch, chunk, t_start, t_end)`` tuples in
    execution order; ``iterations`` the index in ``events`` where each call of
    the schedule began; ``stage`` is the pipeline rank and ``schedule`` the
    schedule's name (both set by the schedule).  Times come from ``time.time()``
    so timelines of ranks on one host align.
    """

    def __init__(self, stage: int | None = None, events=None, iterations=None, schedule: str | None = None):
        self.stage = stage
        self.schedule = schedule
        self.events: list[tuple[str, int, int, float, float]] = list(events or [])
        self.iterations: list[int] = list(iterations if iterations is not None else [0] if self.events else [])

    def start_iteration(self) -> None:
        """Mark where the next schedule call's events begin."""
        self.iterations.append(len(self.events))

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

    def iteration(self, index: int) -> "PipelineRecorder":
        """A recorder holding only the events of iteration ``index`` (0-based; negative counts from the end)."""
        count = len(self.iterations)
        if not -count <= index < count:
            raise ValueError(f"iteration {index} is out of range: rank {self.stage} recorded {count} iterations")
        index %= count
        end = self.iterations[index + 1] if index + 1 < count else len(self.events)
        return PipelineRecorder(self.stage, self.events[self.iterations[index]:end], [0], self.schedule)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"stage": self.stage, "schedule": self.schedule, "iterations": self.iterations,
                       "events": [list(e) for e in self.events]}, f)

    @classmethod
    def load(cls, path) -> "PipelineRecorder":
        with open(path) as f:
            data = json.load(f)
        return cls(data["stage"], [tuple(e) for e in data["events"]], data.get("iterations"), data.get("schedule"))


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


def analytic_bubble(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    """The bubble fraction a schedule reaches when a stage's F, B and W take equal times.

    1F1B ``(p-1)/(m+p-1)``; interleaved ``(p-1)/(vpp*m+p-1)``; ZB-H1 ``(p-1)/(3m+p-1)``;
    ZBV has no closed form here: its op lists are replayed with equal op costs.
    """
    if schedule == "1f1b":
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (vpp * m + pp - 1)
    if schedule == "zero-bubble-h1":
        return (pp - 1) / (3 * m + pp - 1)
    if schedule == "zbv":
        orders = [zbv_order(pp, rank, m) for rank in range(pp)]
        return simulate(orders, StageMap(pp, 2, v_shape=True).stage, {"F": 1.0, "B": 1.0, "W": 1.0})
    raise ValueError(f"unknown pipeline schedule {schedule!r}")
