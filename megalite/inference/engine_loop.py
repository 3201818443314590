"""The engine on a background thread, for the HTTP server: requests in through a queue, events out per request.

Handlers (on the asyncio loop) :meth:`EngineLoop.submit` checked requests
and read their events from an asyncio queue; the engine thread steps the
engine and publishes, per request and step, each sample's new token ids,
log-probs, streamable text and finish reason, then the final
:class:`RequestOutput`.  A step's events cross to the asyncio loop in one
hop (one ``call_soon_threadsafe`` per step, not one per request: each hop
wakes the loop through a pipe).  A request that fails alone gets an ``error`` event
and the thread goes on; an exception that escapes the engine ends the thread
(every waiting request gets the error, ``error`` records it, and the server
exits non-zero).  ``max_pending`` bounds the requests submitted and not yet
finished: past it :meth:`submit` raises :class:`Overloaded` (HTTP 429).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from megalite.inference.engine import LLMEngine
from megalite.inference.params import SamplingParams


class Overloaded(RuntimeError):
    """The queue of pending requests is full."""


class Metrics:
    """Running sums behind ``/metrics`` (updated on the engine thread and by handlers)."""

    COUNTERS = ("requests", "requests_finished", "requests_failed", "requests_aborted", "requests_rejected",
                "requests_timed_out", "prompt_tokens", "generation_tokens")

    def __init__(self):
        self.start = time.perf_counter()
        self.ttft_sum = self.ttft_count = 0.0
        self.itl_sum = self.itl_count = 0.0
        self.counts = dict.fromkeys(self.COUNTERS, 0)

    def count(self, name: str, value: int = 1) -> None:
        self.counts[name] += value

    def render(self, loop: EngineLoop) -> str:
        engine = loop.engine
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        cache = engine.prefix_cache
        lines = [
            ("megalite_time_to_first_token_seconds_sum", self.ttft_sum),
            ("megalite_time_to_first_token_seconds_count", self.ttft_count),
            ("megalite_inter_token_latency_seconds_sum", self.itl_sum),
            ("megalite_inter_token_latency_seconds_count", self.itl_count),
            *((f"megalite_{name}_total", value) for name, value in self.counts.items()),
            ("megalite_generation_tokens_per_second", self.counts["generation_tokens"] / elapsed),
            ("megalite_requests_pending", loop.pending),
            ("megalite_queue_depth", len(engine.scheduler.waiting)),
            ("megalite_sequences_running", len(engine.scheduler.running)),
            ("megalite_kv_blocks_used", engine.allocator.num_used()),
            ("megalite_kv_blocks_total", engine.allocator.num_blocks),
            ("megalite_prefix_cache_hit_rate", cache.hit_rate() if cache is not None else 0.0),
        ]
        return "".join(f"{name} {value}\n" for name, value in lines)


class _Stream:
    """Where one request's events go and how much of each sample has been sent."""

    def __init__(self, request_id: str, loop, events, n: int, outbox: dict):
        self.request_id, self.loop, self.events, self.outbox = request_id, loop, events, outbox
        self.tokens, self.chars = [0] * n, [0] * n
        self.last = time.perf_counter()
        self.sent_prompt = False

    def put(self, event: dict) -> None:
        """Queue ``event`` for delivery with the rest of this step's (:meth:`EngineLoop._flush`)."""
        self.outbox.setdefault(self.loop, []).append((self.events, {**event, "request_id": self.request_id}))


def _deliver(items) -> None:
    for events, event in items:
        events.put_nowait(event)


