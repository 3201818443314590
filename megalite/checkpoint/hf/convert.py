"""Whole conversions between Hugging Face model directories and megalite checkpoints, family by family.

megalite checkpoints are written as whole global tensors (one rank file); the resharding loader
splits them for any parallel layout, so no target layout is needed here.  The original config.json,
generation_config.json, key prefix and whether a tied ``lm_head.weight`` was stored travel in the
checkpoint's state (``"hf"``), and the tokenizer files in its ``hf_tokenizer/`` folder, so converting
back reproduces the Hugging Face directory.
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

from megalite.checkpoint import CheckpointReader, TensorShard, global_shapes, save_global_shards
from megalite.checkpoint.files import fresh_output, move_into_place
from megalite.checkpoint.hf import deepseek, gpt2, llama
from megalite.checkpoint.hf.files import (GENERATION_CONFIG, open_hf_tensors, parse_size, read_generation_config,
                                          read_hf_config, tokenizer_files, write_hf_tensors, write_json)
from megalite.checkpoint.tokenizer_export import run_tokenizer, write_tokenizer

TOKENIZER_DIR = "hf_tokenizer"
"""Folder of a converted checkpoint (beside its iteration folders) holding the Hugging Face tokenizer files."""
FAMILIES = ("gpt2", *llama.FAMILIES, deepseek.FAMILY)


def hf_config_to_gpt(hf_config: dict):
    """The ``GPTConfig`` of a Hugging Face ``config.json`` (ValueError for what megalite cannot express)."""
    kind = hf_config.get("model_type")
    if kind == "gpt2":
        return gpt2.config_from_hf(hf_config)
    if kind in llama.FAMILIES:
        return llama.config_from_hf(hf_config)
    if kind == deepseek.FAMILY:
        return deepseek.config_from_hf(hf_config)
    raise ValueError(f"model_type {kind!r} is not supported; the converter knows {', '.join(FAMILIES)}")


def _family_to_megalite(hf_config: dict, tensors) -> tuple[object, object, dict]:
    """``(GPTConfig, groups of global megalite tensors, conversion info)`` from the family's converter."""
    kind = hf_config.get("model_type")
    if kind == "gpt2":
        return gpt2.to_megalite(hf_config, tensors)
    if kind in llama.FAMILIES:
        return llama.to_megalite(hf_config, tensors)
    if kind == deepseek.FAMILY:
        return deepseek.to_megalite(hf_config, tensors)
    raise ValueError(f"model_type {kind!r} is not supported; the converter knows {', '.join(FAMILIES)}")


def hf_to_megalite(hf_config: dict, tensors) -> tuple[object, dict, dict]:
    """``(GPTConfig, global megalite tensors, conversion info)`` of a Hugging Face checkpoint's config and
    tensors (a dict or :class:`~megalite.checkpoint.hf.files.LazyTensors`)."""
    config, groups, info = _family_to_megalite(hf_config, tensors)
    out = {k: v.contiguous() for group in groups for k, v in group.items()}
    return config, out, {**info, "config": hf_config}


class _GroupStream:
    """The tensors of a family converter's groups (one layer each), handed out one by one in the groups'
    order, the next group converted when the current one is used up."""

    def __init__(self, groups):
        self._groups, self._group = iter(groups), {}

    def take(self, name: str) -> torch.Tensor:
        while name not in self._group:
            if self._group:
                raise ValueError(f"the writer asked for {name} before {sorted(self._group)[0]} of the layer in hand")
            self._group = next(self._groups, None)
            if self._group is None:
                raise ValueError(f"the conversion made no tensor {name}")
        return self._group.pop(name)


