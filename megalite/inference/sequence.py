"""A request and its sequences: the token ids, KV blocks and sampling state the scheduler tracks."""

from __future__ import annotations

import torch

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
        self.finish_reason: str | None = None
        self.generator = request.generators[index]

    @property
    def arrival(self) -> int:
        return self.request.arrival

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float | None) -> None:
        """Add one generated token; set the finish reason when it is a stop id or the last allowed one."""
        params = self.request.params
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in params.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_generated >= params.max_new_tokens:
            self.finish_reason = "length"

    def output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, token_ids=self.tokens[len(self.request.prompt):],
                                logprobs=list(self.logprobs) if self.request.params.logprobs else None,
                                finish_reason=self.finish_reason)


class Request:
    """A prompt with its sampling params; its ``n`` samples start as one sequence and fork after the prompt."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: int, seed: int):
        self.request_id, self.prompt, self.params, self.arrival = request_id, list(prompt), params, arrival
        self.generators = [torch.Generator().manual_seed((seed * 1_000_003 + i) % (2 ** 63)) for i in range(params.n)]
        self.sequences = [Sequence(self, 0, prompt)]
        self.cancelled = False
        self.arrival_time: float | None = None

    @property
    def forked(self) -> bool:
        return len(self.sequences) == self.params.n

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt_token_ids=list(self.prompt),
                             outputs=[s.output() for s in self.sequences], finished=self.finished)
