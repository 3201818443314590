"""``backend="ray"``: TrainingService workers as Ray actors, on this machine or across a Ray cluster.

Each worker is a single-threaded actor (one CPU, or one GPU with ``with_gpus``), so it runs its calls in the
order the driver sent them.  The driver uses the Ray connection this process already has; without one it
connects to the cluster ``RAY_ADDRESS`` names or else starts a local cluster, and when the last service on
that connection closes it disconnects again (stopping a cluster it started).  A cluster it started also dies with
the driver, ``kill -9`` included (:mod:`megalite.rlhf.service_ray_reaper`); a cluster it found is left alone.  An
actor that dies makes its calls' results raise ``RayActorError``; that is how a dead worker is noticed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import ClassVar

import ray
from ray.exceptions import RayActorError, RayError

from megalite.rlhf.service_config import ServiceSpec
from megalite.rlhf.service_ray_reaper import Reaper, children
from megalite.rlhf.service_transport import Reply, Transport
from megalite.rlhf.service_worker import ServiceWorker

CLOSE_SECONDS = 60.0  # how long close() waits for the actors to be gone


class _Actor:
    """The Ray actor around one :class:`ServiceWorker`."""

    def __init__(self, rank: int, spec: ServiceSpec):
        self.worker = ServiceWorker(rank, spec)

    def place(self) -> tuple[str, str, int]:
        """This actor's Ray node id, actor id and process id."""
        context = ray.get_runtime_context()
        return context.get_node_id(), context.get_actor_id(), os.getpid()

    def call(self, call_id: int, method: str, payload) -> Reply:
        ok, value = self.worker.handle(method, payload)
        return call_id, self.worker.rank, ok, value


class RayTransport(Transport):
    # The open transports on the Ray connection that one of them made: it is process-wide, like Ray's own
    # state, so that the last of them to close disconnects (an actor and a critic service may share it).
    _riders: ClassVar[set[int]] = set()
    _reaper: ClassVar[Reaper | None] = None  # the watcher of the local cluster they started, if they did

    def __init__(self, spec: ServiceSpec, procs: int):
        self._owns_ray = not ray.is_initialized() or bool(RayTransport._riders)
        if not ray.is_initialized() and "RAY_ADDRESS" in os.environ:  # e.g. a script run by `ray job submit`
            ray.init()
        elif not ray.is_initialized():
            before = children(os.getpid())
            ray.init(address="local", num_cpus=max(procs, os.cpu_count() or 1), include_dashboard=False)
            RayTransport._reaper = Reaper({pid: start for pid, start in children(os.getpid()).items()
                                           if before.get(pid) != start})
        if self._owns_ray:
            RayTransport._riders.add(id(self))
        try:
            self._check_resources(spec, procs)
        except ValueError:
            self._stop_ray()
            raise
        self.host = ray.util.get_node_ip_address()
        threads = os.environ.get("OMP_NUM_THREADS", "1")  # torchrun's default, unless the driver sets one
        actor = ray.remote(_Actor).options(num_cpus=1, num_gpus=1 if spec.with_gpus else 0, max_restarts=0,
                                           runtime_env={"env_vars": {"OMP_NUM_THREADS": threads}})
        self._actors = [actor.remote(rank, spec) for rank in range(procs)]
        self._places = [a.place.remote() for a in self._actors]
        self._calls: dict[ray.ObjectRef, tuple[int, int]] = {}  # result -> (call id, rank)
        self._dead: dict[int, str] = {}
        self._lock = threading.Lock()
        self._sent = threading.Event()  # wakes receive() when it had nothing to wait for

    @staticmethod
    def _check_resources(spec: ServiceSpec, procs: int) -> None:
        resources = ray.cluster_resources()
        for name, need in (("CPU", procs), ("GPU", procs if spec.with_gpus else 0)):
            if resources.get(name, 0) < need:
                raise ValueError(f"backend='ray' needs {need} {name}s (one per worker), the Ray cluster has "
                                 f"{resources.get(name, 0):g}")

    def send(self, call_id: int, method: str, payload) -> None:
        argument = ray.put(payload)  # serialized once, read by every worker
        with self._lock:
            for rank, actor in enumerate(self._actors):
                self._calls[actor.call.remote(call_id, method, argument)] = (call_id, rank)
        self._sent.set()

    def receive(self, timeout: float) -> list[Reply]:
        with self._lock:
            waiting = list(self._calls)
        if not waiting:
            self._sent.wait(timeout)
            self._sent.clear()
            return []
        done, _ = ray.wait(waiting, num_returns=1, timeout=timeout)
        if done:
            done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        replies = []
        for ref in done:
            with self._lock:
                call_id, rank = self._calls.pop(ref)
            try:
                replies.append(ray.get(ref))
            except RayActorError as error:
                self._dead.setdefault(rank, f"{self._where(rank)} died: {_reason(error)}")
            except RayError as error:  # the call itself failed in Ray (e.g. its payload did not arrive)
                replies.append((call_id, rank, False, _reason(error)))
        return replies

    def casualties(self) -> list[tuple[int, str]]:
        return sorted(self._dead.items())

    def kill(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    def close(self) -> None:
        """Kill the actors (they have answered ``shutdown``, or failed); return once they are gone.

        Gone means Ray reports the actor dead and, for an actor on the driver's node, its process was reaped.
        """
        self.kill()
        here = ray.get_runtime_context().get_node_id()
        deadline = time.monotonic() + CLOSE_SECONDS
        for actor, place in zip(self._actors, self._places):
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.place.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    break
                time.sleep(0.1)  # the kill has not reached the actor yet
            node, _, pid = self._known(place) or (None, None, None)
            while node == here and _running(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._stop_ray()

    def _stop_ray(self) -> None:
        RayTransport._riders.discard(id(self))
        if self._owns_ray and not RayTransport._riders:
            ray.shutdown()
            if RayTransport._reaper is not None:
                RayTransport._reaper.release()
                RayTransport._reaper = None

    @property
    def pids(self) -> list[int]:
        return [pid for _, _, pid in ray.get(self._places)]

    @staticmethod
    def _known(place: ray.ObjectRef) -> tuple[str, str, int] | None:
        """An actor's ``(node, actor id, pid)`` if it reported them (it may have died first)."""
        ready, _ = ray.wait([place], timeout=0)
        try:
            return ray.get(ready[0]) if ready else None
        except RayError:
            return None

    def _where(self, rank: int) -> str:
        _, actor, pid = self._known(self._places[rank]) or (None, "unknown", "unknown")
        return f"(pid {pid}, Ray actor {actor})"


def _reason(error: RayError) -> str:
    """The first line of Ray's explanation."""
    return str(error).strip().splitlines()[0]


def _running(pid: int) -> bool:
    """Whether process ``pid`` is still in this machine's process table (a zombie counts until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