class EngineLoop:
    """Owns the engine on a background thread; handlers submit and abort requests through a queue."""

    def __init__(self, engine: LLMEngine, heartbeat_s: float = 60.0, max_pending: int = 1024):
        self.engine, self.metrics = engine, Metrics()
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, _Stream] = {}
        self.outbox: dict = {}  # asyncio loop -> this step's (queue, event) pairs, delivered by _flush
        self.heartbeat_s, self.max_pending = heartbeat_s, max_pending
        self.pending = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="megalite-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, events=None):
        """Queue a checked request; its events (tagged ``request_id``) arrive on ``events`` (anything with
        ``put_nowait``, called on the submitting asyncio loop; a new asyncio queue by default, returned); raises
        Overloaded when ``max_pending`` requests are in."""
        with self._lock:
            if self.pending >= self.max_pending:
                self.metrics.count("requests_rejected")
                raise Overloaded(f"the server already holds {self.pending} requests (--max-pending-requests)")
            self.pending += 1
        events = asyncio.Queue() if events is None else events
        self.inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), events))
        return events

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def _done(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            with self._lock:
                self.pending -= 1

    def _handle(self, message) -> None:
        engine = self.engine
        if message[0] == "stop":
            self._stopped = True
        elif message[0] == "add":
            _, request_id, prompt, params, loop, events = message
            self.streams[request_id] = _Stream(request_id, loop, events, params.best_of, self.outbox)
            try:
                engine.add_request(prompt, params, request_id)
            except ValueError as error:  # checked by the handler already; a duplicate id, say
                self.streams[request_id].put({"error": str(error), "status": 400})
                self._done(request_id)
                return
            self.metrics.count("requests")
            self.metrics.count("prompt_tokens", len(prompt))
        elif message[0] == "abort":
            if message[1] in engine.requests:
                self.metrics.count("requests_aborted")
            engine.abort(message[1])
            self._done(message[1])

    def _run(self) -> None:
        engine, idle_since = self.engine, time.perf_counter()
        try:
            while not self._stopped:
                block = not engine.has_unfinished()
                try:
                    self._handle(self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait())
                    while True:
                        self._handle(self.inbox.get_nowait())
                except queue.Empty:
                    pass
                if engine.has_unfinished():
                    self._publish(engine.step())
                    idle_since = time.perf_counter()
                elif engine.tp_size > 1 and time.perf_counter() - idle_since > self.heartbeat_s:
                    engine.heartbeat()
                    idle_since = time.perf_counter()
                self._flush()
        except Exception as error:  # report to every waiting client, then stop serving
            logging.getLogger("megalite.inference.engine").exception("the engine failed; the server stops")
            self.error = error
            for stream in self.streams.values():
                stream.put({"error": f"engine failure: {error}", "status": 500})
            self._flush()
        finally:
            if engine.tp_size > 1:
                engine.stop_workers()

    def _flush(self) -> None:
        """Hand the queued events to their asyncio loops: one thread hop per loop."""
        for loop, items in self.outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed: its clients are gone
                pass
        self.outbox.clear()

    def _publish(self, requests) -> None:
        now = time.perf_counter()
        for request in requests:
            stream = self.streams.get(request.request_id)
            if stream is None:
                continue
            if request.error is not None:
                self.metrics.count("requests_failed")
                stream.put({"error": request.error, "status": 500})
                self._done(request.request_id)
                continue
            choices = []
            for seq in request.sequences[:request.params.n]:
                i = seq.index
                new = seq.tokens[len(request.prompt) + stream.tokens[i]:]
                text = seq.detokenizer.stable(seq.finished)[stream.chars[i]:] if seq.detokenizer else None
                if not new and not seq.finished:
                    continue
                if stream.tokens[i] == 0:
                    self.metrics.ttft_sum += now - request.arrival_time
                    self.metrics.ttft_count += 1
                elif new:
                    self.metrics.itl_sum += now - stream.last
                    self.metrics.itl_count += len(new)
                start = stream.tokens[i]
                stream.tokens[i] += len(new)
                stream.chars[i] += len(text or "")
                choices.append({"index": i, "token_ids": new, "text": text, "finish_reason": seq.finish_reason,
                                "logprobs": seq.logprobs[start:] if request.params.logprobs is not None else None,
                                "top_logprobs": seq.top_logprobs[start:] if request.params.logprobs else None})
            self.metrics.count("generation_tokens", sum(len(c["token_ids"]) for c in choices))
            stream.last = now
            done = request.finished
            event = {"choices": choices, "done": done}
            if request.params.prompt_logprobs is not None and not stream.sent_prompt:
                event["prompt_logprobs"] = request.output().prompt_logprobs
                stream.sent_prompt = True
            if done:
                event["output"] = request.output()
                self.metrics.count("requests_finished")
                self._done(request.request_id)
            stream.put(event)
