"""What a request must satisfy before an engine takes it (:class:`RequestChecker`): prompt ids inside the
vocabulary, prompt + ``max_tokens`` inside the context and the KV pool, a tokenizer where stop strings or a
grammar need one; and the request's grammar, compiled (cached, time-limited) for the engine's tokenizer.

The engine checks every request it is given with one; the HTTP server checks with one too, before the engine
sees the request: in the same process it is the engine's own, and when the engine runs in its own process
(:mod:`megalite.inference.engine_process`) the HTTP process builds one from the facts the engine process
reports (vocabulary, context, eos ids, config) and its own tokenizer, so bad input and a grammar that does not
compile are answered there without a trip to the engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from megalite.inference.config import EngineConfig
from megalite.inference.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from megalite.inference.params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class EngineFacts:
    """What a request checker needs to know of an engine: plain data, so it crosses a process boundary."""

    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    config: EngineConfig


class RequestChecker:
    """Checks requests against :class:`EngineFacts` and compiles their grammars for ``tokenizer``."""

    def __init__(self, facts: EngineFacts, tokenizer=None):
        self.facts, self.tokenizer = facts, tokenizer
        self.vocab_size, self.max_context = facts.vocab_size, facts.max_context
        self._grammars = None  # the GrammarCompiler, built on the first structured-output request
        self._grammars_lock = threading.Lock()

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt as a list of ids, or a ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("a prompt must be a non-empty list of token ids")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a list of integer token ids")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"prompt token ids range over [{low}, {high}], outside the vocabulary [0, "
                             f"{self.vocab_size - 1}]")
        outside = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size - 1}]: "
                             f"{outside[:5]}")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (LLM(..., tokenizer=...) or serve --tokenizer)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (LLM(..., tokenizer=...) or serve --tokenizer); "
                             "use stop_token_ids")
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} = {total} "
                             f"exceeds the model's context of {self.max_context} tokens")
        bs, blocks = self.facts.config.block_size, self.facts.config.num_blocks
        if -(-total // bs) > blocks:
            raise ValueError(f"the KV pool of {blocks} blocks x {bs} tokens cannot hold even one "
                             f"request of {total} tokens (needs {-(-total // bs)} blocks)")
        return list(prompt)

    def compile_grammar(self, structured: StructuredOutputsParams) -> CompiledGrammar:
        """``structured`` compiled for this tokenizer, vocabulary and eos ids (cached, so compiling ahead, e.g.
        on a server's worker thread, makes the engine's own compile a lookup; thread-safe); a
        :class:`GrammarError` (a ValueError) when it does not compile within
        ``EngineConfig.grammar_compile_time_limit_s`` or llguidance is missing."""
        if self.tokenizer is None:
            raise GrammarError("structured output needs a tokenizer (LLM(..., tokenizer=...) or serve --tokenizer)")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                                 stop_token_ids=sorted(self.facts.eos_token_ids),
                                                 compile_time_limit_s=self.facts.config.grammar_compile_time_limit_s)
        return self._grammars.compile(*structured.spec())
