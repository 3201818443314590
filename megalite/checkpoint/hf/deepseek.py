"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) checkpoints to and from megalite's global tensors.

Multi-latent attention maps one to one onto megalite's MLA (``models/mla.py``): ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj`` and ``o_proj`` are Megatron-Core's ``linear_q_down_proj`` / ``q_layernorm`` /
``linear_q_up_proj`` (``linear_q_proj``), ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``
and ``linear_proj``, with the same row layout.  With ``rope_interleave`` (DeepSeek's own layout) the
rotary channels of a head come as pairs ``(x0, x1), (x2, x3), ...``; megalite rotates halves, so those
rows are reordered evens-then-odds, which leaves every attention score unchanged.  The MoE part is
``megalite.moe.hf``'s; dense first layers are the model's SwiGLU MLP.  megalite writes
``rope_interleave: false`` and its own (rotate-half) row order, the same function.  RoPE settings (YaRN
with ``mscale``/``mscale_all_dim``) are :mod:`.rope`'s, as for every family.

Multi-token prediction depth ``k`` is stored as the published checkpoint stores it, as layer
``num_hidden_layers + k`` (``num_nextn_predict_layers`` of them; transformers' ``DeepseekV3ForCausalLM``
skips them, its ``MtpModel`` reads them): a decoder layer's tensors plus ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (megalite's ``final_layernorm``) and copies of the shared ``embed_tokens`` and
``shared_head.head`` (the output layer), which megalite shares and so reads only to check they are copies.
Only the depths whose tensors are present are read (a checkpoint saved by transformers has none).
"""

from __future__ import annotations

import torch

from megalite.checkpoint.hf.rope import rope_config, rope_fields
from megalite.checkpoint.hf.tensors import Taker, embedding_group, key_prefix, output_group, output_info
from megalite.moe.hf import moe_config_from_hf, moe_tensor_to_hf, moe_tensors_from_hf

FAMILY = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
PREFIX = "model."

_TOP = {"embedding.word_embeddings.weight": "embed_tokens.weight", "decoder.final_layernorm.weight": "norm.weight"}
_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
          "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
          "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
          "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
          "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
          "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
          "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
          "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
          "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
          "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
"""megalite names (under ``decoder.layers.{i}.``) of one layer and their Hugging Face names (under ``layers.{i}.``)."""
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight"}
"""megalite names (under ``mtp.layers.{k}.``) of a prediction depth's own tensors and their Hugging Face names
(under ``layers.{num_hidden_layers + k}.``)."""
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""A depth's copies of the shared embedding and output head (under ``layers.{num_hidden_layers + k}.``)."""


def config_from_hf(hf: dict):
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
        moe=moe if any(pattern) else None, moe_layer_freq=pattern, **rope_fields(hf))
    config.validate()
    return config


def _deinterleave(weight: torch.Tensor, blocks: int, nope: int, rope: int) -> torch.Tensor:
    """Reorder the rotary rows ``nope .. nope+rope`` of each of ``blocks`` row blocks evens-then-odds."""
    rows = weight.view(blocks, nope + rope, -1)
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + nope
    return torch.cat([rows[:, :nope], rows[:, order]], dim=1).reshape(weight.shape)


def _layer_to_megalite(take: Taker, names: set, src: str, dst: str, config, layer: int, interleaved: bool) -> dict:
    """megalite's tensors (under ``dst``) of the Hugging Face decoder layer under ``src``, global number ``layer``."""
    heads, nope, rope = config.num_attention_heads, config.qk_head_dim, config.qk_pos_emb_head_dim
    out = {}
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
    if config.is_moe_layer(layer):
        for name, tensor in moe_tensors_from_hf(take, names, src, FAMILY, config.moe).items():
            out[dst + "mlp." + name] = tensor
    else:
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"),
                                                        take(src + "mlp.up_proj.weight")])
        out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    return out


def _mtp_depths(take: Taker, pre: str, num_layers: int) -> int:
    """How many multi-token prediction layers the checkpoint holds (layers ``num_layers`` on with an ``eh_proj``)."""
    depths = 0
    while f"{pre}layers.{num_layers + depths}.eh_proj.weight" in take:
        depths += 1
    return depths


def to_megalite(hf: dict, tensors) -> tuple[object, list[dict], dict]:
    """``(GPTConfig, groups, conversion info)`` of a DeepSeek-V3 checkpoint's config and tensors: one group of
    every global tensor (the prediction depths' count is known only after reading them, so this family is
    converted whole, not layer by layer)."""
    config = config_from_hf(hf)
    pre, names = key_prefix(tensors, PREFIX), set(tensors.keys())
    take = Taker(tensors, "the DeepSeek-V3 checkpoint")
    info = output_info(take, pre)
    tied = not config.untie_embeddings_and_output_weights
    interleaved = hf.get("rope_interleave", True)
    out = embedding_group(take, tied, pre + "embed_tokens.weight")
    for i in range(config.num_layers):
        out.update(_layer_to_megalite(take, names, f"{pre}layers.{i}.", f"decoder.layers.{i}.", config, i, interleaved))
    out["decoder.final_layernorm.weight"] = take(pre + "norm.weight")
    depths = _mtp_depths(take, pre, config.num_layers)
    copies = []
    if depths:
        config.mtp_num_layers = depths
        config.validate()
    for k in range(depths):
        src, dst = f"{pre}layers.{config.num_layers + k}.", f"mtp.layers.{k}."
        for mine, theirs in _MTP.items():
            out[dst + mine] = take(src + theirs)
        out.update(_layer_to_megalite(take, names, src, dst + "transformer_layer.", config, config.num_layers + k,
                                      interleaved))
        copies += [(src + name, take(src + name)) for name in _MTP_SHARED if src + name in take]
    output_group(take, tied, out)
    for name, tensor in copies:
        head = name.endswith("head.weight") and not tied
        shared = "output_layer.weight" if head else "embedding.word_embeddings.weight"
        if not tensor.is_meta and not torch.equal(tensor, out[shared]):
            raise ValueError(f"{name} differs from the model's {shared.split('.')[0]} weights; megalite shares "
                             "the embedding and output head with the multi-token prediction layers")
    return config, [out], info


