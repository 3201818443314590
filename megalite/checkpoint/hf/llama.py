"""Llama-style dense families <-> megalite: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``.

All four are pre-norm RMSNorm / SwiGLU / RoPE decoders with the same tensor names; they differ in
biases (Llama: on every linear layer or none; Qwen2: on Q/K/V only; Qwen3 and Mistral: none),
Qwen3's per-head RMSNorm on queries and keys, and sliding-window attention (Mistral, Qwen), which
megalite does not compute yet: a window shorter than the context is an error naming the field.

Separate q/k/v projections (grouped-query attention allowed) are interleaved group by group into
megalite's QKV; ``gate_proj`` and ``up_proj`` become the global ``[gate; up]`` fc1.

config.json round trip: :data:`DEFAULTS` is what a config without a key means (the reader uses it),
so the writer adds a key the original did not have only when its value differs from that.
"""

from __future__ import annotations

import torch

from megalite.checkpoint.hf.rope import rope_config, rope_fields
from megalite.checkpoint.hf.tensors import Taker, finish_output_layer, key_prefix

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
PREFIX = "model."
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
_NAMES = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
          "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj",
          "self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm"}


def family_of(config) -> str | None:
    """The model_type a megalite architecture exports as (None: not Llama-style)."""
    if not (config.position_embedding_type == "rope" and config.normalization == "RMSNorm"
            and config.activation == "swiglu" and config.rotary_percent == 1.0 and not config.rotary_interleaved):
        return None
    if config.qk_layernorm:
        return None if config.add_bias_linear or config.add_qkv_bias else "qwen3"
    if config.add_qkv_bias and not config.add_bias_linear:
        return "qwen2"
    return "llama"


def _get(hf: dict, key: str):
    return hf.get(key, DEFAULTS[key])


def _check_window(hf: dict, family: str) -> None:
    """Sliding windows are fmoe's feature; until it lands one shorter than the context is refused."""
    window, context = hf.get("sliding_window"), hf["max_position_embeddings"]
    if family == "mistral":
        used, field = window is not None, "sliding_window"
    else:
        used = hf.get("use_sliding_window", False) or any(t != "full_attention" for t in hf.get("layer_types") or [])
        field = "use_sliding_window" if hf.get("use_sliding_window") else "layer_types"
    if used and window is not None and window < context:
        raise ValueError(f"{family} {field} asks for sliding-window attention (sliding_window={window} < "
                         f"max_position_embeddings={context}), which megalite does not compute yet")


def _biases(hf: dict, family: str) -> tuple[bool, bool]:
    """``(add_bias_linear, add_qkv_bias)`` of a config."""
    if family == "qwen2":
        return False, True
    if family == "mistral":
        return False, False
    attention = bool(_get(hf, "attention_bias"))
    if family == "qwen3":
        if attention:
            raise ValueError("qwen3 attention_bias=true (biases on q/k/v/o but not the MLP) is not supported")
        return False, False
    if bool(_get(hf, "mlp_bias")) != attention:
        raise ValueError(f"llama attention_bias={attention} with mlp_bias={hf.get('mlp_bias')} is not supported: "
                         "megalite puts biases on every linear layer or on none")
    return attention, False


