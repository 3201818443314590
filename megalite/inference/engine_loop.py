"""The server's engine side (:class:`EngineLoop`): take requests and aborts, step the engine, and hand back
one batch per step.

It runs wherever the engine is: on a thread beside the HTTP server
(:class:`megalite.inference.engine_client.EngineThread`) or as the main loop of
the engine process (:mod:`megalite.inference.engine_process`, what ``serve``
runs), and knows neither: messages arrive through ``receive(timeout)`` (an
``("add", request_id, prompt, params, submitted)``, ``submitted`` being the
client's ``time.perf_counter()``; ``("abort", request_id)`` or ``("stop",)``;
``None`` when none came within ``timeout``) and each step's batch leaves
through ``send(batch)``.  A batch is plain data: ``{"events": [...], "stats":
{...}, "sent": seconds}``, where each event tags its ``request_id`` and
carries, per sample, the new token ids, log-probs, streamable text and finish
reason (and the final :class:`RequestOutput` once ``done``), ``stats`` are the
engine's ``/metrics`` values and ``sent`` is when the batch left
(``time.perf_counter()``: CLOCK_MONOTONIC on Linux, one clock for both
processes).  Batching per step, not per request, is what makes the hop cheap
(one thread wake-up or one pipe write per step).  A request that fails alone
gets an ``error`` event and the loop goes on; an exception that escapes the
engine ends the loop with a last batch whose ``failed`` names it (the client
fails every waiting request with it, and the server exits non-zero).

Besides time to first token and inter-token latency, ``stats`` time the
engine's part of a request's way to its first token (sums and counts,
``megalite_<name>_seconds_sum``/``_count``): ``request_admission``, from the
client's submission to this loop taking the request (the pipe, and a step in
progress); ``request_queue``, from then to the start of the step that made its
first token; and ``engine_loop_seconds_sum``, the wall time of busy iterations
outside ``engine.step`` (taking messages, publishing, sending, and being off
the core meanwhile).
"""

from __future__ import annotations

import logging
import time

from megalite.inference.engine import LLMEngine

ENGINE_COUNTERS = ("requests", "requests_finished", "requests_failed", "requests_aborted", "prompt_tokens",
                   "generation_tokens")
"""The ``/metrics`` counters the engine side keeps (``megalite_<name>_total``)."""


class _Stream:
    """How much of each of one request's samples has been sent."""

    def __init__(self, n: int):
        self.tokens, self.chars = [0] * n, [0] * n
        self.last = time.perf_counter()
        self.sent_prompt = False


