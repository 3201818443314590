"""A critic, reward or teacher model held by one rank and served to all the others.

Only the owner rank builds the model.  A request gathers every rank's inputs
to the owner (object collectives on a dedicated gloo group, so the CPU-side
traffic never interleaves with training collectives), the owner runs the
model once on all of them, and each rank receives its own results.  Requests
run on one background thread per rank, in the order they were issued, so a
rank can issue the next batch's request and train on the current one while
the owner computes (see :class:`Prefetcher`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import torch.distributed as dist

from megalite import topology


class CentralizedModel:
    """Serve ``model_fn`` from global rank ``owner`` to every rank of the default group.

    ``model_fn(per_rank_inputs: list) -> list`` takes the inputs of every rank
    (in rank order) and returns one result per rank; it is only needed, and
    only called, on the owner.  Inputs and results must pickle (CPU tensors).
    Construction is collective (it creates the dedicated group).
    """

    def __init__(self, model_fn: Callable[[list], list] | None, owner: int = 0):
        world = dist.get_world_size()
        if not 0 <= owner < world:
            raise ValueError(f"centralized model owner rank {owner} is outside the world of {world} ranks")
        self.owner = owner
        self.rank = dist.get_rank()
        if self.rank == owner and model_fn is None:
            raise ValueError(f"rank {owner} owns the centralized model but got model_fn=None")
        self.model_fn = model_fn if self.rank == owner else None
        self.group = dist.new_group(backend="gloo")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="centralized-model")
        self.intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def submit(self, inputs) -> Future:
        """Issue a request with this rank's ``inputs``; the future's result is this rank's output."""
        return self._worker.submit(self._round_trip, inputs)

    def __call__(self, inputs):
        """Blocking request."""
        return self.submit(inputs).result()

    def _round_trip(self, inputs):
        size = topology.group_size(self.group)
        gathered = [None] * size if self.rank == self.owner else None
        dist.gather_object(inputs, gathered, dst=self.owner, group=self.group)
        outputs = None
        if self.rank == self.owner:
            start = time.monotonic()
            outputs = list(self.model_fn(gathered))
            with self._lock:
                self.intervals.append((start, time.monotonic()))
            if len(outputs) != size:
                outputs = [ValueError(f"centralized model_fn returned {len(outputs)} results for {size} ranks")] * size
        mine = [None]
        dist.scatter_object_list(mine, outputs, src=self.owner, group=self.group)
        if isinstance(mine[0], ValueError):
            raise mine[0]
        return mine[0]

    def close(self) -> None:
        """Wait for outstanding requests and stop the worker thread."""
        self._worker.shutdown(wait=True)


class Prefetcher:
    """Iterate ``(batch, result)`` with up to ``depth`` later batches' requests already in flight.

    ``depth=1`` is double buffering: before batch ``i`` is handed out, batch
    ``i+1`` has been drawn from ``batches`` and its request issued, so the
    centralized model works on it while the caller trains on batch ``i``.
    ``depth=0`` waits for each request right after issuing it.
    ``inputs_of(batch)`` picks what is sent (default: the batch itself).
    """

    def __init__(self, model: CentralizedModel, batches: Iterable, depth: int = 1,
                 inputs_of: Callable | None = None):
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be a non-negative integer, got {depth!r}")
        self.model, self.batches, self.depth = model, iter(batches), depth
        self.inputs_of = inputs_of or (lambda batch: batch)

    def __iter__(self) -> Iterator:
        pending: deque = deque()
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.depth + 1:
                try:
                    batch = next(self.batches)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((batch, self.model.submit(self.inputs_of(batch))))
            if not pending:
                return
            batch, future = pending.popleft()
            yield batch, future.result()