def config_from_hf(hf: dict):
    """The GPTConfig of a Llama-style config.json (ValueError naming a field it cannot represent)."""
    from megalite.models import GPTConfig

    family = hf["model_type"]
    if _get(hf, "hidden_act") != "silu":
        raise ValueError(f"{family} hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    if _get(hf, "pretraining_tp") != 1:
        raise ValueError(f"{family} pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    _check_window(hf, family)
    bias, qkv_bias = _biases(hf, family)
    h, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    groups = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    tied = _get(hf, "tie_word_embeddings")
    config = GPTConfig(vocab_size=hf["vocab_size"], num_layers=layers, hidden_size=h, num_attention_heads=heads,
                       num_query_groups=groups, kv_channels=d, ffn_hidden_size=hf["intermediate_size"],
                       max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
                       normalization="RMSNorm", norm_eps=_get(hf, "rms_norm_eps"), activation="swiglu",
                       add_bias_linear=bias, add_qkv_bias=qkv_bias, qk_layernorm=family == "qwen3",
                       attention_dropout=_get(hf, "attention_dropout"), untie_embeddings_and_output_weights=not tied,
                       **rope_fields(hf))
    config.validate()
    return config


def to_megalite(hf: dict, tensors) -> tuple[object, dict, dict]:
    config = config_from_hf(hf)
    family, heads, groups, d = hf["model_type"], config.num_attention_heads, config.num_query_groups, config.kv_channels
    bias, qkv_bias, tied = config.add_bias_linear, config.add_qkv_bias, not config.untie_embeddings_and_output_weights
    pre = key_prefix(tensors, PREFIX)
    take = Taker(tensors, f"the {family} checkpoint")
    r = heads // groups
    out = {"embedding.word_embeddings.weight": take(pre + "embed_tokens.weight")}
    for i in range(config.num_layers):
        src, dst = f"{pre}layers.{i}.", f"decoder.layers.{i}."
        for kind in ["weight"] + (["bias"] if bias or qkv_bias else []):
            q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
            rest = q.shape[1:]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(
                [q.reshape(groups, r * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                dim=1).reshape(-1, *rest)
            if kind == "bias" and not bias:
                continue
            out[f"{dst}self_attention.linear_proj.{kind}"] = take(f"{src}self_attn.o_proj.{kind}")
            out[f"{dst}mlp.linear_fc1.{kind}"] = torch.cat([take(f"{src}mlp.gate_proj.{kind}"),
                                                           take(f"{src}mlp.up_proj.{kind}")])
            out[f"{dst}mlp.linear_fc2.{kind}"] = take(f"{src}mlp.down_proj.{kind}")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        if config.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = take(src + "self_attn.q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = take(src + "self_attn.k_norm.weight")
    out["decoder.final_layernorm.weight"] = take(pre + "norm.weight")
    return config, out, finish_output_layer(take, out, tied, pre, "embed_tokens.weight")


def tensor_to_hf(config, name: str, tensor: torch.Tensor, pre: str) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face ``(name, tensor)`` pairs of one global megalite tensor."""
    top = {"embedding.word_embeddings.weight": pre + "embed_tokens.weight",
           "decoder.final_layernorm.weight": pre + "norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    dst = f"{pre}layers.{index}."
    if module == "self_attention.linear_qkv":
        groups, d = config.num_query_groups, config.kv_channels
        r, shape = config.num_attention_heads // groups, tensor.shape[1:]
        q, k, v = tensor.reshape(groups, (r + 2) * d, *shape).split([r * d, d, d], dim=1)
        return [(f"{dst}self_attn.{p}_proj.{kind}", t.reshape(-1, *shape)) for p, t in (("q", q), ("k", k), ("v", v))]
    if module == "mlp.linear_fc1":
        gate, up = tensor.chunk(2)
        return [(f"{dst}mlp.gate_proj.{kind}", gate), (f"{dst}mlp.up_proj.{kind}", up)]
    return [(f"{dst}{_NAMES[module]}.{kind}", tensor)]


def hf_config(config, base: dict, family: str) -> dict:
    """config.json of ``config`` as ``family``, keeping ``base``'s other keys and its set of keys."""
    h, heads = config.hidden_size, config.num_attention_heads
    values = {"vocab_size": config.vocab_size, "hidden_size": h, "intermediate_size": config.ffn_hidden_size,
              "num_hidden_layers": config.num_layers, "num_attention_heads": heads,
              "num_key_value_heads": config.num_query_groups, "hidden_act": "silu",
              "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_eps,
              "attention_dropout": config.attention_dropout,
              "tie_word_embeddings": not config.untie_embeddings_and_output_weights}
    if family == "llama":
        values.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    if family == "qwen3":
        values["attention_bias"] = False
    fresh = not base
    hf = {**base, "model_type": family, "architectures": base.get("architectures", [FAMILIES[family]])}
    for key, value in values.items():
        if fresh or key in base or value != DEFAULTS.get(key, object()):
            hf[key] = value
    if fresh or config.kv_channels * heads != h or base.get("head_dim") is not None:
        hf["head_dim"] = config.kv_channels
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        hf.pop(key, None)
    hf.update(rope_config(config, base))
    return hf
