"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) checkpoints read into megalite's global tensors.

Multi-latent attention maps one to one onto megalite's MLA (``models/mla.py``): ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj`` and ``o_proj`` are Megatron-Core's ``linear_q_down_proj`` / ``q_layernorm`` /
``linear_q_up_proj`` (``linear_q_proj``), ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``
and ``linear_proj``, with the same row layout.  With ``rope_interleave`` (DeepSeek's own layout) the
rotary channels of a head come as pairs ``(x0, x1), (x2, x3), ...``; megalite rotates halves, so those
rows are reordered evens-then-odds, which leaves every attention score unchanged.  The MoE part is
``megalite.moe.hf``'s; dense first layers are the model's SwiGLU MLP.
"""

from __future__ import annotations

import torch

from megalite.moe.hf import moe_config_from_hf, moe_tensors_from_hf


def _rope_fields(hf: dict) -> dict:
    """GPTConfig's rotary fields of a DeepSeek-V3 ``rope_parameters`` (or older ``rope_scaling``)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rotary_base": base}
    if kind != "yarn" or rope.get("attention_factor") is not None:
        raise ValueError(f"deepseek_v3 rope {rope} is not supported (the default rotary embedding or YaRN without an "
                         "explicit attention_factor)")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then scales the tables by yarn_mscale(factor, 1)
        mscale, mscale_all_dim = 1.0, mscale_all_dim or 0.0
    return {"rotary_base": base, "rope_type": "yarn", "rotary_scaling_factor": float(rope["factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim)}


def deepseek_v3_config(hf: dict):
    """The GPTConfig (with its MoEConfig) of a DeepSeek-V3 ``config.json`` (a dict)."""
    from megalite.models import GPTConfig

    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
        raise ValueError(f"deepseek_v3 hidden_act={hf.get('hidden_act')!r}, attention_bias={hf.get('attention_bias')} "
                         "is not supported (megalite needs silu and no attention bias)")
    moe, pattern = moe_config_from_hf(hf)
    heads = hf["num_attention_heads"]
    config = GPTConfig(
        vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], position_embedding_type="rope",
        normalization="RMSNorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", add_bias_linear=False,
        attention_dropout=hf.get("attention_dropout", 0.0),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        moe=moe if any(pattern) else None, moe_layer_freq=pattern, **_rope_fields(hf))
    config.validate()
    return config


def _deinterleave(weight: torch.Tensor, blocks: int, nope: int, rope: int) -> torch.Tensor:
    """Reorder the rotary rows ``nope .. nope+rope`` of each of ``blocks`` row blocks evens-then-odds."""
    rows = weight.view(blocks, nope + rope, -1)
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + nope
    return torch.cat([rows[:, :nope], rows[:, order]], dim=1).reshape(weight.shape)


def deepseek_v3_to_megalite(hf: dict, take, names, pre: str) -> tuple[object, dict]:
    """``(GPTConfig, global tensors)`` of a DeepSeek-V3 checkpoint; ``take(name)`` reads one HF tensor."""
    config = deepseek_v3_config(hf)
    heads, nope, rope = config.num_attention_heads, config.qk_head_dim, config.qk_pos_emb_head_dim
    interleaved = hf.get("rope_interleave", True)
    out = {"embedding.word_embeddings.weight": take(pre + "embed_tokens.weight")}
    for i in range(config.num_layers):
        src, dst = f"{pre}layers.{i}.", f"decoder.layers.{i}."
        attn, mine = src + "self_attn.", dst + "self_attention."
        if config.q_lora_rank is None:
            q_name, q = mine + "linear_q_proj.weight", take(attn + "q_proj.weight")
        else:
            q_name, q = mine + "linear_q_up_proj.weight", take(attn + "q_b_proj.weight")
            out[mine + "linear_q_down_proj.weight"] = take(attn + "q_a_proj.weight")
            out[mine + "q_layernorm.weight"] = take(attn + "q_a_layernorm.weight")
        kv_down = take(attn + "kv_a_proj_with_mqa.weight")
        if interleaved:
            q = _deinterleave(q, heads, nope, rope)
            kv_down = _deinterleave(kv_down, 1, config.kv_lora_rank, rope)
        out[q_name], out[mine + "linear_kv_down_proj.weight"] = q, kv_down
        out[mine + "kv_layernorm.weight"] = take(attn + "kv_a_layernorm.weight")
        out[mine + "linear_kv_up_proj.weight"] = take(attn + "kv_b_proj.weight")
        out[mine + "linear_proj.weight"] = take(attn + "o_proj.weight")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        if config.is_moe_layer(i):
            for name, tensor in moe_tensors_from_hf(take, names, src, "deepseek_v3", config.moe).items():
                out[dst + "mlp." + name] = tensor
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"),
                                                            take(src + "mlp.up_proj.weight")])
            out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take(pre + "norm.weight")
    return config, out
