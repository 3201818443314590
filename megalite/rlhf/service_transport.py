"""The interface between the TrainingService driver and its workers, whatever places them.

A transport starts ``procs`` :class:`~megalite.rlhf.service_worker.ServiceWorker` ranks, delivers every call to
each of them in call order, hands back their replies, and says when one died.  The driver (service.py) owns
everything else: call ids, futures, timeouts, error messages.  Implementations: ``service_local.py``
(processes on this machine) and ``service_ray.py`` (Ray actors).
"""

from __future__ import annotations

import abc

Reply = tuple[int, int, bool, object]  # (call id, worker rank, ok, result or error text)


class Transport(abc.ABC):
    #: The address at which every worker reaches this (the driver's) machine, for the rendezvous store.
    host: str

    @abc.abstractmethod
    def send(self, call_id: int, method: str, payload) -> None:
        """Queue the call on every worker; each worker runs its calls in the order they were sent."""

    @abc.abstractmethod
    def receive(self, timeout: float) -> list[Reply]:
        """The replies that arrived, waiting up to ``timeout`` seconds for the first."""

    @abc.abstractmethod
    def casualties(self) -> list[tuple[int, str]]:
        """The workers that are gone, each as ``(rank, "(pid ...) what happened")``."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Kill every worker now (after a failure)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Return once no worker is left (they answered ``shutdown`` or were killed)."""

    @property
    @abc.abstractmethod
    def pids(self) -> list[int]:
        """Each rank's process id."""
