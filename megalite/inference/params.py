"""What a request asks for (:class:`SamplingParams`) and what it gets back (:class:`RequestOutput`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# The smallest non-zero temperature: below it ``logits / T`` overflows fp32 (vLLM warns and clamps here).
MIN_TEMPERATURE = 1e-2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite number that fits a float (a 400-digit integer does not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass
class StructuredOutputsParams:
    """What a request's output must follow, in vLLM's shape (``vllm.sampling_params.StructuredOutputsParams``):
    exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice`` (the output is one of
    these strings), ``grammar`` (EBNF: llama.cpp's GBNF or Lark) or ``json_object=True`` (any JSON object).

    It is plain data: the engine compiles it for its tokenizer and vocabulary
    (``RequestChecker.compile_grammar``, cached and time-limited); the HTTP server does so first, on a worker
    thread, so a grammar that does not compile is a 400 before the engine sees it.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar and "
                             f"json_object, got {given or 'none'}")
        if not isinstance(self.json, (dict, str, type(None))):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str)
                                                    or not getattr(self, name)):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true (or left out)")

    def spec(self) -> tuple[str, object]:
        """The ``(kind, source)`` :meth:`megalite.inference.grammar.GrammarCompiler.compile` takes."""
        if self.json is not None:
            return "json_schema", self.json
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", list(self.choice)
        if self.grammar is not None:
            return "ebnf", self.grammar
        return "json_object", None


@dataclass
class SamplingParams:
    """Per-request decoding options, with vLLM's field names and meanings.

    ``temperature=0`` is greedy; ``top_k=0`` (or -1), ``top_p=1`` and ``min_p=0``
    disable those filters.  ``logit_bias`` ({token id: bias}) is added to the
    logits; ``repetition_penalty`` (> 1 discourages tokens of the prompt and
    output, as in CTRL), ``frequency_penalty`` and ``presence_penalty`` (on the
    output's counts) apply before the temperature.  Generation stops after
    ``max_tokens`` (finish reason "length"), at the end-of-sequence token
    (the tokenizer's or generation config's, unless ``ignore_eos``), at a
    token of ``stop_token_ids`` (kept in the ids), or when the detokenised
    text contains a string of ``stop`` (cut from the text unless
    ``include_stop_str_in_output``); none of these stop before ``min_tokens``.
    ``best_of`` samples are drawn and the ``n`` with the highest cumulative
    log-probability returned; they share the prompt's KV blocks.  ``seed``
    makes a request reproducible whatever else is in the batch.
    ``logprobs=N`` returns each chosen token's log-probability under
    ``softmax(logits / T)`` (T = 1 when greedy; before penalties and filters, as
    the actor's forward computes it) and the N most likely; ``prompt_logprobs=N``
    the same for every prompt token after the first.  ``structured_outputs`` (vLLM's name and shape) is a
    :class:`StructuredOutputsParams` (a dict of its fields is taken as one): each sample's tokens are masked
    to those its grammar allows, and a sample ends (reason "stop") once its output is complete; where the
    grammar allows only a stop id, ``min_tokens`` gives way (as in vLLM).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self):
        def fail(name, want):
            raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "a positive integer")
        if self.best_of is None:
            self.best_of = self.n
        if not _is_int(self.best_of) or self.best_of < self.n:
            fail("best_of", f"an integer >= n ({self.n})")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "a positive integer")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_real(self.temperature) or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            fail("temperature", f"0 (greedy) or a number >= {MIN_TEMPERATURE}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "a number in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            fail("repetition_penalty", "a number in (0, 100]")
        if self.seed is not None and (not _is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64):
            fail("seed", "None or an integer in [-2**63, 2**64)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and (not _is_int(getattr(self, name)) or getattr(self, name) < 0):
                fail(name, "None or an integer >= 0 (the number of top alternatives)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "a non-empty string or a list of them")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of integer token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "a mapping of token ids to biases in [-100, 100]")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                fail("logit_bias", "a mapping of token ids to biases in [-100, 100]")
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                fail("logit_bias", "a mapping of token ids to biases in [-100, 100]")

        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)})
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {unknown}; use json, regex, choice, "
                                 "grammar or json_object")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            fail("structured_outputs", "None or a StructuredOutputsParams (json, regex, choice, grammar or "
                 "json_object)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits need per-sequence processing before sampling (penalties, ``logit_bias``, ``min_tokens``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples.

    ``logprobs`` holds each generated token's log-probability and ``top_logprobs``
    the ``SamplingParams.logprobs`` most likely tokens per step ({id: log-prob});
    both None unless asked.  ``stop_reason`` is the stop string or stop token id
    that ended it (None for eos or length)."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    text: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """The result for one prompt: its ids and ``n`` completions in sample order.

    ``prompt_logprobs`` (when asked) has one entry per prompt token: None for the
    first, then {id: log-prob} of the token itself and the top alternatives."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt: str | None = None
