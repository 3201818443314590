"""An OpenAI-compatible completions server over the engine (aiohttp; ``pip install megalite[serve]``).

    python -m megalite.inference.serve --load CKPT                       # one process
    torchrun --nproc_per_node 2 -m megalite.inference.serve --load CKPT --tensor-model-parallel-size 2

``POST /v1/completions`` takes ``prompt`` (token ids, or a string with a
tokenizer), ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``n``,
``seed``, ``stop_token_ids``, ``logprobs`` and ``stream`` (server-sent events,
one event per step's new tokens, then ``data: [DONE]``).  ``GET /metrics``
reports, in Prometheus text format, time to first token, inter-token latency,
generated tokens per second, KV blocks in use and the prefix-cache hit rate.

Safe by default: it binds 127.0.0.1 unless ``--host`` says otherwise; bodies
over ``--max-body-bytes`` get 413 and ``max_tokens`` over ``--max-tokens-limit``
a 400, as do malformed JSON and bad parameters (checked before the engine
sees them).  A client that disconnects has its request aborted, which frees
its KV blocks.  The engine runs on its own thread (TP rank 0 also broadcasts
step plans from there); HTTP handlers only exchange messages with it.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

from megalite.cli import run_cli
from megalite.flags import SHARED_FLAGS, ArgumentParser, Flag, FlagTable
from megalite.inference.config import EngineConfig
from megalite.inference.engine import LLMEngine
from megalite.inference.params import SamplingParams

_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop_token_ids", "logprobs",
           "stream", "model", "user"}


class BadRequest(ValueError):
    """A request the server answers with 400."""


class Metrics:
    """Running sums behind ``/metrics`` (updated on the engine thread, read by handlers)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.ttft_sum = self.ttft_count = 0.0
        self.itl_sum = self.itl_count = 0.0
        self.tokens = 0
        self.requests = 0
        self.aborted = 0

    def render(self, engine: LLMEngine) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        cache = engine.prefix_cache
        lines = [
            ("megalite_time_to_first_token_seconds_sum", self.ttft_sum),
            ("megalite_time_to_first_token_seconds_count", self.ttft_count),
            ("megalite_inter_token_latency_seconds_sum", self.itl_sum),
            ("megalite_inter_token_latency_seconds_count", self.itl_count),
            ("megalite_generation_tokens_total", self.tokens),
            ("megalite_generation_tokens_per_second", self.tokens / elapsed),
            ("megalite_requests_total", self.requests),
            ("megalite_requests_aborted_total", self.aborted),
            ("megalite_kv_blocks_used", engine.allocator.num_used()),
            ("megalite_kv_blocks_total", engine.allocator.num_blocks),
            ("megalite_prefix_cache_hit_rate", cache.hit_rate() if cache is not None else 0.0),
        ]
        return "".join(f"{name} {value}\n" for name, value in lines)


class EngineLoop:
    """Owns the engine on a background thread; handlers submit and abort requests through a queue."""

    def __init__(self, engine: LLMEngine, heartbeat_s: float = 60.0):
        self.engine, self.metrics = engine, Metrics()
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list, float]] = {}
        self.heartbeat_s = heartbeat_s
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="megalite-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.thread.join()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a checked request; its events arrive on the returned asyncio queue."""
        events: asyncio.Queue = asyncio.Queue()
        self.inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), events))
        return events

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def _handle(self, message) -> None:
        engine = self.engine
        if message[0] == "stop":
            self._stopped = True
        elif message[0] == "add":
            _, request_id, prompt, params, loop, events = message
            request = engine.add_request(prompt, params, request_id)
            self.streams[request_id] = (loop, events, [0] * params.n, request.arrival_time)
            self.metrics.requests += 1
        elif message[0] == "abort":
            if message[1] in engine.requests:
                self.metrics.aborted += 1
            engine.abort(message[1])
            self.streams.pop(message[1], None)

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
        except Exception as error:  # report to every waiting client, then stop serving
            for loop, events, _, _ in self.streams.values():
                loop.call_soon_threadsafe(events.put_nowait, {"error": f"engine failure: {error}"})
            raise
        finally:
            if engine.tp_size > 1:
                engine.stop_workers()

    def _publish(self, requests) -> None:
        now = time.perf_counter()
        for request in requests:
            entry = self.streams.get(request.request_id)
            if entry is None:
                continue
            loop, events, sent, last = entry
            choices = []
            for seq in request.sequences:
                generated = seq.tokens[len(request.prompt):]
                new = generated[sent[seq.index]:]
                if not new and not seq.finished:
                    continue
                logprobs = seq.logprobs[sent[seq.index]:] if request.params.logprobs else None
                if sent[seq.index] == 0:
                    self.metrics.ttft_sum += now - request.arrival_time
                    self.metrics.ttft_count += 1
                elif new:
                    self.metrics.itl_sum += now - last
                    self.metrics.itl_count += len(new)
                self.metrics.tokens += len(new)
                sent[seq.index] = len(generated)
                choices.append({"index": seq.index, "token_ids": new, "logprobs": logprobs,
                                "finish_reason": seq.finish_reason})
            self.streams[request.request_id] = (loop, events, sent, now)
            done = request.finished
            if done:
                del self.streams[request.request_id]
            loop.call_soon_threadsafe(events.put_nowait, {"choices": choices, "done": done})


