"""Conversion between Hugging Face GPT-2 / Llama checkpoints (safetensors + config.json) and megalite's.

megalite checkpoints are written as whole global tensors (one rank file); the resharding loader
splits them for any tensor-parallel size, so no target layout is needed here.  Weight layouts:

- GPT-2 uses Conv1D, whose weights are ``[in, out]``: they are transposed.  Its fused ``c_attn``
  is ``[q; k; v]`` over all heads; megalite's grouped QKV is ``[q_0, k_0, v_0, q_1, ...]`` per head.
- Llama's separate q/k/v projections (grouped-query attention allowed) are interleaved group by
  group into megalite's QKV; ``gate_proj`` and ``up_proj`` become the global ``[gate; up]`` fc1.

The original config.json, key prefix and whether a tied ``lm_head.weight`` was stored travel in
the megalite checkpoint, so converting back reproduces the Hugging Face files exactly.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from safetensors import safe_open
from safetensors.torch import save_file

from megalite.checkpoint import global_shapes, read_global_tensors, save_global_checkpoint
from megalite.checkpoint.tokenizer_export import run_tokenizer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu"}


def read_hf_checkpoint(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json contents, tensors)`` of a Hugging Face model directory."""
    if not os.path.isdir(hf_dir):
        raise ValueError(f"Hugging Face directory {hf_dir} does not exist")
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{hf_dir} has no config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    single, index = os.path.join(hf_dir, SAFETENSORS), os.path.join(hf_dir, SAFETENSORS_INDEX)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(hf_dir, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise ValueError(f"{hf_dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}")
    tensors = {}
    for path in files:
        if not os.path.isfile(path):
            raise ValueError(f"{path}, listed in {index}, does not exist")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        tensors[name] = f.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types for malformed files
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    return hf_config, tensors


def _prefix(tensors: dict, prefix: str) -> str:
    return prefix if any(k.startswith(prefix) for k in tensors) else ""


class _Taker:
    """Takes named tensors out of a dict, so leftovers can be reported at the end."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        self.tensors, self.source = dict(tensors), source

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.source} has no tensor {name!r}")
        return self.tensors.pop(name)

    def finish(self) -> None:
        if self.tensors:
            raise ValueError(f"{self.source} has tensors this converter does not know: {sorted(self.tensors)[:5]}")


def _gpt2_to_megalite(hf: dict, tensors: dict) -> tuple[object, dict, dict]:
    from megalite.models import GPTConfig

    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function {activation!r} is not one of {sorted(_GPT2_ACTIVATIONS)}")
    for flag, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if hf.get(flag, wanted) != wanted:
            raise ValueError(f"GPT-2 {flag}={hf[flag]} is not supported (megalite needs {wanted})")
    h, heads, layers = hf["n_embd"], hf["n_head"], hf["n_layer"]
    tied = hf.get("tie_word_embeddings", True)
    config = GPTConfig(vocab_size=hf["vocab_size"], num_layers=layers, hidden_size=h, num_attention_heads=heads,
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, max_position_embeddings=hf["n_positions"],
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=_GPT2_ACTIVATIONS[activation],
                       hidden_dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
                       untie_embeddings_and_output_weights=not tied)
    config.validate()
    pre = _prefix(tensors, "transformer.")
    take = _Taker(tensors, "the GPT-2 checkpoint")
    d = h // heads
    out = {"embedding.word_embeddings.weight": take(pre + "wte.weight"),
           "embedding.position_embeddings.weight": take(pre + "wpe.weight")}
    for i in range(layers):
        src, dst = f"{pre}h.{i}.", f"decoder.layers.{i}."
        qkv_w, qkv_b = take(src + "attn.c_attn.weight").t(), take(src + "attn.c_attn.bias")
        out.update({
            dst + "input_layernorm.weight": take(src + "ln_1.weight"),
            dst + "input_layernorm.bias": take(src + "ln_1.bias"),
            dst + "self_attention.linear_qkv.weight": qkv_w.reshape(3, heads, d, h).transpose(0, 1).reshape(3 * h, h),
            dst + "self_attention.linear_qkv.bias": qkv_b.reshape(3, heads, d).transpose(0, 1).reshape(3 * h),
            dst + "self_attention.linear_proj.weight": take(src + "attn.c_proj.weight").t(),
            dst + "self_attention.linear_proj.bias": take(src + "attn.c_proj.bias"),
            dst + "pre_mlp_layernorm.weight": take(src + "ln_2.weight"),
            dst + "pre_mlp_layernorm.bias": take(src + "ln_2.bias"),
            dst + "mlp.linear_fc1.weight": take(src + "mlp.c_fc.weight").t(),
            dst + "mlp.linear_fc1.bias": take(src + "mlp.c_fc.bias"),
            dst + "mlp.linear_fc2.weight": take(src + "mlp.c_proj.weight").t(),
            dst + "mlp.linear_fc2.bias": take(src + "mlp.c_proj.bias"),
        })
    out["decoder.final_layernorm.weight"] = take(pre + "ln_f.weight")
    out["decoder.final_layernorm.bias"] = take(pre + "ln_f.bias")
    return config, out, _finish_output_layer(take, out, tied, pre, "wte.weight")


def _finish_output_layer(take, out: dict, tied: bool, pre: str, embedding_name: str) -> dict:
    """Read the untied lm_head (a tied one must equal the embedding) and check every tensor was used."""
    lm_head_stored = "lm_head.weight" in take.tensors
    if tied:
        if lm_head_stored and not torch.equal(take("lm_head.weight"), out["embedding.word_embeddings.weight"]):
            raise ValueError(f"tie_word_embeddings is true but lm_head.weight differs from {embedding_name}")
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    take.finish()
    return {"prefix": pre, "lm_head_stored": lm_head_stored}


def _rope_theta(hf: dict) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"Llama rope type {kind!r} is not supported (only the default rotary embedding)")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_to_megalite(hf: dict, tensors: dict) -> tuple[object, dict, dict]:
    from megalite.models import GPTConfig

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise ValueError(f"attention_bias={bias} with mlp_bias={hf.get('mlp_bias')} is not supported: megalite "
                         "uses biases on every linear layer or on none")
    h, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    groups = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    tied = hf.get("tie_word_embeddings", False)
    config = GPTConfig(vocab_size=hf["vocab_size"], num_layers=layers, hidden_size=h, num_attention_heads=heads,
                       num_query_groups=groups, kv_channels=d, ffn_hidden_size=hf["intermediate_size"],
                       max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
                       rotary_base=_rope_theta(hf), normalization="RMSNorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
                       activation="swiglu", add_bias_linear=bias, attention_dropout=hf.get("attention_dropout", 0.0),
                       untie_embeddings_and_output_weights=not tied)
    config.validate()
    pre = _prefix(tensors, "model.")
    take = _Taker(tensors, "the Llama checkpoint")
    r = heads // groups
    out = {"embedding.word_embeddings.weight": take(pre + "embed_tokens.weight")}
    for i in range(layers):
        src, dst = f"{pre}layers.{i}.", f"decoder.layers.{i}."
        names = ["weight"] + (["bias"] if bias else [])
        for kind in names:
            q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
            rest = q.shape[1:]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(
                [q.reshape(groups, r * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                dim=1).reshape(-1, *rest)
            out[f"{dst}self_attention.linear_proj.{kind}"] = take(f"{src}self_attn.o_proj.{kind}")
            out[f"{dst}mlp.linear_fc1.{kind}"] = torch.cat([take(f"{src}mlp.gate_proj.{kind}"),
                                                           take(f"{src}mlp.up_proj.{kind}")])
            out[f"{dst}mlp.linear_fc2.{kind}"] = take(f"{src}mlp.down_proj.{kind}")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    out["decoder.final_layernorm.weight"] = take(pre + "norm.weight")
    return config, out, _finish_output_layer(take, out, tied, pre, "embed_tokens.weight")


def hf_to_megalite(hf_config: dict, tensors: dict) -> tuple[object, dict, dict]:
    """``(GPTConfig, global megalite tensors, conversion info)`` of a GPT-2, Llama or DeepSeek-V3 checkpoint."""
    kind = hf_config.get("model_type")
    if kind == "gpt2":
        config, out, info = _gpt2_to_megalite(hf_config, tensors)
    elif kind == "llama":
        config, out, info = _llama_to_megalite(hf_config, tensors)
    elif kind == "deepseek_v3":
        from megalite.checkpoint.hf_deepseek import deepseek_v3_to_megalite

        pre, take = _prefix(tensors, "model."), _Taker(tensors, "the DeepSeek-V3 checkpoint")
        config, out = deepseek_v3_to_megalite(hf_config, take, set(tensors), pre)
        info = _finish_output_layer(take, out, hf_config.get("tie_word_embeddings", False), pre, "embed_tokens.weight")
    else:
        raise ValueError(f"model_type {kind!r} is not supported; the converter knows 'gpt2', 'llama' and "
                         "'deepseek_v3'")
    return config, {k: v.contiguous() for k, v in out.items()}, {**info, "config": hf_config}


def hf_family(config) -> str:
    """'gpt2', 'llama' or 'deepseek_v3': the Hugging Face family this megalite architecture matches."""
    if config.multi_latent_attention:
        return "deepseek_v3"
    if config.moe is not None:
        raise ValueError("MoE models have no Hugging Face GPT-2/Llama equivalent")
    if (config.position_embedding_type == "learned_absolute" and config.normalization == "LayerNorm"
            and config.add_bias_linear and config.activation in ("gelu", "gelu_tanh")
            and config.num_query_groups == config.num_attention_heads
            and config.kv_channels * config.num_attention_heads == config.hidden_size):
        return "gpt2"
    if (config.position_embedding_type == "rope" and config.normalization == "RMSNorm" and config.activation == "swiglu"
            and config.rotary_percent == 1.0):
        return "llama"
    raise ValueError(f"no Hugging Face family fits position_embedding_type={config.position_embedding_type!r}, "
                     f"normalization={config.normalization!r}, activation={config.activation!r}, "
                     f"add_bias_linear={config.add_bias_linear}, num_query_groups={config.num_query_groups}: "
                     "GPT-2 needs learned_absolute/LayerNorm/gelu/biases/MHA, Llama rope/RMSNorm/swiglu")


def default_prefix(family: str) -> str:
    return "transformer." if family == "gpt2" else "model."


_GPT2_NAMES = {"input_layernorm": "ln_1", "pre_mlp_layernorm": "ln_2", "self_attention.linear_proj": "attn.c_proj",
               "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
_LLAMA_NAMES = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
                "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def megalite_tensor_to_hf(config, name: str, tensor: torch.Tensor, prefix: str | None = None
                          ) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face ``(name, tensor)`` pairs of one global megalite model tensor.

    Used tensor by tensor, so weight export can stream a sharded model without holding it whole.
    """
    family = hf_family(config)
    gpt2 = family == "gpt2"
    pre = default_prefix(family) if prefix is None else prefix
    if family == "deepseek_v3":
        from megalite.checkpoint.hf_deepseek import deepseek_v3_tensor_to_hf

        return deepseek_v3_tensor_to_hf(name, tensor, pre)
    top = {"embedding.word_embeddings.weight": pre + ("wte.weight" if gpt2 else "embed_tokens.weight"),
           "embedding.position_embeddings.weight": pre + "wpe.weight",
           "decoder.final_layernorm.weight": pre + ("ln_f.weight" if gpt2 else "norm.weight"),
           "decoder.final_layernorm.bias": pre + "ln_f.bias",
           "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    dst = f"{pre}h.{index}." if gpt2 else f"{pre}layers.{index}."
    if module == "self_attention.linear_qkv":
        groups, d = config.num_query_groups, config.kv_channels
        r, shape = config.num_attention_heads // groups, tensor.shape[1:]
        q, k, v = tensor.reshape(groups, (r + 2) * d, *shape).split([r * d, d, d], dim=1)
        q, k, v = (t.reshape(-1, *shape) for t in (q, k, v))
        if not gpt2:
            return [(f"{dst}self_attn.{p}_proj.{kind}", t) for p, t in (("q", q), ("k", k), ("v", v))]
        pairs = [(f"{dst}attn.c_attn.{kind}", torch.cat([q, k, v]))]
    elif module == "mlp.linear_fc1" and not gpt2:
        gate, up = tensor.chunk(2)
        return [(f"{dst}mlp.gate_proj.{kind}", gate), (f"{dst}mlp.up_proj.{kind}", up)]
    else:
        pairs = [(f"{dst}{(_GPT2_NAMES if gpt2 else _LLAMA_NAMES)[module]}.{kind}", tensor)]
    if gpt2 and kind == "weight":
        pairs = [(n, t.t() if n[len(dst):-len(".weight")] in _CONV1D else t) for n, t in pairs]
    return pairs


def _gpt2_hf_config(config, base: dict) -> dict:
    h = config.hidden_size
    inner = None if config.ffn_hidden_size == 4 * h else config.ffn_hidden_size
    activation = base.get("activation_function")
    if _GPT2_ACTIVATIONS.get(activation) != config.activation:
        activation = "gelu" if config.activation == "gelu" else "gelu_new"
    hf = {**base, "model_type": "gpt2", "architectures": base.get("architectures", ["GPT2LMHeadModel"]),
          "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings, "n_embd": h,
          "n_layer": config.num_layers, "n_head": config.num_attention_heads, "activation_function": activation,
          "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.hidden_dropout,
          "attn_pdrop": config.attention_dropout,
          "tie_word_embeddings": not config.untie_embeddings_and_output_weights}
    if inner is not None or "n_inner" in base:
        hf["n_inner"] = base["n_inner"] if inner is None else inner
    return hf


def _llama_hf_config(config, base: dict) -> dict:
    h, heads, groups = config.hidden_size, config.num_attention_heads, config.num_query_groups
    hf = {**base, "model_type": "llama", "architectures": base.get("architectures", ["LlamaForCausalLM"]),
          "vocab_size": config.vocab_size, "hidden_size": h, "intermediate_size": config.ffn_hidden_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": heads, "num_key_value_heads": groups,
          "head_dim": config.kv_channels, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
          "rms_norm_eps": config.norm_eps, "attention_bias": config.add_bias_linear,
          "mlp_bias": config.add_bias_linear, "attention_dropout": config.attention_dropout,
          "tie_word_embeddings": not config.untie_embeddings_and_output_weights}
    if isinstance(base.get("rope_parameters"), dict):
        hf["rope_parameters"] = {**base["rope_parameters"], "rope_theta": config.rotary_base}
    else:
        hf["rope_theta"] = config.rotary_base
    return hf


def megalite_to_hf(config, tensors: dict, info: dict | None = None) -> tuple[dict, dict]:
    """``(config.json contents, Hugging Face tensors)`` of a megalite GPTConfig and its global tensors."""
    info = info or {}
    family = hf_family(config)
    base = dict(info.get("config") or {})
    if base.get("model_type", family) != family:
        base = {}
    pre = info.get("prefix", default_prefix(family))
    if family == "deepseek_v3":
        from megalite.checkpoint.hf_deepseek import deepseek_v3_hf_config

        hf = deepseek_v3_hf_config(config, base)
    else:
        hf = (_gpt2_hf_config if family == "gpt2" else _llama_hf_config)(config, base)
    out = {}
    for name in global_shapes(config):
        out.update(megalite_tensor_to_hf(config, name, tensors[name], pre))
    if not config.untie_embeddings_and_output_weights and info.get("lm_head_stored"):
        out["lm_head.weight"] = tensors["embedding.word_embeddings.weight"].clone()
    return hf, {k: v.contiguous() for k, v in out.items()}


def _fresh_output(output: str) -> str:
    """A temporary sibling of ``output``; ValueError when ``output`` exists and is not empty."""
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ValueError(f"output {output} already exists and is not empty; refusing to overwrite it")
    tmp = output.rstrip(os.sep) + ".converting"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    return tmp


def _move_into_place(tmp: str, output: str) -> None:
    if os.path.isdir(output):
        os.rmdir(output)
    os.rename(tmp, output)


def convert_hf_to_megalite(hf_dir: str, output: str) -> None:
    """Write the Hugging Face checkpoint ``hf_dir`` as a megalite checkpoint (global tensors) in ``output``."""
    hf_config, tensors = read_hf_checkpoint(hf_dir)
    config, global_tensors, info = hf_to_megalite(hf_config, tensors)
    tmp = _fresh_output(output)
    save_global_checkpoint(tmp, config, global_tensors, extra={"hf": info})
    _move_into_place(tmp, output)


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``5GB``, ``500MB``, ``10KiB`` or ``1234``."""
    if isinstance(text, int):
        return text
    value = text.strip().upper()
    units = (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
             ("B", 1))
    for unit, factor in units:
        if value.endswith(unit):
            number = value[:-len(unit)]
            break
    else:
        number, factor = value, 1
    try:
        size = int(float(number) * factor)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit (e.g. 5GB, 500MB)") from None
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def write_hf_tensors(output: str, tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[str]:
    """Write ``tensors`` to ``output`` with the safetensors library; returns the file names written.

    Up to ``max_shard_size`` bytes go to ``model.safetensors``; more are split, in name order, into
    ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
    """
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        names = [SAFETENSORS]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file_name, members in zip(names, shards):
        save_file({n: tensors[n].contiguous() for n in members}, os.path.join(output, file_name),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, members in zip(names, shards) for n in members}}
        with open(os.path.join(output, SAFETENSORS_INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        names.append(SAFETENSORS_INDEX)
    return names


def convert_megalite_to_hf(path: str, output: str, max_shard_size: int | str = "5GB") -> None:
    """Write the megalite checkpoint ``path`` as config.json + safetensors (sharded above ``max_shard_size``).

    When the run that saved it used a Hugging Face tokenizer directory, its files are copied and
    its bos/eos ids written into config.json (see :mod:`megalite.checkpoint.tokenizer_export`).
    """
    limit = parse_size(max_shard_size)
    config, tensors, state = read_global_tensors(path)
    hf_config, hf_tensors = megalite_to_hf(config, tensors, state.get("hf"))
    tokenizer_files, token_ids = run_tokenizer(state.get("args"))
    hf_config.update(token_ids)
    tmp = _fresh_output(output)
    os.makedirs(tmp)
    for source, name in tokenizer_files:
        shutil.copy(source, os.path.join(tmp, name))
    write_hf_tensors(tmp, hf_tensors, limit)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    _move_into_place(tmp, output)
