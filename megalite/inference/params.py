"""What a request asks for (:class:`SamplingParams`) and what it gets back (:class:`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding options, in vLLM's shape.

    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those
    filters.  Generation stops after ``max_new_tokens`` (finish reason
    "length") or at a token of ``stop_token_ids`` (kept in the output, finish
    reason "stop").  ``n`` samples share the prompt's KV blocks.  ``seed``
    makes the samples of this request reproducible whatever else is in the
    batch.  ``logprobs=True`` returns each chosen token's log-probability
    under ``softmax(logits / temperature)`` (before top-k/top-p; plain
    ``softmax(logits)`` when greedy), as the actor's forward computes it.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False

    def __post_init__(self):
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples: generated ids, their log-probs (if asked) and why it stopped."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    text: str | None = None


@dataclass
class RequestOutput:
    """The result for one prompt: its ids and ``n`` completions in sample order."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
