"""Llama-style families <-> megalite: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` and their MoE relatives ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
``Qwen3MoeForCausalLM``.

All are pre-norm RMSNorm / SwiGLU / RoPE decoders with the same attention tensor names; they differ in
biases (Llama: on every linear layer or none; Qwen2 and Qwen2-MoE: on Q/K/V only; the others: none),
Qwen3's per-head RMSNorm on queries and keys, and sliding-window attention.  Mistral's and Mixtral's
``sliding_window`` (every layer) is megalite's ``window_size + 1``, and so is Qwen2's and Qwen3's when
``use_sliding_window`` puts it on every layer (``max_window_layers`` 0, or every ``layer_types`` entry sliding);
a window shorter than the context on some layers only (or on Qwen-MoE) is an error naming the field.
Each MoE family has the attention of its dense relative (:data:`ATTENTION_OF`); its MoE MLP blocks'
config keys and tensors are :mod:`megalite.moe.hf`'s.

Separate q/k/v projections (grouped-query attention allowed) are interleaved group by group into
megalite's QKV; ``gate_proj`` and ``up_proj`` become the global ``[gate; up]`` fc1.

config.json round trip: :data:`DEFAULTS` is what a config without a key means (the reader uses it),
so the writer adds a key the original did not have only when its value differs from that.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megalite.checkpoint.hf.rope import rope_config, rope_fields
from megalite.checkpoint.hf.tensors import Taker, embedding_group, key_prefix, output_group, output_info
from megalite.moe.hf import HF_MOE_FAMILIES, moe_config_from_hf, moe_config_to_hf, moe_tensor_to_hf, moe_tensors_from_hf

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}
ATTENTION_OF = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
"""The dense family whose attention (biases, Q/K norm, window) each MoE family has."""
PREFIX = "model."
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "qkv_bias": True,
            "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
            "max_window_layers": 28}
_NAMES = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
          "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj",
          "self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm"}


def family_of(config) -> str | None:
    """The model_type a megalite architecture exports as (None: not Llama-style).

    A sliding window makes a Llama a Mistral; Qwen2 and Qwen3 keep their family with a window on every layer.  An MoE model with a shared expert is Qwen2-MoE, one with Q/K norm Qwen3-MoE, else Mixtral;
    :func:`megalite.moe.hf.moe_config_to_hf` names what the chosen family cannot represent.
    """
    if not (config.position_embedding_type == "rope" and config.normalization == "RMSNorm"
            and config.activation == "swiglu" and config.rotary_percent == 1.0 and not config.rotary_interleaved):
        return None
    if config.qk_layernorm:
        dense = None if config.add_bias_linear or config.add_qkv_bias else "qwen3"
    elif config.add_qkv_bias and not config.add_bias_linear:
        dense = "qwen2"
    else:
        dense = "llama"
    if config.window_size is not None and dense == "llama":
        dense = None if config.add_bias_linear else "mistral"
    elif config.window_size is not None and config.moe is not None:
        return None  # Qwen-MoE windows are not converted
    if config.moe is None or dense is None:
        return dense
    if config.moe.shared_expert_intermediate_size is not None:
        return "qwen2_moe" if dense in ("qwen2", "llama") and not config.add_bias_linear else None
    return {"qwen3": "qwen3_moe", "llama": None if config.add_bias_linear else "mixtral", "mistral": "mixtral",
            "qwen2": None}[dense]


def _get(hf: dict, key: str):
    return hf.get(key, DEFAULTS[key])


def _window_size(hf: dict, family: str) -> int | None:
    """GPTConfig.window_size of a config: ``sliding_window - 1`` when the window is shorter than the context (a
    longer one changes nothing) and applies to every layer: always for Mistral and Mixtral; for Qwen2 and Qwen3
    with ``use_sliding_window``, on the layers ``layer_types`` names ``sliding_attention`` (transformers 5) or
    else those from ``max_window_layers`` on.  A window on some layers only (or any for Qwen-MoE, whose windows
    are not converted) is an error naming the field."""
    window, context = hf.get("sliding_window"), hf["max_position_embeddings"]
    if window is None or window >= context:
        return None
    if family != "mistral":
        if not hf.get("use_sliding_window", False):
            return None  # transformers drops the window then
        types, field = hf.get("layer_types"), "layer_types"
        if types is None:
            start, field = hf.get("max_window_layers", DEFAULTS["max_window_layers"]), "max_window_layers"
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(hf["num_hidden_layers"])]
        sliding = [t == "sliding_attention" for t in types]
        if not any(sliding):
            return None
        if hf["model_type"] not in ("qwen2", "qwen3") or not all(sliding):
            raise ValueError(f"{hf['model_type']} {field} asks for per-layer sliding-window attention (sliding_window="
                             f"{window} < max_position_embeddings={context} on layers "
                             f"{[i for i, s in enumerate(sliding) if s]} of {len(sliding)}), which megalite does not "
                             "compute (its window_size applies to every layer)")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{hf['model_type']} sliding_window must be a positive integer or null, got {window!r}")
    return window - 1


def _biases(hf: dict, family: str) -> tuple[bool, bool]:
    """``(add_bias_linear, add_qkv_bias)`` of a config (``family`` is the attention's, see :data:`ATTENTION_OF`)."""
    if hf["model_type"] == "qwen2_moe":
        return False, bool(_get(hf, "qkv_bias"))
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
    attention = ATTENTION_OF.get(family, family)
    if _get(hf, "hidden_act") != "silu":
        raise ValueError(f"{family} hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    if _get(hf, "pretraining_tp") != 1:
        raise ValueError(f"{family} pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    bias, qkv_bias = _biases(hf, attention)
    moe, moe_layer_freq = moe_config_from_hf(hf) if family in HF_MOE_FAMILIES else (None, 1)
    h, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    groups = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    tied = _get(hf, "tie_word_embeddings")
    config = GPTConfig(vocab_size=hf["vocab_size"], num_layers=layers, hidden_size=h, num_attention_heads=heads,
                       num_query_groups=groups, kv_channels=d, ffn_hidden_size=hf["intermediate_size"],
                       max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
                       normalization="RMSNorm", norm_eps=_get(hf, "rms_norm_eps"), activation="swiglu",
                       add_bias_linear=bias, add_qkv_bias=qkv_bias, qk_layernorm=attention == "qwen3",
                       attention_dropout=_get(hf, "attention_dropout"), untie_embeddings_and_output_weights=not tied,
                       window_size=_window_size(hf, attention), moe=moe, moe_layer_freq=moe_layer_freq,
                       **rope_fields(hf))
    config.validate()
    return config


def to_megalite(hf: dict, tensors) -> tuple[object, object, dict]:
    """``(GPTConfig, groups, conversion info)``: ``groups`` yields the global megalite tensors as one dict per
    layer (the embedding first, the final norm and output layer last), reading the inputs of each when reached."""
    config = config_from_hf(hf)
    pre = key_prefix(tensors, PREFIX)
    take = Taker(tensors, f"the {hf['model_type']} checkpoint")
    return config, _groups(config, hf["model_type"], take, pre, set(tensors.keys())), output_info(take, pre)


def _groups(config, family: str, take: Taker, pre: str, names: set):
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    bias, qkv_bias, tied = config.add_bias_linear, config.add_qkv_bias, not config.untie_embeddings_and_output_weights
    r = heads // groups
    yield embedding_group(take, tied, pre + "embed_tokens.weight")
    for i in range(config.num_layers):
        src, dst, out = f"{pre}layers.{i}.", f"decoder.layers.{i}.", {}
        for kind in ["weight"] + (["bias"] if bias or qkv_bias else []):
            q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
            rest = q.shape[1:]
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat(
                [q.reshape(groups, r * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                dim=1).reshape(-1, *rest)
            del q, k, v
            if kind == "bias" and not bias:
                continue
            out[f"{dst}self_attention.linear_proj.{kind}"] = take(f"{src}self_attn.o_proj.{kind}")
            if config.is_moe_layer(i):
                continue
            out[f"{dst}mlp.linear_fc1.{kind}"] = torch.cat([take(f"{src}mlp.gate_proj.{kind}"),
                                                           take(f"{src}mlp.up_proj.{kind}")])
            out[f"{dst}mlp.linear_fc2.{kind}"] = take(f"{src}mlp.down_proj.{kind}")
        if config.is_moe_layer(i):
            moe = moe_tensors_from_hf(take, names, src, family, config.moe)
            out.update({f"{dst}mlp.{name}": tensor for name, tensor in moe.items()})
            del moe
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        if config.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = take(src + "self_attn.q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = take(src + "self_attn.k_norm.weight")
        yield out
        del out
    yield output_group(take, tied, {"decoder.final_layernorm.weight": take(pre + "norm.weight")})


def tensor_to_hf(config, name: str, tensor: torch.Tensor, pre: str, family: str) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face ``(name, tensor)`` pairs of one global megalite tensor of a ``family`` model."""
    top = {"embedding.word_embeddings.weight": pre + "embed_tokens.weight",
           "decoder.final_layernorm.weight": pre + "norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, _, index, rest = name.split(".", 3)
    dst = f"{pre}layers.{index}."
    if rest.startswith("mlp.") and config.is_moe_layer(int(index)):
        return moe_tensor_to_hf(rest[len("mlp."):], tensor, dst, family)
    module, kind = rest.rsplit(".", 1)
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
    attention = ATTENTION_OF.get(family, family)
    if attention == "qwen3":
        values["attention_bias"] = False
    if family == "qwen2_moe":
        values["qkv_bias"] = config.add_qkv_bias
    if attention == "mistral":
        values["sliding_window"] = _sliding_window(config, base)
    if family in ("qwen2", "qwen3"):
        values.update(_qwen_window(config, base))
    if config.moe is not None:
        values.update(_moe_keys(config, base, family))
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


def _sliding_window(config, base: dict) -> int | None:
    """Mistral's/Mixtral's ``sliding_window``: ``window_size + 1``, or without a window the original's value
    when that one covered the whole context (it changes nothing), else null."""
    if config.window_size is not None:
        return config.window_size + 1
    old = base.get("sliding_window")
    return old if old is None or old >= config.max_position_embeddings else None


def _qwen_window(config, base: dict) -> dict:
    """Qwen2's/Qwen3's window keys: with a window_size, a window on every layer; without, the original's keys
    unless they gave one (then ``use_sliding_window`` false)."""
    if config.window_size is None:
        return {"use_sliding_window": False} if base and _window_size(base, base["model_type"]) is not None else {}
    keys = {"use_sliding_window": True, "sliding_window": config.window_size + 1, "max_window_layers": 0}
    if not base or "layer_types" in base:
        keys["layer_types"] = ["sliding_attention"] * config.num_layers
    return keys


def _moe_keys(config, base: dict, family: str) -> dict:
    """The MoE keys of config.json (:func:`megalite.moe.hf.moe_config_to_hf`), named and laid out as in ``base``:
    its expert-count key, and its ``decoder_sparse_step`` / ``mlp_only_layers`` while they give the same MoE
    layers."""
    keys = moe_config_to_hf(config.moe, config.moe_layer_freq, config.num_layers, family)
    if "num_experts" in keys and "num_local_experts" in base and "num_experts" not in base:
        keys["num_local_experts"] = keys.pop("num_experts")  # as transformers 5 writes Qwen3-MoE's count
    if base.get("model_type") == family and "decoder_sparse_step" in keys:
        same = replace(config, moe_layer_freq=moe_config_from_hf(base)[1])
        if all(same.is_moe_layer(i) == config.is_moe_layer(i) for i in range(config.num_layers)):
            del keys["decoder_sparse_step"], keys["mlp_only_layers"]
    return keys