def hf_family(config) -> str:
    """The Hugging Face model_type a megalite architecture exports as (ValueError when none fits)."""
    if config.multi_latent_attention:
        return deepseek.FAMILY
    if config.moe is None and config.window_size is None and gpt2.matches(config):
        return "gpt2"
    family = llama.family_of(config)
    if family is not None:
        return family
    raise ValueError(f"no Hugging Face family fits position_embedding_type={config.position_embedding_type!r}, "
                     f"normalization={config.normalization!r}, activation={config.activation!r}, "
                     f"add_bias_linear={config.add_bias_linear}, num_query_groups={config.num_query_groups}, "
                     f"rotary_percent={config.rotary_percent}, rotary_interleaved={config.rotary_interleaved}, "
                     f"window_size={config.window_size}, moe={config.moe is not None}: "
                     "GPT-2 needs learned_absolute/LayerNorm/gelu/biases/MHA/no window/no MoE, Llama/Qwen/Mistral "
                     "rope (whole heads, rotate-half)/RMSNorm/swiglu, a window only without biases (Mistral, "
                     "Mixtral), MoE as Mixtral (no bias), Qwen2-MoE (a gated shared expert) or Qwen3-MoE (Q/K norm)")


def _family(config, base: dict) -> str:
    """The family to write: the original's when it was Mistral (same architecture as Llama), else hf_family."""
    family = hf_family(config)
    if family == "llama" and base.get("model_type") == "mistral" and not config.add_bias_linear:
        return "mistral"
    return family


def default_prefix(family: str) -> str:
    return {"gpt2": gpt2.PREFIX, deepseek.FAMILY: deepseek.PREFIX}.get(family, llama.PREFIX)


def megalite_tensor_to_hf(config, name: str, tensor: torch.Tensor, prefix: str | None = None
                          ) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face ``(name, tensor)`` pairs of one global megalite model tensor.

    Used tensor by tensor, so weight export can stream a sharded model without holding it whole.  Only
    DeepSeek-V3 stores multi-token prediction depths (``mtp.*``); other families give none for them (a served
    model does not use them), and a checkpoint conversion refuses them (:func:`_hf_config`).
    """
    family = hf_family(config)
    pre = default_prefix(family) if prefix is None else prefix
    if family != deepseek.FAMILY and name.startswith("mtp."):
        return []
    if family == "gpt2":
        return gpt2.tensor_to_hf(config, name, tensor, pre)
    if family == deepseek.FAMILY:
        return deepseek.tensor_to_hf(config, name, tensor, pre)
    return llama.tensor_to_hf(config, name, tensor, pre, family)


def _hf_config(config, info: dict) -> tuple[dict, str]:
    """``(config.json contents, key prefix)`` of a megalite GPTConfig and the conversion info it came with."""
    base = dict(info.get("config") or {})
    family = _family(config, base)
    if base.get("model_type", family) != family:
        base = {}
    if config.mtp_num_layers and family != deepseek.FAMILY:
        raise ValueError(f"{family} cannot store multi-token prediction layers (mtp_num_layers="
                         f"{config.mtp_num_layers}); only deepseek_v3 checkpoints hold them")
    if family == "gpt2":
        hf = gpt2.hf_config(config, base)
    elif family == deepseek.FAMILY:
        hf = deepseek.hf_config(config, base)
    else:
        hf = llama.hf_config(config, base, family)
    return hf, info.get("prefix", default_prefix(family))


def _hf_tensors(config, tensors, info: dict, prefix: str):
    """The Hugging Face ``(name, tensor)`` pairs of a model's global ``(name, tensor)`` pairs, one megalite
    tensor at a time."""
    for name, tensor in tensors:
        yield from megalite_tensor_to_hf(config, name, tensor, prefix)
        if (name == "embedding.word_embeddings.weight" and not config.untie_embeddings_and_output_weights
                and info.get("lm_head_stored")):
            yield "lm_head.weight", tensor.clone()


def megalite_to_hf(config, tensors: dict, info: dict | None = None) -> tuple[dict, dict]:
    """``(config.json contents, Hugging Face tensors)`` of a megalite GPTConfig and its global tensors."""
    info = info or {}
    hf, prefix = _hf_config(config, info)
    pairs = ((name, tensors[name]) for name in global_shapes(config))
    return hf, {k: v.contiguous() for k, v in _hf_tensors(config, pairs, info, prefix)}


def convert_hf_to_megalite(hf_dir: str, output: str) -> None:
    """Write the Hugging Face checkpoint ``hf_dir`` as a megalite checkpoint (global tensors) in ``output``.

    Streams layer by layer: a dry run over the tensors' shapes and dtypes names every output tensor (and finds
    a missing, unknown or misshapen one before anything is written); then each layer's tensors are read from
    the (sharded) safetensors and converted when the writer reaches that layer, and each converted tensor is
    freed once written.  Memory holds about the largest layer plus the tensor being written, so a model
    converts on a machine with far less memory than its size.  The tokenizer files go to
    ``output/hf_tokenizer`` (use it as ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model``).
    """
    hf_config = read_hf_config(hf_dir)
    tensors = open_hf_tensors(hf_dir)
    config, planned, info = hf_to_megalite(hf_config, tensors.shapes_only())
    stream = _GroupStream(_family_to_megalite(hf_config, tensors)[1])
    shards = [TensorShard(name, tuple(meta.shape), (0,) * meta.dim(), meta, load=functools.partial(stream.take, name))
              for name, meta in planned.items()]
    generation = read_generation_config(hf_dir)
    if generation is not None:
        info["generation_config"] = generation
    tmp = fresh_output(output)
    save_global_shards(tmp, config, shards, extra={"hf": info})
    for name in tokenizer_files(hf_dir):
        os.makedirs(os.path.dirname(os.path.join(tmp, TOKENIZER_DIR, name)), exist_ok=True)
        shutil.copy(os.path.join(hf_dir, name), os.path.join(tmp, TOKENIZER_DIR, name))
    move_into_place(tmp, output)


def _converted_tokenizer(path: str) -> list[tuple[str, str]]:
    """The tokenizer files a converted checkpoint keeps in ``hf_tokenizer/`` (``path`` is its save or
    iteration directory)."""
    for root in (path, os.path.dirname(os.path.abspath(path))):
        folder = os.path.join(root, TOKENIZER_DIR)
        if os.path.isdir(folder):
            return [(os.path.join(folder, name), name) for name in tokenizer_files(folder)]
    return []


def _with_token_ids(contents: dict, token_ids: dict) -> dict:
    """``contents`` (config.json or generation_config.json) with the run tokenizer's bos/eos ids, unless its
    own eos ids already include the tokenizer's (Llama 3 instruct lists several end ids; keep them)."""
    eos = contents.get("eos_token_id")
    if not token_ids or token_ids["eos_token_id"] in (eos if isinstance(eos, list) else [eos]):
        return contents
    return {**contents, **token_ids}