def hf_config(config, base: dict) -> dict:
    """The ``config.json`` of a megalite MLA model (MoE with sigmoid routing, or dense) as DeepSeek-V3."""
    moe, pattern = config.moe, [int(config.is_moe_layer(i)) for i in range(config.num_layers)]
    dense = pattern.index(1) if 1 in pattern else config.num_layers
    problems = []
    if config.activation != "swiglu" or config.normalization != "RMSNorm" or config.add_bias_linear:
        problems.append("needs swiglu, RMSNorm and no biases")
    if pattern != [0] * dense + [1] * (config.num_layers - dense):
        problems.append(f"MoE layers {pattern} are not dense first layers then MoE")
    if moe is not None and (moe.score_function != "sigmoid" or not moe.enable_expert_bias
                            or moe.activation != "swiglu" or moe.add_bias or moe.shared_expert_gate
                            or (moe.num_groups is not None and moe.topk // moe.group_topk != 2)):
        problems.append("MoE needs sigmoid routing with an expert bias, SwiGLU experts without bias, an ungated "
                        "shared expert, and groups scored by their best 2 experts")
    shared = None if moe is None else moe.shared_expert_intermediate_size
    if shared is not None and shared % moe.ffn_hidden_size:
        problems.append(f"shared expert size {shared} is not a multiple of the expert size {moe.ffn_hidden_size}")
    if config.mtp_num_layers and moe is None:
        problems.append("its multi-token prediction layers would be dense (DeepSeek-V3's are MoE)")
    if problems:
        raise ValueError("deepseek_v3 cannot represent this model: " + "; ".join(problems))
    hf = {**base, "model_type": FAMILY, "architectures": base.get("architectures", [ARCHITECTURE]),
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_attention_heads,
          "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
          "qk_nope_head_dim": config.qk_head_dim, "qk_rope_head_dim": config.qk_pos_emb_head_dim,
          "v_head_dim": config.v_head_dim, "head_dim": config.qk_pos_emb_head_dim, "hidden_act": "silu",
          "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_eps,
          "attention_bias": False, "attention_dropout": config.attention_dropout, "rope_interleave": False,
          "tie_word_embeddings": not config.untie_embeddings_and_output_weights, "first_k_dense_replace": dense,
          "num_nextn_predict_layers": config.mtp_num_layers or 0}
    hf.pop("num_mtp_layers", None)
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        hf.pop(key, None)
    hf.update(rope_config(config, base))
    if moe is not None:
        hf.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                  moe_intermediate_size=moe.ffn_hidden_size, routed_scaling_factor=moe.routed_scaling_factor,
                  n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1, norm_topk_prob=True,
                  n_shared_experts=0 if shared is None else shared // moe.ffn_hidden_size)
    return hf


def tensor_to_hf(config, name: str, tensor: torch.Tensor, pre: str) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face ``(name, tensor)`` pairs of one global megalite tensor of an MLA model (the shared
    embedding and output layer also as each prediction depth's copies)."""
    depths = [f"{pre}layers.{config.num_layers + k}." for k in range(config.mtp_num_layers or 0)]
    tied = not config.untie_embeddings_and_output_weights
    if name == "embedding.word_embeddings.weight":
        pairs = [(pre + _TOP[name], tensor)]
        for mtp in depths:
            pairs.append((mtp + "embed_tokens.weight", tensor.clone()))
            if tied:
                pairs.append((mtp + "shared_head.head.weight", tensor.clone()))
        return pairs
    if name in _TOP:
        return [(pre + _TOP[name], tensor)]
    if name == "output_layer.weight":
        return [("lm_head.weight", tensor)] + [(mtp + "shared_head.head.weight", tensor.clone()) for mtp in depths]
    if name.startswith("mtp.layers."):
        _, _, index, rest = name.split(".", 3)
        dst = depths[int(index)]
        if rest in _MTP:
            return [(dst + _MTP[rest], tensor)]
        rest = rest[len("transformer_layer."):]
    else:
        _, _, index, rest = name.split(".", 3)
        dst = f"{pre}layers.{index}."
    if rest in _LAYER:
        return [(dst + _LAYER[rest], tensor)]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return [(dst + "mlp.gate_proj.weight", gate), (dst + "mlp.up_proj.weight", up)]
    return moe_tensor_to_hf(rest[len("mlp."):], tensor, dst, FAMILY)
