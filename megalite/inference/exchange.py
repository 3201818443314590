"""One HTTP request's engine requests (:class:`Exchange`): submit them to the :class:`EngineClient`, take their
events as they come (watching the request's deadline and its client), abort what is left; and the HTTP
failure (:class:`HTTPFailure`) a handler answers with instead of 200."""

from __future__ import annotations

import asyncio
import collections
import time

from megalite.inference.engine_client import EngineClient, Overloaded


class HTTPFailure(Exception):
    """A reply other than 200: status, message and extra headers."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


WATCH_S = 0.5
"""How often waiting handlers wake to check their deadline and whether their client is still there."""


class Exchange:
    """One HTTP request's engine requests: submit, wait for events (``timeout_s`` from now, disconnect), abort
    what is left.

    The engine client delivers events through :meth:`put_nowait` (on the asyncio loop); a waiting :meth:`take`
    sleeps on one future that an event wakes, or the app's watchdog (every ``WATCH_S``, for every exchange in
    ``live``) so it checks its deadline and connection: no task and timer per streamed token, as
    ``asyncio.wait_for`` would cost.
    """

    def __init__(self, loop: EngineClient, request, timeout_s: float, request_id: str, live: set | None = None,
                 arrived: float | None = None):
        self.loop, self.request, self.timeout_s, self.id = loop, request, timeout_s, request_id
        self.arrived = arrived  # when the HTTP request arrived (perf_counter), for the client's request_submit
        self.deadline = time.perf_counter() + timeout_s
        self.inbox: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.open: set[str] = set()
        self.prompt_tokens = self.completion_tokens = 0
        self.live = live if live is not None else set()
        self.live.add(self)

    def put_nowait(self, event: dict) -> None:
        self.inbox.append(event)
        self.wake()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def submit(self, prompts, params) -> list[str]:
        if not self.loop.alive:
            raise HTTPFailure(503, f"the engine has stopped: {self.loop.error}")
        ids = []
        for i, prompt in enumerate(prompts):
            engine_id = f"{self.id}-{i}"
            try:
                self.loop.submit(engine_id, prompt, params, self, self.arrived)
            except Overloaded as error:
                raise HTTPFailure(429, str(error), {"Retry-After": "1"}) from None
            self.open.add(engine_id)
            ids.append(engine_id)
            self.prompt_tokens += len(prompt)
        return ids

    async def take(self) -> list[dict]:
        """Every event waiting for this exchange's requests, oldest first (waiting for one if none is);
        HTTPFailure on an error, timeout or disconnect."""
        while True:
            if time.perf_counter() >= self.deadline:
                self.loop.metrics.count("requests_timed_out")
                raise HTTPFailure(504, f"the request did not finish within {self.timeout_s:g} s")
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client went away")
            if not self.inbox:
                self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
                continue
            events = list(self.inbox)
            self.inbox.clear()
            for event in events:
                if "error" in event:
                    self.open.discard(event["request_id"])
                    raise HTTPFailure(event.get("status", 500), event["error"])
                if event["done"]:
                    self.open.discard(event["request_id"])
                self.completion_tokens += sum(len(c["token_ids"]) for c in event["choices"])
            return events

    def close(self) -> None:
        """Abort every request still running (the client left, timed out, or another prompt failed)."""
        for engine_id in self.open:
            self.loop.abort(engine_id)
        self.open.clear()
        self.live.discard(self)
