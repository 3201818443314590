"""The offline API in vLLM's shape: ``LLM(checkpoint).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from megalite import topology
from megalite.inference.config import EngineConfig
from megalite.inference.engine import LLMEngine
from megalite.inference.params import RequestOutput, SamplingParams


class LLM:
    """Generate from a megalite checkpoint (or live model chunks) with the continuous-batching engine.

    ``LLM(checkpoint_dir, tensor_parallel_size)`` loads any megalite checkpoint
    (including one converted from Hugging Face); with ``tensor_parallel_size > 1``
    every rank of an initialized topology with that TP size constructs it and
    calls :meth:`generate` with the same arguments.  :meth:`from_model` wraps a
    live model chunk (e.g. the actor being trained), using its weights in place.
    ``tokenizer`` (anything with ``tokenize``/``detokenize`` or
    ``encode``/``decode``) lets prompts be strings and fills ``text``.
    """

    def __init__(self, checkpoint_dir: str | None = None, tensor_parallel_size: int = 1, *, tokenizer=None,
                 engine_config: EngineConfig | None = None, draft_model=None, device="cpu", model=None):
        if model is None:
            model = _load(checkpoint_dir, tensor_parallel_size, device)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, engine_config, draft_model=draft_model)

    @classmethod
    def from_model(cls, model, *, tokenizer=None, engine_config: EngineConfig | None = None,
                   draft_model=None) -> LLM:
        """An engine over the live ``model`` (a GPTModel, or a DDP wrapper around one)."""
        return cls(tokenizer=tokenizer, engine_config=engine_config, draft_model=draft_model, model=model)

    def _encode(self, prompt):
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer; pass token-id lists or LLM(..., tokenizer=...)")
        encode = getattr(self.tokenizer, "tokenize", None) or self.tokenizer.encode
        return list(encode(prompt))

    def _decode(self, ids: list[int]) -> str:
        decode = getattr(self.tokenizer, "detokenize", None) or self.tokenizer.decode
        return decode(ids)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order (a single prompt may be passed bare)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs = self.engine.generate([self._encode(p) for p in prompts], sampling_params or SamplingParams())
        if self.tokenizer is not None:
            for request in outputs:
                for completion in request.outputs:
                    completion.text = self._decode(completion.token_ids)
        return outputs


def _load(checkpoint_dir: str, tensor_parallel_size: int, device):
    """A checkpoint as a GPTModel sharded over the current topology's TP group (or a single process)."""
    from megalite.checkpoint import CheckpointReader, load_sharded, load_model
    from megalite.models import GPTModel

    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:
        return load_model(checkpoint_dir, device)
    if not topology.is_initialized():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs an initialized topology "
                         "(topology.initialize(tp=...)) on every rank")
    topo = topology.current()
    if topo.tp.size != tensor_parallel_size or topo.pp.size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not match the topology's tp="
                         f"{topo.tp.size} (pp={topo.pp.size}; the engine needs pp=1)")
    config = CheckpointReader(checkpoint_dir).config
    model = GPTModel(config).to(device)
    load_sharded(checkpoint_dir, [model])
    return model.eval()
