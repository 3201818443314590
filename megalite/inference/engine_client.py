"""The server's side of the engine (:class:`EngineClient`): submit checked requests, abort them, and route each
engine batch's events to the handlers waiting for them; and :class:`EngineThread`, the engine loop on a thread
of this process.

Handlers (on the asyncio loop) call :meth:`EngineClient.submit` and read their
events from what they passed (anything with ``put_nowait``; an asyncio queue by
default).  The engine's batches (:class:`megalite.inference.engine_loop.EngineLoop`,
one per step) arrive on some other thread through :meth:`EngineClient.from_engine`
and cross to the asyncio loop in one hop (one ``call_soon_threadsafe`` per batch:
each hop wakes the loop through a pipe).  ``max_pending`` bounds the requests
submitted and not yet finished: past it :meth:`submit` raises :class:`Overloaded`
(HTTP 429).  Where the engine runs is the subclass's business: on a thread here
(:class:`EngineThread`: tests, or an application serving a live model it holds) or
in its own process (:class:`megalite.inference.engine_process.EngineProcess`: what
``serve`` runs, so the HTTP loop and the engine do not share a GIL).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from megalite.inference.engine import LLMEngine
from megalite.inference.engine_loop import EngineLoop
from megalite.inference.params import SamplingParams
from megalite.inference.request_check import RequestChecker


class Overloaded(RuntimeError):
    """The queue of pending requests is full."""


class Metrics:
    """``/metrics``: the engine's values (its latest batch's ``stats``) and the counters and latencies kept here.

    Latencies (``megalite_<name>_seconds_sum`` and ``_count``; the engine side keeps the others, see
    :mod:`megalite.inference.engine_loop`) time the HTTP process's part of a request's way to its first token:
    ``request_submit``, from the HTTP request's arrival to its submission to the engine (body, parse, tokenize,
    checks); ``batch_delivery``, from the engine sending a batch to this process routing it on the asyncio loop
    (pipe, reader thread, loop wake-up)."""

    COUNTERS = ("requests_rejected", "requests_timed_out")
    LATENCIES = ("request_submit", "batch_delivery")

    def __init__(self):
        self.start = time.perf_counter()
        self.counts = dict.fromkeys(self.COUNTERS, 0)
        self.latencies = {name: [0.0, 0] for name in self.LATENCIES}
        self.engine: dict = {}

    def count(self, name: str, value: int = 1) -> None:
        self.counts[name] += value

    def observe(self, name: str, seconds: float) -> None:
        total = self.latencies[name]
        total[0] += seconds
        total[1] += 1

    def render(self, pending: int) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        values = {**self.engine, **{f"megalite_{name}_total": value for name, value in self.counts.items()},
                  "megalite_generation_tokens_per_second":
                      self.engine.get("megalite_generation_tokens_total", 0) / elapsed,
                  "megalite_requests_pending": pending,
                  **{f"megalite_{name}_seconds_{part}": total[i] for name, total in self.latencies.items()
                     for i, part in enumerate(("sum", "count"))}}
        return "".join(f"{name} {value}\n" for name, value in values.items())


class EngineClient:
    """Submits requests to an engine loop through ``post(message)`` and routes its batches' events back.

    ``checker`` (a :class:`RequestChecker`) is what handlers check bodies and compile grammars with."""

    def __init__(self, checker: RequestChecker, post, max_pending: int = 1024):
        self.checker, self._post, self.max_pending = checker, post, max_pending
        self.metrics = Metrics()
        self.routes: dict = {}  # request id -> where its events go, until its last event
        self.error: str | None = None
        self._aio: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        return len(self.routes)

    @property
    def alive(self) -> bool:
        return self.error is None

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, events=None,
               arrived: float | None = None):
        """Queue a checked request; its events (tagged ``request_id``) arrive on ``events`` (a new asyncio queue
        by default, returned) on this asyncio loop; raises Overloaded when ``max_pending`` requests are in.
        ``arrived``: when its HTTP request arrived (``time.perf_counter()``), for ``request_submit``."""
        if len(self.routes) >= self.max_pending:
            self.metrics.count("requests_rejected")
            raise Overloaded(f"the server already holds {len(self.routes)} requests (--max-pending-requests)")
        self._aio = asyncio.get_running_loop()
        events = asyncio.Queue() if events is None else events
        self.routes[request_id] = events
        now = time.perf_counter()  # CLOCK_MONOTONIC on Linux: the engine process reads the same clock
        if arrived is not None:
            self.metrics.observe("request_submit", now - arrived)
        self._post(("add", request_id, prompt, params, now))
        return events

    def abort(self, request_id: str) -> None:
        if self.routes.pop(request_id, None) is not None:
            self._post(("abort", request_id))

    def from_engine(self, batch: dict) -> None:
        """Hand an engine batch to the asyncio loop (callable from any thread): one hop per batch."""
        aio = self._aio
        if aio is None:  # nothing submitted yet, so no one to route to: keep the stats
            self.deliver(batch)
            return
        try:
            aio.call_soon_threadsafe(self.deliver, batch)
        except RuntimeError:  # that loop has closed: its clients are gone
            pass

    def deliver(self, batch: dict) -> None:
        """Route a batch's events to their requests (on the asyncio loop)."""
        self.metrics.engine = batch["stats"]
        if batch["events"]:
            self.metrics.observe("batch_delivery", time.perf_counter() - batch["sent"])
        routes = self.routes
        for event in batch["events"]:
            rid = event["request_id"]
            events = routes.get(rid)
            if events is None:  # aborted meanwhile
                continue
            if "error" in event or event["done"]:
                del routes[rid]
            events.put_nowait(event)
        if "failed" in batch:
            self.fail(batch["failed"])

    def fail(self, message: str) -> None:
        """The engine is gone: every waiting request gets ``message`` as its 500, and ``alive`` turns false."""
        self.error = message
        for rid, events in list(self.routes.items()):
            events.put_nowait({"request_id": rid, "error": f"engine failure: {message}", "status": 500})
        self.routes.clear()


class EngineThread(EngineClient):
    """An :class:`EngineLoop` over ``engine`` on a daemon thread of this process (``start``, ``stop``)."""

    def __init__(self, engine: LLMEngine, heartbeat_s: float = 60.0, max_pending: int = 1024):
        inbox: queue.Queue = queue.Queue()
        super().__init__(engine.checker, inbox.put, max_pending)
        self.engine = engine

        def receive(timeout: float):
            try:
                return inbox.get(timeout=timeout) if timeout else inbox.get_nowait()
            except queue.Empty:
                return None

        self.core = EngineLoop(engine, receive, self.from_engine, heartbeat_s)
        self.thread = threading.Thread(target=self.core.run, name="megalite-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._post(("stop",))
        self.thread.join()
