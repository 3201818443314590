"""A request and its sequences: the token ids, KV blocks, text and sampling state the scheduler tracks."""

from __future__ import annotations

from megalite.inference.detokenizer import IncrementalDetokenizer
from megalite.inference.noise import as_seed
from megalite.inference.params import CompletionOutput, RequestOutput, SamplingParams


class Sequence:
    """One sample of a request: prompt + generated ids, ``num_computed`` of them already in the KV cache."""

    def __init__(self, request: Request, index: int, tokens: list[int]):
        self.request, self.index = request, index
        self.tokens = list(tokens)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.num_cached_blocks = 0  # full blocks last offered to the prefix cache
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.seed = request.seeds[index]
        self.detokenizer = request.new_detokenizer()
        self.grammar = request.grammar.new_state() if request.grammar is not None else None  # each its own

    @property
    def arrival(self) -> int:
        return self.request.arrival

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self, index: int) -> Sequence:
        """Sample ``index`` of the request, starting from this one's tokens (before any are generated)."""
        child = Sequence(self.request, index, self.tokens)
        child.num_computed = self.num_computed
        child.block_table = list(self.block_table)
        return child

    def append(self, token: int, logprob: float | None, top: dict[int, float] | None = None) -> None:
        """Add one generated token; set the finish reason at a stop (eos, stop id or string, the end of the
        grammar) or the length limit."""
        request, params = self.request, self.request.params
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if self.grammar is not None:
            self.grammar.advance(token)
        generated = self.num_generated
        may_stop = generated >= params.min_tokens
        eos = token in request.eos_token_ids and not params.ignore_eos
        stop_string = None
        if self.detokenizer is not None and not eos:
            stop_string = self.detokenizer.add(token, may_stop)
        if may_stop and token in params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif may_stop and eos:
            self.finish_reason = "stop"
        elif stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif self.grammar is not None and self.grammar.is_terminated:  # the output is complete
            self.finish_reason = "stop"
        elif generated >= params.max_tokens:
            self.finish_reason = "length"
        if self.finished and self.detokenizer is not None and stop_string is None:
            self.detokenizer.flush()

    def fail(self, message: str) -> None:
        self.finish_reason = "error"
        self.request.error = self.request.error or message

    def text(self) -> str | None:
        return None if self.detokenizer is None else self.detokenizer.text

    def output(self) -> CompletionOutput:
        params = self.request.params
        wanted = params.logprobs is not None
        return CompletionOutput(index=self.index, token_ids=self.tokens[len(self.request.prompt):],
                                logprobs=list(self.logprobs) if wanted else None, finish_reason=self.finish_reason,
                                text=self.text(), top_logprobs=list(self.top_logprobs) if params.logprobs else None,
                                cumulative_logprob=sum(self.logprobs) if self.request.needs_logprobs else None,
                                stop_reason=self.stop_reason)


def sample_seed(seed: int, index: int) -> int:
    """The noise seed of sample ``index`` of a request of ``seed``."""
    return (seed * 1_000_003 + index) % (2 ** 63)


class Request:
    """A prompt with its sampling params; its ``best_of`` samples start as one sequence and fork after the prompt.

    ``eos_token_ids`` end a sample (unless ``ignore_eos``); ``tokenizer`` (optional) gives each sample its text
    and stop strings; ``grammar`` is ``params.structured_outputs`` compiled (each sample takes its own state).
    ``error`` is set when the request failed alone (e.g. non-finite logits).  Sample ``i`` draws with the noise of
    seed ``sample_seeds[i]`` (default :func:`sample_seed` of ``seed``; :mod:`megalite.inference.noise`: a function of
    the seed and the token position, no generator state), so a caller can give the samples of one request the
    streams of separate requests: the same tokens, the prompt computed once."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: int, seed: int,
                 eos_token_ids=(), tokenizer=None, grammar=None, sample_seeds: list[int] | None = None):
        self.request_id, self.prompt, self.params, self.arrival = request_id, list(prompt), params, arrival
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer, self.grammar = tokenizer, grammar
        if sample_seeds is None:
            sample_seeds = [sample_seed(seed, i) for i in range(params.best_of)]
        elif len(sample_seeds) != params.best_of:
            raise ValueError(f"{len(sample_seeds)} sample seeds for best_of={params.best_of} samples")
        self.seeds = [as_seed(s) for s in sample_seeds]
        self.prompt_logprobs: dict[int, dict[int, float]] = {}
        self.error: str | None = None
        self.sequences = [Sequence(self, 0, prompt)]
        self.cancelled = False
        self.arrival_time: float | None = None

    def new_detokenizer(self) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, self.prompt, self.params.stop,
                                      self.params.include_stop_str_in_output)

    @property
    def needs_logprobs(self) -> bool:
        """Whether samples carry log-probs: asked for, or needed to rank ``best_of`` samples."""
        return self.params.logprobs is not None or self.params.best_of > self.params.n

    @property
    def forked(self) -> bool:
        return len(self.sequences) == self.params.best_of

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.forked and all(s.finished for s in self.sequences))

    def chosen(self) -> list[Sequence]:
        """The ``n`` samples returned: all of them, or the best ``n`` of ``best_of`` by cumulative log-prob."""
        if self.params.best_of == self.params.n or not self.finished:
            return self.sequences[:self.params.n]
        ranked = sorted(self.sequences, key=lambda s: -sum(s.logprobs))
        return ranked[:self.params.n]

    def output(self) -> RequestOutput:
        outputs = [s.output() for s in self.chosen()]
        for index, out in enumerate(outputs):
            out.index = index
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self.prompt_logprobs.get(i) for i in range(1, len(self.prompt))]
        return RequestOutput(request_id=self.request_id, prompt_token_ids=list(self.prompt), outputs=outputs,
                             finished=self.finished, prompt_logprobs=prompt_logprobs)
