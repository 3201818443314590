"""``/v1/completions`` in OpenAI's wire format: a request body to engine requests, engine output to choices.

A body is checked completely before the engine sees it (:class:`BadRequest`,
HTTP 400, one message naming the field).  ``prompt`` is a string, a list of
strings, a list of token ids or a list of such lists; each prompt becomes
one engine request and its ``n`` choices are numbered ``prompt * n + j`` as
OpenAI numbers them.  Fields are OpenAI's plus vLLM's sampling extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, and ``structured_outputs``: an object of
:class:`StructuredOutputsParams`' fields, compiled by the server before the request is queued).  ``logprobs`` (top-N)
gives OpenAI's object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``); with ``echo`` the prompt comes first, its first token
without a log-prob, as lm-evaluation-harness' loglikelihood reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.inference.params import SamplingParams


class BadRequest(ValueError):
    """A request the server answers with 400."""


# Body fields passed to SamplingParams under the same name (it checks them); the others are handled here.
SAMPLING_FIELDS = ("temperature", "top_p", "n", "best_of", "seed", "presence_penalty", "frequency_penalty", "stop",
             "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
             "include_stop_str_in_output", "structured_outputs")
_OTHER = {"model", "prompt", "max_tokens", "stream", "stream_options", "logprobs", "echo", "suffix", "user"}
FIELDS = frozenset(SAMPLING_FIELDS) | _OTHER
# The most alternatives per token that ``logprobs`` may ask (OpenAI allows 5; vLLM more).
MAX_LOGPROBS = 20
# The most stop strings a request may list (each is searched for after every token; OpenAI allows 4).
MAX_STOP = 16


@dataclass
class CompletionRequest:
    """A checked ``/v1/completions`` body: one entry of ``prompts`` (ids) and ``texts`` (or None) per prompt."""

    prompts: list[list[int]]
    texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool


def _prompts(prompt, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    def is_ids(value):
        return isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)

    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or is_ids(p) for p in prompt):
        raise BadRequest("prompt must be a string, a list of strings, a non-empty list of token ids, or a list of "
                         "such lists")
    if any(isinstance(p, str) for p in prompt) and tokenizer is None:
        raise BadRequest("this server has no tokenizer (the checkpoint records none; start it with --tokenizer): "
                         "send the prompt as token ids")
    ids = [list(tokenizer.tokenize(p)) if isinstance(p, str) else p for p in prompt]
    if any(not p for p in ids):
        raise BadRequest("a prompt must not be empty")
    return ids, [p if isinstance(p, str) else None for p in prompt]


def parse_completion(body, checker, *, max_tokens_limit: int, max_n: int, tokenizer=None) -> CompletionRequest:
    """The checked request a completions body asks for, or BadRequest naming what is wrong (the prompts
    checked by ``checker``, a :class:`megalite.inference.request_check.RequestChecker`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix is not supported: this server does not do fill-in-the-middle")
    flags = {}
    for name in ("stream", "echo"):
        flags[name] = body.get(name, False)
        if not isinstance(flags[name], bool):
            raise BadRequest(f"{name} must be true or false, got {flags[name]!r}")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be null or {\"include_usage\": true|false}")
    if options is not None and not flags["stream"]:
        raise BadRequest("stream_options is only allowed with stream: true")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = max_tokens_limit
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"max_tokens must be an integer in [1, {max_tokens_limit}], got {max_tokens!r}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    for name in ("n", "best_of"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_n:
            raise BadRequest(f"{name} must be at most {max_n} (--max-n), got {value}")
    if len(body.get("stop") or []) > MAX_STOP and isinstance(body["stop"], list):
        raise BadRequest(f"stop may list at most {MAX_STOP} strings, got {len(body['stop'])}")
    if isinstance(body.get("logit_bias"), dict):
        for key in body["logit_bias"]:
            if not key.lstrip("-").isdigit() or len(key) > 12:
                raise BadRequest(f"logit_bias keys must be token ids, got {key[:20]!r}")
    values = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=logprobs if flags["echo"] and logprobs is not None else None,
                                **values)
    except (ValueError, TypeError) as error:
        raise BadRequest(str(error)) from None
    if flags["stream"] and params.best_of > params.n:
        raise BadRequest("best_of > n cannot be streamed")
    prompts, texts = _prompts(body.get("prompt"), tokenizer)
    try:
        prompts = [checker.check_request(p, params) for p in prompts]
    except ValueError as error:
        raise BadRequest(str(error)) from None
    include_usage = bool(options and options.get("include_usage"))
    return CompletionRequest(prompts, texts, params, flags["stream"], include_usage, flags["echo"])


class LogprobsBuilder:
    """OpenAI's completion ``logprobs`` object, grown token by token."""

    def __init__(self, tokenizer, offset: int = 0):
        self.piece = (lambda t: tokenizer.detokenize([t])) if tokenizer is not None else str
        self.offset = offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token: int, logprob: float | None, top: dict[int, float] | None) -> None:
        piece = self.piece(token)
        self.tokens.append(piece)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(None if top is None else {self.piece(t): v for t, v in top.items()})
        self.text_offset.append(self.offset)
        self.offset += len(piece)

    def json(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def prompt_logprobs(builder: LogprobsBuilder, prompt: list[int], logprobs) -> None:
    """Add the prompt's tokens (the first without a log-prob) to ``builder``, for ``echo``."""
    for i, token in enumerate(prompt):
        entry = logprobs[i] if logprobs is not None else None
        builder.add(token, None if entry is None else entry[token], entry)


def choice_logprobs(builder: LogprobsBuilder, tokens: list[int], logprobs, tops) -> None:
    """Add generated ``tokens`` with their log-probs and top alternatives (``tops`` None: just the token)."""
    for i, token in enumerate(tokens):
        value = logprobs[i] if logprobs is not None else None
        builder.add(token, value, tops[i] if tops is not None else ({token: value} if value is not None else None))
