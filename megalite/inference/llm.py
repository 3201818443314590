"""The offline API in vLLM's shape: ``LLM(checkpoint).generate(prompts, SamplingParams(...))`` and
``LLM(checkpoint).chat(messages, SamplingParams(...))``."""

from __future__ import annotations

import json
import os

from megalite import topology
from megalite.inference.config import EngineConfig
from megalite.inference.engine import LLMEngine
from megalite.inference.params import RequestOutput, SamplingParams

# Files that make a directory a Hugging Face tokenizer (one of them is enough).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")


class LLM:
    """Generate from a megalite checkpoint (or live model chunks) with the continuous-batching engine.

    ``LLM(checkpoint_dir, tensor_parallel_size)`` loads any megalite checkpoint
    (including one converted from Hugging Face); with ``tensor_parallel_size > 1``
    every rank of an initialized topology with that TP size constructs it and
    calls :meth:`generate` with the same arguments.  :meth:`from_model` wraps a
    live model chunk (e.g. the actor being trained), using its weights in place.
    The tokenizer (string prompts, output ``text``, stop strings, the eos token)
    is the checkpoint's (:func:`checkpoint_tokenizer`) unless ``tokenizer``
    names one: a tokenizer object (``tokenize``/``detokenize``), a Hugging Face
    tokenizer directory or a sentencepiece ``.model`` file.
    """

    def __init__(self, checkpoint_dir: str | None = None, tensor_parallel_size: int = 1, *, tokenizer=None,
                 engine_config: EngineConfig | None = None, draft_model=None, device="cpu", model=None):
        eos = None
        if model is None:
            model = _load(checkpoint_dir, tensor_parallel_size, device)
            if tokenizer is None:
                tokenizer, eos = checkpoint_tokenizer(checkpoint_dir)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.engine = LLMEngine(model, engine_config, draft_model=draft_model, tokenizer=self.tokenizer,
                                eos_token_ids=eos)

    @classmethod
    def from_model(cls, model, *, tokenizer=None, engine_config: EngineConfig | None = None,
                   draft_model=None) -> LLM:
        """An engine over the live ``model`` (a GPTModel, or a DDP wrapper around one)."""
        return cls(tokenizer=tokenizer, engine_config=engine_config, draft_model=draft_model, model=model)

    def encode(self, prompt):
        """A prompt as token ids (strings through the tokenizer; ids pass through)."""
        if not isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer: this checkpoint records none; pass token-id lists "
                             "or LLM(..., tokenizer=...)")
        return list(self.tokenizer.tokenize(prompt))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order (a single prompt may be passed bare)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs = self.engine.generate([self.encode(p) for p in prompts], sampling_params or SamplingParams())
        for prompt, output in zip(prompts, outputs):
            output.prompt = prompt if isinstance(prompt, str) else None
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template=None, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or a list of them, rendered
        with the chat template exactly as the server renders them: ``chat_template`` (a Jinja source or a
        :class:`ChatTemplate`), else the tokenizer's (its directory's ``chat_template.jinja`` or
        ``tokenizer_config.json``).  One :class:`RequestOutput` per conversation."""
        from megalite.inference.chat_completions import render_chat
        from megalite.inference.chat_template import ChatTemplate, load_chat_template

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this checkpoint records none; pass LLM(..., tokenizer=...)")
        if isinstance(chat_template, str):
            chat_template = ChatTemplate(chat_template)
        template = chat_template or load_chat_template(getattr(self.tokenizer, "path", None))
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(template, self.tokenizer, c, tools, chat_template_kwargs) for c in conversations]
        return self.engine.generate(prompts, sampling_params or SamplingParams())


def load_tokenizer(path: str):
    """A tokenizer named by a path: a Hugging Face tokenizer directory or a sentencepiece model file."""
    from megalite.data.tokenizer import build_tokenizer

    if os.path.isdir(path):
        return build_tokenizer(path, "HuggingFaceTokenizer")
    if os.path.isfile(path):
        return build_tokenizer(path, "SentencePieceTokenizer")
    raise ValueError(f"tokenizer {path!r} is neither a Hugging Face tokenizer directory nor a sentencepiece model")


def checkpoint_tokenizer(checkpoint_dir: str) -> tuple[object | None, list[int] | None]:
    """The tokenizer a checkpoint records and its end-of-sequence ids, or ``(None, None)`` when it records none.

    Tokenizer files beside the checkpoint (a Hugging Face directory's) come first; else the trainer's saved
    flags (``--tokenizer-type`` and friends; none named means megalite's default ByteTokenizer).  The eos ids
    are the tokenizer's, plus those of a converted Hugging Face model's config and ``generation_config.json``.
    """
    from megalite.checkpoint import read_checkpoint_info
    from megalite.data.tokenizer import tokenizer_from_saved_args

    info = read_checkpoint_info(checkpoint_dir)
    state = info["state"]
    tokenizer = None
    for directory in dict.fromkeys((checkpoint_dir, info["directory"])):
        if any(os.path.isfile(os.path.join(directory, name)) for name in _HF_TOKENIZER_FILES):
            tokenizer = load_tokenizer(directory)
            break
    else:
        if isinstance(state.get("args"), dict):
            tokenizer = tokenizer_from_saved_args(state["args"])
    if tokenizer is None:
        return None, None
    eos = [tokenizer.eod]
    sources = [((state.get("hf") or {}).get("config") or {}).get("eos_token_id")]
    for directory in dict.fromkeys((checkpoint_dir, info["directory"])):
        path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                sources.append(json.load(f).get("eos_token_id"))
    for source in sources:
        eos += [source] if isinstance(source, int) else list(source or [])
    return tokenizer, sorted(set(eos))


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
