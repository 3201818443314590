"""Inference: a continuous-batching engine over a paged KV cache, on megalite's model weights in place.

- ``params.py``: :class:`SamplingParams` (with :class:`StructuredOutputsParams`), :class:`RequestOutput`,
  :class:`CompletionOutput`.
- ``config.py``: :class:`EngineConfig`.
- ``block_allocator.py``: refcounted KV blocks; ``paged_cache.py``: the KV pool and the per-step paged view.
- ``prefix_cache.py``: radix tree of cached prefixes, LRU eviction.
- ``sequence.py`` / ``scheduler.py``: request state; continuous batching, chunked prefill, preemption.
- ``sampler.py``: sampling and exact speculative verification; ``speculative.py``: drafters.
- ``engine.py``: :class:`LLMEngine` (TP rank 0 schedules, broadcasts the plan); ``llm.py``: :class:`LLM`.
- ``request_check.py``: the checks a request passes before an engine takes it (the engine's and the server's).
- ``detokenizer.py``: incremental text and stop strings; ``engine_loop.py``: the server's engine side (one
  batch per step); ``engine_client.py``: its HTTP side (and the engine on a thread); ``engine_process.py``: the
  engine in its own process (what ``serve`` runs);
  ``exchange.py``: one HTTP request's engine requests and events; ``completions.py``: OpenAI's completions
  format; ``api_server.py``: the HTTP app; ``serve.py``: its CLI.
- ``chat_template.py``, ``tool_calls.py``, ``grammar.py``: chat messages to prompt text, tool calls out of
  replies, structured-output token masks (imported where used: jinja2 and llguidance are optional extras).
"""

from megalite.inference.config import EngineConfig
from megalite.inference.engine import LLMEngine
from megalite.inference.llm import LLM
from megalite.inference.params import CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
