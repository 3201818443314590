"""Structured output: JSON (any object, or a JSON schema), regex, EBNF and Lark grammars as per-step token masks.

Built on llguidance (the ``[grammar]`` extra).  It was chosen over xgrammar by measurement on CPU
(``benchmarks/grammar_mask.py``, numbers in benchmarks/README.md): xgrammar's per-step mask is cheaper
(about 1-20 us against llguidance's 3-100 us at a 32k vocabulary, both small beside a forward step), but it
compiles eagerly over the whole vocabulary: 0.2 s for an ordinary schema and 19 s for a 400-property one at
32k tokens, on the engine thread, with no way to bound it.  llguidance builds its lexer lazily (about 1 ms
to compile the same schemas, 17 ms for the 400-property one) and bounds both compiling and every mask step
with deterministic work budgets ("fuel"), so a hostile schema fails fast with an error instead of stalling
every other request.  ``compile_time_limit_s`` is turned into that budget at llguidance's documented rate.

Use: one :class:`GrammarCompiler` per tokenizer (the engine keeps one: a request asks in vLLM's
:class:`StructuredOutputsParams` shape); ``compile(kind, source)`` (cached) gives a
:class:`CompiledGrammar`; each sequence (each of a request's ``n`` samples) takes its own
:meth:`CompiledGrammar.new_state`.  Per step, :func:`apply_grammar` masks a batch of logits rows (rows
without a grammar untouched) before sampling; after sampling, :meth:`GrammarState.advance` each emitted
token.  For speculative decoding :meth:`GrammarState.draft_masks` gives the mask at each draft position, so
masking the target's rows makes verification reject any draft the grammar forbids.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

import torch

from megalite.inference.params import StructuredOutputsParams

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "lark")
"""``json_object``: any JSON object (source None); ``json_schema``: a schema (dict or JSON text);
``regex``; ``choice``: a list of strings, the output one of them; ``ebnf``: GBNF (llama.cpp's EBNF) or Lark
(vLLM's ``grammar``); ``lark``.  :meth:`StructuredOutputsParams.spec` names one of these."""

_LEXER_FUEL_PER_MS = 50_000  # llguidance's documented speed of its initial lexer build
JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20]?"}
"""JSON may hold at most one space between its tokens (``json.dumps``'s layout, or compact; a schema's
``x-guidance`` may override): with free whitespace a sampled model can spend its whole token budget on blanks
and never close the object.  (Pinning the ", " / ": " separators instead costs llguidance about 40x per mask
at a 32k vocabulary: measured, benchmarks/README.md.)"""


class GrammarError(ValueError):
    """A grammar that does not compile, exceeds its limits, or a token it forbids (one-line message)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs the llguidance package: pip install 'megalite[grammar]'") \
            from None
    return llguidance


def response_format_grammar(response_format) -> StructuredOutputsParams | None:
    """The structured output an OpenAI ``response_format`` asks (None for ``{"type": "text"}`` or no format)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise GrammarError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format json_schema must be {'name': ..., 'schema': {...}}")
        return StructuredOutputsParams(json=spec.get("schema", {}))
    raise GrammarError(f"unknown response_format type {kind!r}; use text, json_object or json_schema")


def _token_table(tokenizer, stop_token_ids):
    """An llguidance tokenizer for a megalite tokenizer (Byte, SentencePiece, HF, GPT-2 BPE) or a transformers one."""
    llguidance = _llguidance()
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "backend_tokenizer"):  # megalite's HuggingFaceTokenizer
        tokenizer = inner
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, eos_token=stop_token_ids or None)
    if inner is not None and hasattr(inner, "_tokenizer"):  # megalite's GPT2BPETokenizer (tokenizers' byte BPE)
        return llguidance.LLTokenizer(inner._tokenizer.to_str(), eos_token=stop_token_ids or tokenizer.eod)
    pieces = _piece_bytes(tokenizer)
    eos = list(stop_token_ids or [tokenizer.eod])
    specials = [i for i, piece in enumerate(pieces) if piece is None]

    class Table:
        eos_token_id, bos_token_id = eos[0], getattr(tokenizer, "bos", None)
        tokens = [piece if piece is not None else b"" for piece in pieces]
        special_token_ids = specials

        def __call__(self, text):
            return list(tokenizer.tokenize(text.decode("utf-8", errors="replace") if isinstance(text, bytes)
                                           else text))

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Table()), eos_token=eos)


