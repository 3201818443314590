"""The OpenAI-compatible HTTP application (aiohttp): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``.

Each endpoint is a function from a checked body to engine requests and from
their events to a reply (:mod:`megalite.inference.completions` for
completions, :mod:`megalite.inference.chat_completions` for chat; a
request's ``structured_outputs`` grammar is compiled here on a worker thread,
so an engine in this process finds it in its cache, and one that does not compile is a 400);
:func:`build_app` adds the parts every endpoint shares: reading the body
(size limit, a timeout for slow senders, JSON that is too deep or holds
oversized integers is a 400), submitting to the :class:`EngineClient`
(429 with ``Retry-After`` when its queue is full, 503 once the engine has
died), waiting with a per-request timeout while watching for the client
going away (its requests are aborted, freeing their KV blocks), errors in
OpenAI's shape (``invalid_request_error`` only for 4xx), and one access-log
line per request (id, status, tokens in and out, latency).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from dataclasses import dataclass

from megalite.inference.chat_completions import ChatStream, chat_choice, parse_chat
from megalite.inference.completions import (BadRequest, LogprobsBuilder, choice_logprobs, parse_completion,
                                            prompt_logprobs)
from megalite.inference.engine_client import EngineClient
from megalite.inference.exchange import WATCH_S, Exchange, HTTPFailure
from megalite.inference.grammar import GrammarError

ACCESS_LOG = logging.getLogger("megalite.inference.access")
# The access log's record of the request being handled (its id, and its Exchange once it has one).
_SLOT: contextvars.ContextVar[dict] = contextvars.ContextVar("megalite_request")
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "timeout_error"}


@dataclass
class ServerConfig:
    """Limits of the HTTP server.

    ``max_body_bytes`` (413 above), ``max_tokens_limit`` and ``max_n`` (the
    largest ``max_tokens`` and ``n``/``best_of`` a request may ask; 400 above),
    ``max_pending`` requests held at once (429 above), ``request_timeout_s``
    from arrival to the last token (504 after), ``body_timeout_s`` to receive
    the body (408 after).  (The time limit to compile a request's grammar is the engine's:
    ``EngineConfig.grammar_compile_time_limit_s``.)
    """

    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 1024
    max_n: int = 16
    max_pending: int = 1024
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    model_name: str = "megalite"

    def __post_init__(self):
        for name in ("max_body_bytes", "max_tokens_limit", "max_n", "max_pending"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerConfig.{name} must be a positive integer, got {value!r}")
        for name in ("request_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerConfig.{name} must be positive, got {getattr(self, name)!r}")


_ENCODE = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def _json(payload) -> bytes:
    """``payload`` as compact JSON (a streamed chunk is encoded once per write; no need for spaces)."""
    return _ENCODE(payload).encode()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request, config: ServerConfig):
    """The request's JSON body, or HTTPFailure (413 too large, 408 too slow, 400 malformed)."""
    from aiohttp import web

    try:
        raw = await asyncio.wait_for(request.read(), config.body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise HTTPFailure(413, f"the body exceeds {config.max_body_bytes} bytes") from None
    except asyncio.TimeoutError:
        raise HTTPFailure(408, f"the body did not arrive within {config.body_timeout_s:g} s") from None
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise HTTPFailure(400, "malformed JSON: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
        raise HTTPFailure(400, f"malformed JSON: {str(error)[:200]}") from None


def build_app(loop: EngineClient, config: ServerConfig | None = None, *, tokenizer=None, chat_template=None):
    """The aiohttp application over a started :class:`EngineClient` (an engine on a thread or in its own process).

    ``chat_template``: the model's :class:`ChatTemplate`, or the ChatTemplateError saying why it has none
    (chat requests get it as their 400)."""
    from aiohttp import web

    config = config or ServerConfig()
    live: set[Exchange] = set()  # the exchanges waiting or streaming, woken every WATCH_S by the watchdog

    async def watchdog(app):
        async def poke():
            while True:
                await asyncio.sleep(WATCH_S)
                for exchange in list(live):
                    exchange.wake()

        task = asyncio.ensure_future(poke())
        yield
        task.cancel()

    def error(status: int, message: str, headers=None):
        kind = _ERROR_TYPES.get(status, "server_error")
        return web.json_response({"error": {"message": message[:1000], "type": kind, "code": status}},
                                 status=status, headers=headers)

    @web.middleware
    async def access_log(request, handler):
        """One line per request: id, method and path, status, tokens in and out, latency."""
        started, status = time.perf_counter(), 500
        # OpenAI's prefixes: chat replies are ``chatcmpl-...``, text completions ``cmpl-...``
        prefix = "chatcmpl" if request.path == "/v1/chat/completions" else "cmpl"
        slot = {"id": f"{prefix}-{uuid.uuid4().hex}", "arrived": started}
        _SLOT.set(slot)
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as failure:
            status = failure.status
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            status = 499  # the client went away
            raise
        finally:
            exchange = slot.get("exchange")
            ACCESS_LOG.info("%s %s %s %d prompt_tokens=%d completion_tokens=%d latency=%.3fs", slot["id"],
                            request.method, request.path, status, exchange.prompt_tokens if exchange else 0,
                            exchange.completion_tokens if exchange else 0, time.perf_counter() - started)

    def endpoint(run):
        """Wrap ``run(request, body, exchange)`` with the body checks, errors and aborts."""

        async def handler(request):
            exchange = None
            try:
                body = await read_json(request, config)
                slot = _SLOT.get()
                exchange = slot["exchange"] = Exchange(loop, request, config.request_timeout_s, slot["id"], live,
                                                            slot["arrived"])
                return await run(request, body, exchange)
            except BadRequest as failure:
                return error(400, str(failure))
            except HTTPFailure as failure:
                return error(failure.status, str(failure), failure.headers)
            finally:
                if exchange is not None:
                    exchange.close()

        return handler

    async def compile_grammar(params):
        """Compile ``params.structured_outputs`` on a worker thread, off the event loop (into the checker's cache:
        the engine's own when it runs in this process); 400 if it fails."""
        if params.structured_outputs is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, loop.checker.compile_grammar,
                                                                 params.structured_outputs)
            except GrammarError as failure:
                raise BadRequest(str(failure)) from None

    async def completions(request, body, exchange: Exchange):
        checked = parse_completion(body, loop.checker, max_tokens_limit=config.max_tokens_limit, max_n=config.max_n,
                                   tokenizer=tokenizer)
        await compile_grammar(checked.params)
        ids = exchange.submit(checked.prompts, checked.params)
        head = {"id": exchange.id, "object": "text_completion", "created": int(time.time()),
                "model": config.model_name}
        texts = [t if t is not None or tokenizer is None else tokenizer.detokenize(p)
                 for t, p in zip(checked.texts, checked.prompts)]
        n = checked.params.n
        if checked.stream:
            return await _stream(request, exchange, checked, ids, texts, head)
        outputs = {}
        while len(outputs) < len(ids):
            for event in await exchange.take():
                if event["done"]:
                    outputs[event["request_id"]] = event["output"]
        exchange.completion_tokens = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        choices = []
        for p, engine_id in enumerate(ids):
            output = outputs[engine_id]
            for c in output.outputs:
                text = c.text if c.text is not None else ""
                logprobs = None
                if checked.params.logprobs is not None:
                    builder = LogprobsBuilder(tokenizer)
                    if checked.echo:
                        prompt_logprobs(builder, output.prompt_token_ids, output.prompt_logprobs)
                    choice_logprobs(builder, c.token_ids, c.logprobs, c.top_logprobs)
                    logprobs = builder.json()
                choices.append({"index": p * n + c.index, "text": (texts[p] or "") + text if checked.echo else text,
                                "token_ids": c.token_ids, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return web.json_response({**head, "choices": choices, "usage": _usage(exchange)})

    async def chat(request, body, exchange: Exchange):
        checked = parse_chat(body, loop.checker, template=chat_template, tokenizer=tokenizer,
                             max_tokens_limit=config.max_tokens_limit, max_n=config.max_n)
        await compile_grammar(checked.completion.params)
        exchange.submit(checked.completion.prompts, checked.completion.params)
        head = {"id": exchange.id, "created": int(time.time()), "model": config.model_name}
        if checked.completion.stream:
            return await _chat_stream(request, exchange, checked, head)
        output = None
        while output is None:
            output = next((e["output"] for e in await exchange.take() if e["done"]), None)
        outputs = output.outputs
        exchange.completion_tokens = sum(len(c.token_ids) for c in outputs)
        choices = [chat_choice(c.index, c, checked, tokenizer) for c in outputs]
        return web.json_response({**head, "object": "chat.completion", "choices": choices,
                                  "usage": _usage(exchange)})

    async def _chat_stream(request, exchange, checked, head):
        head = {**head, "object": "chat.completion.chunk"}
        usage = {"usage": None} if checked.completion.include_usage else {}
        streams = [ChatStream(i, checked, tokenizer) for i in range(checked.completion.params.n)]

        async def chunks(send, flush):
            done = False
            while not done:
                for event in await exchange.take():
                    for c in event["choices"]:
                        for chunk in streams[c["index"]].chunks(c):
                            send({**head, "choices": [chunk], **usage})
                    done = done or event["done"]
                await flush()
            if usage:
                send({**head, "choices": [], "usage": _usage(exchange)})

        return await _sse(request, chunks)

    async def _sse(request, produce):
        """A server-sent-events reply of the payloads ``produce(send, flush)`` sends, an error event on
        failure, then ``[DONE]``.  ``send`` only encodes (compact JSON); ``flush`` writes what was sent since
        the last flush in one write, so the chunks of one batch of engine events cost one socket send."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        pending = []

        def send(payload):
            pending.append(b"data: " + _json(payload) + b"\n\n")

        async def flush():
            if pending:
                data = b"".join(pending)
                pending.clear()
                await response.write(data)

        try:
            await produce(send, flush)
        except HTTPFailure as failure:
            send({"error": {"message": str(failure), "type": _ERROR_TYPES.get(failure.status, "server_error"),
                            "code": failure.status}})
        except ConnectionResetError:
            return response  # the client went away; the endpoint wrapper aborts what is left
        pending.append(b"data: [DONE]\n\n")
        await flush()
        return response

    async def _stream(request, exchange, checked, ids, texts, head):
        n = checked.params.n
        builders, prompt_lps = {}, {}
        position = {engine_id: p for p, engine_id in enumerate(ids)}
        usage = {"usage": None} if checked.include_usage else {}

        async def chunks(send, flush):
            done = 0
            while done < len(ids):
                for event in await exchange.take():
                    p = position[event["request_id"]]
                    if "prompt_logprobs" in event:
                        prompt_lps[p] = event["prompt_logprobs"]
                    choices = []
                    for c in event["choices"]:
                        index = p * n + c["index"]
                        text, logprobs = c["text"] or "", None
                        first = index not in builders
                        if first:
                            builders[index] = LogprobsBuilder(tokenizer) if checked.params.logprobs is not None \
                                else None
                        builder = builders[index]
                        start = len(builder.tokens) if builder is not None else 0
                        if first and checked.echo:
                            text = (texts[p] or "") + text
                            if builder is not None:
                                prompt_logprobs(builder, checked.prompts[p], prompt_lps.get(p))
                        if builder is not None:
                            choice_logprobs(builder, c["token_ids"], c["logprobs"], c["top_logprobs"])
                            logprobs = {k: v[start:] for k, v in builder.json().items()}
                        choices.append({"index": index, "text": text, "token_ids": c["token_ids"],
                                        "logprobs": logprobs, "finish_reason": c["finish_reason"]})
                    done += event["done"]
                    if choices:
                        send({**head, "choices": choices, **usage})
                await flush()
            if checked.include_usage:
                send({**head, "choices": [], "usage": _usage(exchange)})

        return await _sse(request, chunks)

    def _usage(exchange):
        return {"prompt_tokens": exchange.prompt_tokens, "completion_tokens": exchange.completion_tokens,
                "total_tokens": exchange.prompt_tokens + exchange.completion_tokens}

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": config.model_name, "object": "model",
                                                              "created": 0, "owned_by": "megalite"}]})

    async def health(request):
        if not loop.alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(request):
        return web.Response(text=loop.metrics.render(loop.pending), content_type="text/plain")

    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[access_log])
    app.cleanup_ctx.append(watchdog)
    app.add_routes([web.post("/v1/completions", endpoint(completions)),
                    web.post("/v1/chat/completions", endpoint(chat)), web.get("/v1/models", models),
                    web.get("/metrics", metrics), web.get("/health", health)])
    return app
