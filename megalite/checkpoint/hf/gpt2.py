"""GPT-2 (``GPT2LMHeadModel``) <-> megalite: config.json and tensor names.

GPT-2 uses Conv1D, whose weights are ``[in, out]``: they are transposed.  Its fused ``c_attn`` is
``[q; k; v]`` over all heads; megalite's grouped QKV is ``[q_0, k_0, v_0, q_1, ...]`` per head.
"""

from __future__ import annotations

import torch

from megalite.checkpoint.hf.tensors import Taker, embedding_group, key_prefix, output_group, output_info

PREFIX = "transformer."
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_NAMES = {"input_layernorm": "ln_1", "pre_mlp_layernorm": "ln_2", "self_attention.linear_proj": "attn.c_proj",
          "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def matches(config) -> bool:
    """Whether a megalite architecture is a GPT-2."""
    return (config.position_embedding_type == "learned_absolute" and config.normalization == "LayerNorm"
            and config.add_bias_linear and config.activation in ("gelu", "gelu_tanh")
            and config.num_query_groups == config.num_attention_heads
            and config.kv_channels * config.num_attention_heads == config.hidden_size and not config.qk_layernorm)


def config_from_hf(hf: dict):
    """The ``GPTConfig`` of a GPT-2 ``config.json`` (ValueError for what megalite cannot express)."""
    from megalite.models import GPTConfig

    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function {activation!r} is not one of {sorted(ACTIVATIONS)}")
    for flag, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if hf.get(flag, wanted) != wanted:
            raise ValueError(f"GPT-2 {flag}={hf[flag]} is not supported (megalite needs {wanted})")
    h, heads, layers = hf["n_embd"], hf["n_head"], hf["n_layer"]
    tied = hf.get("tie_word_embeddings", True)
    config = GPTConfig(vocab_size=hf["vocab_size"], num_layers=layers, hidden_size=h, num_attention_heads=heads,
                       ffn_hidden_size=hf.get("n_inner") or 4 * h, max_position_embeddings=hf["n_positions"],
                       norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=ACTIVATIONS[activation],
                       hidden_dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
                       untie_embeddings_and_output_weights=not tied)
    config.validate()
    return config


def to_megalite(hf: dict, tensors) -> tuple[object, object, dict]:
    """``(GPTConfig, groups, conversion info)``: ``groups`` yields the global megalite tensors as one dict per
    layer (the embeddings first, the final norm and output layer last), reading the inputs of each when reached."""
    config = config_from_hf(hf)
    pre = key_prefix(tensors, PREFIX)
    take = Taker(tensors, "the GPT-2 checkpoint")
    return config, _groups(config, take, pre), output_info(take, pre)


def _groups(config, take: Taker, pre: str):
    h, heads, layers = config.hidden_size, config.num_attention_heads, config.num_layers
    tied = not config.untie_embeddings_and_output_weights
    d = h // heads
    yield {**embedding_group(take, tied, pre + "wte.weight"),
           "embedding.position_embeddings.weight": take(pre + "wpe.weight")}
    for i in range(layers):
        src, dst = f"{pre}h.{i}.", f"decoder.layers.{i}."
        qkv_w, qkv_b = take(src + "attn.c_attn.weight").t(), take(src + "attn.c_attn.bias")
        yield {
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
        }
        del qkv_w, qkv_b
    yield output_group(take, tied, {"decoder.final_layernorm.weight": take(pre + "ln_f.weight"),
                                    "decoder.final_layernorm.bias": take(pre + "ln_f.bias")})


def tensor_to_hf(config, name: str, tensor: torch.Tensor, pre: str) -> list[tuple[str, torch.Tensor]]:
    """The GPT-2 ``(name, tensor)`` pairs of one global megalite tensor."""
    top = {"embedding.word_embeddings.weight": pre + "wte.weight",
           "embedding.position_embeddings.weight": pre + "wpe.weight",
           "decoder.final_layernorm.weight": pre + "ln_f.weight", "decoder.final_layernorm.bias": pre + "ln_f.bias",
           "output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], tensor)]
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    dst = f"{pre}h.{index}."
    if module == "self_attention.linear_qkv":
        heads, d, shape = config.num_attention_heads, config.kv_channels, tensor.shape[1:]
        q, k, v = (t.reshape(-1, *shape) for t in tensor.reshape(heads, 3 * d, *shape).split([d, d, d], dim=1))
        pairs = [(f"{dst}attn.c_attn.{kind}", torch.cat([q, k, v]))]
    else:
        pairs = [(f"{dst}{_NAMES[module]}.{kind}", tensor)]
    if kind == "weight":
        pairs = [(n, t.t() if n[len(dst):-len(".weight")] in _CONV1D else t) for n, t in pairs]
    return pairs


def hf_config(config, base: dict) -> dict:
    h = config.hidden_size
    inner = None if config.ffn_hidden_size == 4 * h else config.ffn_hidden_size
    activation = base.get("activation_function")
    if ACTIVATIONS.get(activation) != config.activation:
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