def parse_request(body: dict, engine: LLMEngine, max_tokens_limit: int, tokenizer=None
                  ) -> tuple[list[int], SamplingParams, bool]:
    """The prompt ids, sampling params and stream flag of a completions body, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this server has no tokenizer: send the prompt as a list of token ids")
        prompt = list(tokenizer.tokenize(prompt))
    if not isinstance(prompt, list):
        raise BadRequest("prompt must be a list of token ids")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be an integer in [1, {max_tokens_limit}], got {max_tokens!r}")
    logprobs = body.get("logprobs", False)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    stop = body.get("stop_token_ids", [])
    if not isinstance(stop, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in stop):
        raise BadRequest("stop_token_ids must be a list of integers")
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=body.get("temperature", 1.0),
                                top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0), n=body.get("n", 1),
                                seed=body.get("seed"), stop_token_ids=stop, logprobs=bool(logprobs))
        prompt = engine.check_request(prompt, params)
    except ValueError as error:
        raise BadRequest(str(error)) from error
    return prompt, params, stream


def build_app(loop: EngineLoop, *, max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, tokenizer=None,
              model_name: str = "megalite"):
    """The aiohttp application: ``/v1/completions``, ``/metrics`` and ``/health``."""
    from aiohttp import web

    def error(status: int, message: str):
        return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=status)

    def choice_json(c: dict) -> dict:
        out = {"index": c["index"], "token_ids": c["token_ids"], "logprobs": c["logprobs"],
               "finish_reason": c["finish_reason"]}
        if tokenizer is not None:
            out["text"] = tokenizer.detokenize(c["token_ids"])
        return out

    async def completions(request):
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return error(400, f"malformed JSON: {err}")
        try:
            prompt, params, stream = parse_request(body, loop.engine, max_tokens_limit, tokenizer)
        except BadRequest as err:
            return error(400, str(err))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
        events = loop.submit(request_id, prompt, params)
        finished = False
        try:
            if not stream:
                merged = {i: {"index": i, "token_ids": [], "logprobs": [] if params.logprobs else None,
                              "finish_reason": None} for i in range(params.n)}
                while not finished:
                    event = await events.get()
                    if "error" in event:
                        return error(500, event["error"])
                    for c in event["choices"]:
                        m = merged[c["index"]]
                        m["token_ids"] += c["token_ids"]
                        if params.logprobs:
                            m["logprobs"] += c["logprobs"]
                        m["finish_reason"] = c["finish_reason"]
                    finished = event["done"]
                choices = [choice_json(merged[i]) for i in range(params.n)]
                usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c["token_ids"]) for c in choices)}
                return web.json_response({**head, "choices": choices, "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                while not finished:
                    event = await events.get()
                    if "error" in event:
                        await response.write(f"data: {json.dumps({'error': event['error']})}\n\n".encode())
                        break
                    chunk = {**head, "choices": [choice_json(c) for c in event["choices"]]}
                    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    finished = event["done"]
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:
                pass  # the client went away; the finally clause aborts the request
            return response
        finally:
            if not finished:
                loop.abort(request_id)

    async def metrics(request):
        return web.Response(text=loop.metrics.render(loop.engine), content_type="text/plain")

    async def health(request):
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=max_body_bytes)
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics),
                    web.get("/health", health)])
    return app


_SERVER, _ENGINE = "server", "engine"
SERVE_FLAGS = FlagTable((
    Flag("--host", _SERVER, default="127.0.0.1", help="address to bind (loopback only by default)"),
    Flag("--port", _SERVER, default=8000, type=int, help="0 picks a free port (printed at start)"),
    Flag("--max-body-bytes", _SERVER, default=1 << 20, type=int),
    Flag("--max-tokens-limit", _SERVER, default=1024, type=int, help="the largest max_tokens a request may ask"),
    Flag("--block-size", _ENGINE, ("EngineConfig.block_size",), type=int, help="tokens per KV-cache block"),
    Flag("--num-blocks", _ENGINE, ("EngineConfig.num_blocks",), type=int),
    Flag("--max-num-batched-tokens", _ENGINE, ("EngineConfig.max_num_batched_tokens",), type=int),
    Flag("--max-num-seqs", _ENGINE, ("EngineConfig.max_num_seqs",), type=int),
    Flag("--no-prefix-caching", _ENGINE, ("EngineConfig.enable_prefix_caching",), sets=False),
), (EngineConfig,))
"""The server's own rows; ``--load`` and ``--tensor-model-parallel-size`` are ``megalite.flags.SHARED_FLAGS``'."""


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m megalite.inference.serve",
                       description="OpenAI-compatible completions server for a megalite checkpoint")
    SHARED_FLAGS.add_to(p, ["--load", "--tensor-model-parallel-size"], helps={"--load": "megalite checkpoint directory"},
                        required=["--load"])
    SERVE_FLAGS.add_to(p)
    return p.parse_args(argv)


async def _serve(loop: EngineLoop, args) -> None:
    from aiohttp import web

    app = build_app(loop, max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"megalite.inference.serve listening on http://{args.host}:{port}", flush=True)
    try:
        while loop.thread.is_alive():
            await asyncio.sleep(0.5)
    finally:
        await runner.cleanup()


def main(argv=None) -> int:
    import os

    import torch.distributed as dist

    from megalite import topology
    from megalite.inference.llm import LLM

    args = parse_args(argv)
    config = EngineConfig(**SERVE_FLAGS.config_values(args, "EngineConfig"))
    tp = args.tensor_model_parallel_size
    distributed = "WORLD_SIZE" in os.environ or tp > 1
    if distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise ValueError(f"the server runs one model replica: WORLD_SIZE={world} must equal "
                             f"--tensor-model-parallel-size={tp}")
        topology.initialize(tp=tp)
    try:
        engine = LLM(args.load, tp, engine_config=config).engine
        if engine.tp_rank != 0:
            engine.run_worker()
            return 0
        loop = EngineLoop(engine)
        loop.start()
        try:
            asyncio.run(_serve(loop, args))
        except KeyboardInterrupt:
            pass
        finally:
            if loop.thread.is_alive():
                loop.stop()
        return 0
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
