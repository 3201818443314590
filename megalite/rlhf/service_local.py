"""``backend="local"``: TrainingService workers as spawned processes on this machine, fed through queues.

Each worker arms the parent-death signal (:func:`megalite.training.parent_death.die_with_parent`), so it dies
with the driver however the driver ends (``kill -9`` included): no orphan keeps a rank or ``checkpoint_dir``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys

from megalite.rlhf.service_config import ServiceSpec
from megalite.rlhf.service_transport import Reply, Transport
from megalite.rlhf.service_worker import ServiceWorker
from megalite.training.parent_death import die_with_parent


class LocalTransport(Transport):
    host = "127.0.0.1"

    def __init__(self, spec: ServiceSpec, procs: int):
        ctx = multiprocessing.get_context("spawn")
        self._replies = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(procs)]
        driver = os.getpid()
        self._workers = [ctx.Process(target=_serve, args=(rank, spec, self._inboxes[rank], self._replies, driver),
                                     daemon=True) for rank in range(procs)]
        for worker in self._workers:
            worker.start()

    def send(self, call_id: int, method: str, payload) -> None:
        for inbox in self._inboxes:
            inbox.put((call_id, method, payload))

    def receive(self, timeout: float) -> list[Reply]:
        try:
            replies = [self._replies.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                replies.append(self._replies.get_nowait())
            except queue.Empty:
                return replies

    def casualties(self) -> list[tuple[int, str]]:
        return [(rank, f"(pid {worker.pid}) exited with code {worker.exitcode}")
                for rank, worker in enumerate(self._workers) if not worker.is_alive()]

    def kill(self) -> None:
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()

    def close(self) -> None:
        for worker in self._workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
                worker.join()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]


def _serve(rank: int, spec: ServiceSpec, inbox, replies, driver: int) -> None:
    """A worker process: answer calls in order until ``shutdown``; it dies with ``driver``.

    After answering ``shutdown`` it flushes its reply and its output and exits at once, as a forked process
    does: a spawned one would otherwise tear down every module it imported (torch's included), which takes
    about a second that the driver's ``shutdown`` waits out."""
    die_with_parent(driver)
    worker = ServiceWorker(rank, spec)
    while True:
        call_id, method, payload = inbox.get()
        ok, value = worker.handle(method, payload)
        replies.put((call_id, rank, ok, value))
        if method == "shutdown":
            replies.close()
            replies.join_thread()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