class EngineLoop:
    """Steps ``engine``, fed by ``receive(timeout)``, reporting through ``send(batch)`` (module docstring)."""

    def __init__(self, engine: LLMEngine, receive, send, heartbeat_s: float = 60.0):
        self.engine, self.receive, self.send, self.heartbeat_s = engine, receive, send, heartbeat_s
        self.streams: dict[str, _Stream] = {}
        self.events: list[dict] = []  # this step's, sent by _flush
        self.counts = dict.fromkeys(ENGINE_COUNTERS, 0)
        self.ttft = [0.0, 0]  # sum of seconds, count
        self.itl = [0.0, 0]
        self.step_s = [0.0, 0.0]  # wall and CPU seconds in engine.step: wall above CPU is time not on a core
        self.admission, self.queue = [0.0, 0], [0.0, 0]  # sum of seconds, count
        self.loop_s = 0.0  # wall seconds of busy iterations outside engine.step
        self.step_started = 0.0
        self._stopped = False

    def _put(self, request_id: str, event: dict) -> None:
        self.events.append({**event, "request_id": request_id})

    def handle(self, message) -> None:
        """Act on one message from the client."""
        engine = self.engine
        if message[0] == "stop":
            self._stopped = True
        elif message[0] == "add":
            _, request_id, prompt, params, submitted = message
            self.admission[0] += time.perf_counter() - submitted
            self.admission[1] += 1
            try:
                engine.add_request(prompt, params, request_id)
            except ValueError as error:  # checked by the handler already; a duplicate id, say
                self._put(request_id, {"error": str(error), "status": 400})
                return
            self.streams[request_id] = _Stream(params.best_of)
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(prompt)
        elif message[0] == "abort":
            if message[1] in engine.requests:
                self.counts["requests_aborted"] += 1
            engine.abort(message[1])
            self.streams.pop(message[1], None)

    def run(self) -> BaseException | None:
        """Serve until a ``stop`` message; returns the exception that stopped the engine, if one did."""
        engine, idle_since = self.engine, time.perf_counter()
        self._flush()  # the first stats: the client knows the engine is up
        try:
            while not self._stopped:
                message = self.receive(0 if engine.has_unfinished() else 1.0)
                busy, iteration = message is not None, time.perf_counter()
                while message is not None:
                    self.handle(message)
                    message = None if self._stopped else self.receive(0)
                if engine.has_unfinished() and not self._stopped:
                    started, cpu = time.perf_counter(), time.thread_time()
                    self.step_started = started
                    requests = engine.step()
                    idle_since, busy = time.perf_counter(), True
                    self.step_s[0] += idle_since - started
                    self.loop_s -= idle_since - started
                    self.step_s[1] += time.thread_time() - cpu
                    self.publish(requests)
                elif engine.tp_size > 1 and time.perf_counter() - idle_since > self.heartbeat_s:
                    engine.heartbeat()
                    idle_since = time.perf_counter()
                if busy:
                    self._flush()
                    self.loop_s += time.perf_counter() - iteration
            return None
        except Exception as error:  # report it to the client, then stop serving
            logging.getLogger("megalite.inference.engine").exception("the engine failed; the server stops")
            self.events.clear()
            self._flush(failed=str(error))
            return error
        finally:
            if engine.tp_size > 1:
                engine.stop_workers()

    def stats(self) -> dict:
        """The engine's ``/metrics`` values, by metric name."""
        engine = self.engine
        cache = engine.prefix_cache
        return {"megalite_time_to_first_token_seconds_sum": self.ttft[0],
                "megalite_time_to_first_token_seconds_count": self.ttft[1],
                "megalite_inter_token_latency_seconds_sum": self.itl[0],
                "megalite_inter_token_latency_seconds_count": self.itl[1],
                "megalite_engine_steps_total": engine.stats["steps"],
                "megalite_engine_step_seconds_sum": self.step_s[0],
                "megalite_engine_step_cpu_seconds_sum": self.step_s[1],
                "megalite_engine_loop_seconds_sum": self.loop_s,
                "megalite_request_admission_seconds_sum": self.admission[0],
                "megalite_request_admission_seconds_count": self.admission[1],
                "megalite_request_queue_seconds_sum": self.queue[0],
                "megalite_request_queue_seconds_count": self.queue[1],
                **{f"megalite_{name}_total": value for name, value in self.counts.items()},
                "megalite_queue_depth": len(engine.scheduler.waiting),
                "megalite_sequences_running": len(engine.scheduler.running),
                "megalite_kv_blocks_used": engine.allocator.num_used(),
                "megalite_kv_blocks_total": engine.allocator.num_blocks,
                "megalite_prefix_cache_hit_rate": cache.hit_rate() if cache is not None else 0.0}

    def _flush(self, failed: str | None = None) -> None:
        """Send this step's events and the engine's stats as one batch."""
        batch = {"events": self.events, "stats": self.stats(), "sent": time.perf_counter()}
        if failed is not None:
            batch["failed"] = failed
        self.events = []
        self.send(batch)

    def publish(self, requests) -> None:
        """Queue the events of the requests one step touched (sent by the next flush)."""
        now = time.perf_counter()
        for request in requests:
            stream = self.streams.get(request.request_id)
            if stream is None:
                continue
            if request.error is not None:
                self.counts["requests_failed"] += 1
                self._put(request.request_id, {"error": request.error, "status": 500})
                del self.streams[request.request_id]
                continue
            choices = []
            for seq in request.sequences[:request.params.n]:
                i = seq.index
                new = seq.tokens[len(request.prompt) + stream.tokens[i]:]
                text = seq.detokenizer.stable(seq.finished)[stream.chars[i]:] if seq.detokenizer else None
                if not new and not seq.finished:
                    continue
                if stream.tokens[i] == 0:
                    self.ttft[0] += now - request.arrival_time
                    self.ttft[1] += 1
                    if i == 0:
                        self.queue[0] += max(self.step_started - request.arrival_time, 0.0)
                        self.queue[1] += 1
                elif new:
                    self.itl[0] += now - stream.last
                    self.itl[1] += len(new)
                start = stream.tokens[i]
                stream.tokens[i] += len(new)
                stream.chars[i] += len(text or "")
                choices.append({"index": i, "token_ids": new, "text": text, "finish_reason": seq.finish_reason,
                                "logprobs": seq.logprobs[start:] if request.params.logprobs is not None else None,
                                "top_logprobs": seq.top_logprobs[start:] if request.params.logprobs else None})
            self.counts["generation_tokens"] += sum(len(c["token_ids"]) for c in choices)
            stream.last = now
            event = {"choices": choices, "done": request.finished}
            if request.params.prompt_logprobs is not None and not stream.sent_prompt:
                event["prompt_logprobs"] = request.output().prompt_logprobs
                stream.sent_prompt = True
            if request.finished:
                event["output"] = request.output()
                self.counts["requests_finished"] += 1
                del self.streams[request.request_id]
            self._put(request.request_id, event)