def _piece_bytes(tokenizer) -> list[bytes | None]:
    """Each id's bytes (None for special ids) for megalite's ByteTokenizer and SentencePieceTokenizer."""
    from megalite.data.tokenizer import ByteTokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) for i in range(256)] + [None] * (tokenizer.vocab_size - 256)
    if isinstance(tokenizer, SentencePieceTokenizer):
        sp, out = tokenizer._sp, []
        for i in range(sp.vocab_size()):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i):
                out.append(None)
            elif sp.is_byte(i):
                out.append(bytes([int(piece[3:-1], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out + [None] * (tokenizer.vocab_size - sp.vocab_size())
    raise GrammarError(f"structured output needs a text tokenizer; {type(tokenizer).__name__} has no token text")


class GrammarCompiler:
    """Compiles grammars for one tokenizer and a model vocabulary of ``vocab_size`` ids (>= the tokenizer's).

    ``stop_token_ids`` are the ids that end a sequence (default: the tokenizer's eos); the grammar allows
    them exactly where its output may end.  ``compile_time_limit_s`` bounds compiling twice: as llguidance's
    lexer fuel, and as a wait on the compile, which runs on one of two worker threads (llguidance releases
    the GIL while it builds), so the caller (the server's request check, or the engine thread) waits at most
    that long; an abandoned compile still ends within its fuel.  ``cache_size`` compiled grammars are kept,
    least recently used first out.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None,
                 compile_time_limit_s: float = 1.0, cache_size: int = 64):
        llguidance = _llguidance()
        if not compile_time_limit_s > 0:
            raise GrammarError(f"compile_time_limit_s must be > 0, got {compile_time_limit_s!r}")
        self.table = _token_table(tokenizer, [int(t) for t in stop_token_ids or []])
        self.tokenizer_vocab = self.table.vocab_size
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.tokenizer_vocab
        if self.vocab_size < self.tokenizer_vocab:
            raise GrammarError(f"the model's vocabulary ({self.vocab_size}) is smaller than the tokenizer's "
                               f"({self.tokenizer_vocab})")
        self.stop_token_ids = list(self.table.eos_tokens)
        fuel = int(compile_time_limit_s * 1e3 * _LEXER_FUEL_PER_MS)
        self.limits = llguidance.LLParserLimits(initial_lexer_fuel=fuel)
        self.compile_time_limit_s = compile_time_limit_s
        self.executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # compile may be called from several request threads
        self.cache_size = cache_size

    def compile(self, kind: str, source=None) -> CompiledGrammar:
        """A grammar of ``kind`` (see :data:`GRAMMAR_KINDS`); a :class:`GrammarError` if it does not compile."""
        llguidance = _llguidance()
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; choose one of {', '.join(GRAMMAR_KINDS)}")
        if kind == "json_object":
            kind, source = "json_schema", {"type": "object"}
        if kind == "json_schema":
            try:
                source = json.loads(source) if isinstance(source, str) else source
                key = (kind, json.dumps(source, sort_keys=True))
            except (ValueError, TypeError, RecursionError) as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {type(err).__name__}: "
                                   f"{str(err)[:200]}") from None
            if not isinstance(source, (dict, bool)):
                raise GrammarError("a JSON schema must be a JSON object")
        elif kind == "choice":
            if not isinstance(source, (list, tuple)) or not source or not all(isinstance(c, str) and c
                                                                             for c in source):
                raise GrammarError("a choice grammar must be a non-empty list of non-empty strings")
            source = json.dumps(list(source))
            key = (kind, source)
        elif not isinstance(source, str) or not source:
            raise GrammarError(f"a {kind} grammar must be a non-empty string")
        else:
            key = (kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT) \
                if kind == "json_schema" else llguidance.grammar_from(kind, source)
        except ValueError as err:
            raise GrammarError(f"the {kind} grammar does not compile: {str(err).splitlines()[0]}") from None
        build = self._pool.submit(llguidance.LLMatcher, self.table, text, log_level=0, limits=self.limits)
        try:
            matcher = build.result(timeout=self.compile_time_limit_s)
        except FutureTimeout:
            raise GrammarError(f"the {kind} grammar took longer than the compile limit of "
                               f"{self.compile_time_limit_s:g} s") from None
        if matcher.is_error():
            message = " ".join(matcher.get_error().split())
            if "too big" in message or "limit" in message:
                message += f" (compile limit {self.compile_time_limit_s:g} s)"
            raise GrammarError(f"the {kind} grammar does not compile: {message[:300]}")
        compiled = CompiledGrammar(self, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


class CompiledGrammar:
    """A compiled grammar; hands out independent per-sequence states."""

    def __init__(self, compiler: GrammarCompiler, matcher):
        self.compiler, self._matcher = compiler, matcher

    def new_state(self) -> GrammarState:
        return GrammarState(self.compiler, self._matcher.deep_copy())


class GrammarState:
    """One sequence's position in its grammar.

    ``allowed_token_mask()`` is a bool tensor over the model vocabulary; ``advance(token)`` consumes a
    sampled token (a token the mask forbids raises GrammarError); ``rollback(k)`` forgets the last ``k``;
    ``is_terminated`` is true once the output is complete (only a stop id may follow, or one was taken).
    """

    def __init__(self, compiler: GrammarCompiler, matcher):
        self.compiler, self.matcher = compiler, matcher

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def allowed_token_mask(self) -> torch.Tensor:
        return self._masks([self])[0]

    def advance(self, token: int) -> None:
        token = int(token)
        allowed = self.matcher.is_accepting() if token in self.compiler.stop_token_ids \
            else self.matcher.validate_tokens([token]) == 1  # validate_tokens does not count stop ids
        if not allowed or not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def rollback(self, k: int) -> None:
        if k and not self.matcher.rollback(int(k)):
            raise GrammarError(f"cannot roll the grammar back by {k} tokens")

    def draft_masks(self, drafts: list[int]) -> torch.Tensor:
        """Masks ``[len(drafts) + 1, vocab]``: before each draft, and after the last (the state is unchanged).

        Positions after a draft the grammar forbids repeat the mask at that draft: verification rejects
        it there, so those rows are never sampled from.
        """
        masks, taken = [], 0
        for draft in drafts:
            masks.append(self.allowed_token_mask())
            if not masks[-1][draft] or not self.matcher.consume_token(int(draft)):
                break
            taken += 1
        else:
            masks.append(self.allowed_token_mask())
        self.rollback(taken)
        return torch.stack(masks + [masks[-1]] * (len(drafts) + 1 - len(masks)))

    @staticmethod
    def _masks(states: list[GrammarState]) -> torch.Tensor:
        """Bool masks ``[len(states), vocab]`` of states sharing one compiler, filled in parallel."""
        compiler = states[0].compiler
        words = -(-compiler.tokenizer_vocab // 32)
        bitmask = torch.zeros(len(states), words, dtype=torch.int32)
        compiler.executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                                  bitmask.data_ptr(), words * 4, len(states))
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(len(states), words * 32)[:, :compiler.tokenizer_vocab]
        masks = torch.zeros(len(states), compiler.vocab_size, dtype=torch.bool)
        masks[:, :compiler.tokenizer_vocab] = bits.bool()
        for i, state in enumerate(states):
            if state.matcher.is_error():  # a step over its work budget: end the sequence rather than stall
                masks[i] = False
                masks[i, compiler.stop_token_ids] = True
        return masks


def apply_grammar(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """``logits [r, vocab]`` with every token row ``i``'s grammar forbids set to -inf (rows whose state is None
    are untouched); one parallel mask computation per compiler.  Returns a new tensor."""
    if len(states) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {len(states)} grammar states")
    by_compiler: dict[int, list[int]] = {}
    for i, state in enumerate(states):
        if state is not None:
            by_compiler.setdefault(id(state.compiler), []).append(i)
    if not by_compiler:
        return logits
    for rows in by_compiler.values():
        if states[rows[0]].compiler.vocab_size != logits.shape[1]:
            raise ValueError(f"logits have {logits.shape[1]} columns but the grammar's vocabulary is "
                             f"{states[rows[0]].compiler.vocab_size}")
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    for rows in by_compiler.values():
        allowed[rows] = GrammarState._masks([states[i] for i in rows])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