def convert_megalite_to_hf(path: str, output: str, max_shard_size: int | str = "5GB") -> None:
    """Write the megalite checkpoint ``path`` as config.json + safetensors (sharded above ``max_shard_size``),
    generation_config.json and the tokenizer files.

    Streams: one megalite tensor is read at a time (:meth:`~megalite.checkpoint.reader.CheckpointReader.read_each`)
    and each output shard written when full, so memory holds at most one shard plus the tensor being converted.

    The tokenizer is the one of the run that saved the checkpoint (its flags, see
    :mod:`megalite.checkpoint.tokenizer_export`), else the one a conversion from Hugging Face kept;
    its bos/eos ids go into config.json and generation_config.json unless the original files' eos ids
    include its eos id.
    """
    limit = parse_size(max_shard_size)
    reader = CheckpointReader(path)
    config, state = reader.config, reader.state
    if config is None:
        raise ValueError(f"checkpoint {reader.directory} stores no GPTConfig")
    info = state.get("hf") or {}
    hf_config, prefix = _hf_config(config, info)
    files, token_ids = run_tokenizer(state.get("args"), config.vocab_size)
    if not files:
        files = _converted_tokenizer(path)
    hf_config = _with_token_ids(hf_config, token_ids)
    generation = info.get("generation_config")
    if generation is not None or token_ids:
        generation = _with_token_ids(generation or {}, token_ids)
    tmp = fresh_output(output)
    os.makedirs(tmp)
    write_tokenizer(files, tmp)
    write_hf_tensors(tmp, _hf_tensors(config, reader.read_each(global_shapes(config)), info, prefix), limit)
    write_json(os.path.join(tmp, "config.json"), hf_config)
    if generation is not None:
        write_json(os.path.join(tmp, GENERATION_CONFIG), generation)
    move_into_place(tmp, output)
