"""Megatron-LM's saved ``args`` as a megalite :class:`GPTConfig` (the architecture of a Megatron checkpoint).

Megatron-LM stores its parsed command line (an ``argparse.Namespace``, after ``validate_args`` filled in
derived sizes such as ``ffn_hidden_size``, ``kv_channels`` and ``padded_vocab_size``) in every
checkpoint.  These are Megatron's attribute names, not megalite's flags, so they are read here, once,
for every Megatron checkpoint format.  QK layer norm, interleaved RoPE, a QKV-only bias and Llama-3 RoPE
scaling map onto GPTConfig's fields of the same meaning, and Megatron's ``moe_*`` args onto :class:`MoEConfig`
(:func:`moe_config_from_megatron_args`); a feature megalite's GPT cannot compute (MLA, 1p LayerNorm, squared
ReLU, sliding windows, an MoE setting megalite's MoE lacks, ...) is one error naming the arg.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from megalite.models import GPTConfig
from megalite.moe import MoEConfig
from megalite.tensor_parallel import pad_vocab_size

_UNSUPPORTED = (
    ("moe_input_jitter_eps", "MoE input jitter"),
    ("moe_pad_expert_input_to_capacity", "expert inputs padded to capacity"),
    ("moe_router_force_load_balancing", "forced load-balanced routing"),
    ("moe_apply_probs_on_input", "routing probabilities applied to the expert input"),
    ("multi_latent_attention", "multi-latent attention"),
    ("apply_layernorm_1p", "zero-centred (1p) layer norm"),
    ("squared_relu", "squared ReLU"),
    ("apply_residual_connection_post_layernorm", "residuals taken after the layer norm"),
    ("window_size", "sliding-window attention"),
    ("rotary_seq_len_interpolation_factor", "RoPE sequence-length interpolation"),
    ("qk_l2_norm", "QK L2 norm"),
    ("hybrid_override_pattern", "hybrid (Mamba) layers"),
)
"""Args that, when set, describe a model megalite's GPT does not compute."""


def _namespace(args):
    """``args`` as attributes: Megatron's Namespace itself, or a mapping of its fields (e.g. read without pickle)."""
    return argparse.Namespace(**args) if isinstance(args, Mapping) else args


def _arg(args, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def vocabulary_size(args, vocab_size: int | None = None) -> int:
    """The real (unpadded) vocabulary size: ``vocab_size`` when given, else ``args.vocab_size``.

    Megatron-LM sets ``args.vocab_size`` only when the flag was given (a tokenizer otherwise supplies
    it), but always stores ``padded_vocab_size``: the real size must pad to it at the saved TP size.
    """
    args = _namespace(args)
    saved, padded = getattr(args, "vocab_size", None), getattr(args, "padded_vocab_size", None)
    if vocab_size is not None and saved is not None and vocab_size != saved:
        raise ValueError(f"--vocab-size {vocab_size} contradicts the checkpoint's args.vocab_size {saved}")
    size = vocab_size if vocab_size is not None else saved
    if size is None:
        raise ValueError("the checkpoint's args hold no vocab_size (Megatron-LM took it from the tokenizer); pass "
                         f"--vocab-size with the tokenizer's vocabulary size (at most padded_vocab_size {padded})")
    if padded is not None:
        divisible, tp = _arg(args, "make_vocab_size_divisible_by", 128), _arg(args, "tensor_model_parallel_size", 1)
        if pad_vocab_size(size, divisible, tp) != padded:
            raise ValueError(f"vocabulary size {size} pads to {pad_vocab_size(size, divisible, tp)} at "
                             f"make_vocab_size_divisible_by {divisible} x tensor_model_parallel_size {tp}, "
                             f"but the checkpoint's args.padded_vocab_size is {padded}")
    return size


MEGATRON_LLAMA3 = {"rope_scaling": "llama3", "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                   "rope_original_max_position_embeddings": 8192}
"""The RoPE scaling of Megatron-LM's ``--use-rope-scaling``: Llama 3's, at Megatron-Core's fixed frequency factors
and original context (its ``RotaryEmbedding._apply_scaling`` defaults, which no flag changes); only the factor
(``--rope-scaling-factor``) varies."""


def _rope_scaling(args) -> dict:
    """GPTConfig's RoPE-scaling fields of Megatron-LM's ``args`` (none without ``use_rope_scaling``)."""
    if not getattr(args, "use_rope_scaling", False):
        return {}
    return {**MEGATRON_LLAMA3, "rope_scaling_factor": float(_arg(args, "rope_scaling_factor", 8.0))}


def _single(args, name: str, default):
    """Megatron's ``name``, which newer versions also accept as a one-per-loss list: its one value."""
    value = _arg(args, name, default)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"the checkpoint's args.{name}={value!r}: megalite's MoE has one router balancing "
                             "loss")
        value = value[0]
    return value


def moe_config_from_megatron_args(args, activation: str, bias: bool) -> MoEConfig:
    """The MoEConfig of Megatron-LM's ``moe_*`` args (``num_experts`` set); ``activation`` and ``bias`` are the
    dense MLP's, which Megatron's experts share.  The token dispatcher (alltoall, allgather, flex) changes only
    where tokens travel, not the numbers: one Megatron does not have maps to megalite's alltoall."""
    balancing = _single(args, "moe_router_load_balancing_type", "aux_loss")
    aux = float(_single(args, "moe_aux_loss_coeff", 0.0))
    if balancing == "none":
        balancing, aux = "aux_loss", 0.0
    if balancing not in ("aux_loss", "seq_aux_loss"):
        raise ValueError(f"the checkpoint's args.moe_router_load_balancing_type={balancing!r}: megalite's MoE "
                         "implements aux_loss, seq_aux_loss and none")
    dispatcher = _arg(args, "moe_token_dispatcher_type", "allgather")
    return MoEConfig(
        num_experts=args.num_experts, ffn_hidden_size=_arg(args, "moe_ffn_hidden_size", args.ffn_hidden_size),
        topk=_arg(args, "moe_router_topk", 2), activation=activation, add_bias=bias,
        pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        shared_expert_intermediate_size=_arg(args, "moe_shared_expert_intermediate_size"),
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        shared_expert_overlap=bool(getattr(args, "moe_shared_expert_overlap", False)),
        aux_loss_coeff=aux, load_balancing_type=balancing, z_loss_coeff=float(_arg(args, "moe_z_loss_coeff", 0.0)),
        capacity_factor=_arg(args, "moe_expert_capacity_factor"),
        token_drop_policy=_arg(args, "moe_token_drop_policy", "probs"),
        dispatcher=dispatcher if dispatcher == "allgather" else "alltoall",
        grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
        score_function=_arg(args, "moe_router_score_function", "softmax"),
        enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        bias_update_rate=float(_arg(args, "moe_router_bias_update_rate", 1e-3)),
        routed_scaling_factor=float(_arg(args, "moe_router_topk_scaling_factor", 1.0)),
        num_groups=_arg(args, "moe_router_num_groups"), group_topk=_arg(args, "moe_router_group_topk"),
        init_method_std=_arg(args, "init_method_std", 0.02))


def megatron_moe_args(config) -> dict:
    """Megatron-LM's ``moe_*`` args of GPTConfig ``config`` (the inverse of :func:`moe_config_from_megatron_args`;
    ``{"num_experts": None}`` for a dense model).  Megatron's experts share the dense MLP's activation, bias and
    init std: an MoEConfig that differs from the model there has no Megatron-LM flag (ValueError)."""
    moe = config.moe
    if moe is None:
        return {"num_experts": None}
    for field, ours, model in (("activation", moe.activation, config.activation),
                               ("add_bias", moe.add_bias, config.add_bias_linear),
                               ("init_method_std", moe.init_method_std, config.init_method_std)):
        if ours != model:
            raise ValueError(f"the MoE's {field} {ours!r} differs from the model's {model!r}: Megatron-LM's experts "
                             "share the dense MLP's, so it has no flag for this")
    return {"num_experts": moe.num_experts, "moe_ffn_hidden_size": moe.ffn_hidden_size, "moe_router_topk": moe.topk,
            "moe_router_pre_softmax": moe.pre_softmax,
            "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "moe_shared_expert_gate": moe.shared_expert_gate, "moe_shared_expert_overlap": moe.shared_expert_overlap,
            "moe_aux_loss_coeff": moe.aux_loss_coeff, "moe_router_load_balancing_type": moe.load_balancing_type,
            "moe_z_loss_coeff": moe.z_loss_coeff or None, "moe_expert_capacity_factor": moe.capacity_factor,
            "moe_token_drop_policy": moe.token_drop_policy, "moe_token_dispatcher_type": moe.dispatcher,
            "moe_grouped_gemm": moe.grouped_gemm, "moe_router_score_function": moe.score_function,
            "moe_router_enable_expert_bias": moe.enable_expert_bias,
            "moe_router_bias_update_rate": moe.bias_update_rate,
            "moe_router_topk_scaling_factor": None if moe.routed_scaling_factor == 1.0 else moe.routed_scaling_factor,
            "moe_router_num_groups": moe.num_groups, "moe_router_group_topk": moe.group_topk,
            "moe_layer_freq": config.moe_layer_freq}


def _moe(args, activation: str, bias: bool) -> dict:
    """GPTConfig's MoE fields of Megatron-LM's ``args`` (none without ``num_experts``)."""
    if not getattr(args, "num_experts", None):
        return {}
    return {"moe": moe_config_from_megatron_args(args, activation, bias),
            "moe_layer_freq": _arg(args, "moe_layer_freq", 1)}


def config_from_megatron_args(args, vocab_size: int | None = None) -> GPTConfig:
    """The GPTConfig of the model Megatron-LM's ``args`` (a Namespace or a mapping) describe (``vocab_size``: see
    :func:`vocabulary_size`)."""
    args = _namespace(args)
    for name, what in _UNSUPPORTED:
        if getattr(args, name, None):
            raise ValueError(f"the checkpoint's args.{name}={getattr(args, name)!r} ({what}): megalite's GPT "
                             "does not implement it")
    softmax = _arg(args, "softmax_type", "vanilla")
    if softmax != "vanilla":
        raise ValueError(f"the checkpoint's args.softmax_type={softmax!r}: megalite's attention uses the vanilla "
                         "softmax")
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ValueError(f"the checkpoint's args.position_embedding_type={position!r}: megalite implements "
                         "learned_absolute and rope")
    bias = _arg(args, "add_bias_linear", True)
    heads = args.num_attention_heads
    activation = "swiglu" if getattr(args, "swiglu", False) else "gelu_tanh" if getattr(args, "openai_gelu",
                                                                                         False) else "gelu"
    config = GPTConfig(
        vocab_size=vocabulary_size(args, vocab_size), num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else heads,
        kv_channels=_arg(args, "kv_channels", args.hidden_size // heads),
        max_position_embeddings=_arg(args, "max_position_embeddings", getattr(args, "seq_length", None)),
        position_embedding_type=position, rotary_base=_arg(args, "rotary_base", 10000),
        rotary_percent=_arg(args, "rotary_percent", 1.0),
        rotary_interleaved=bool(getattr(args, "rotary_interleaved", False)), **_rope_scaling(args),
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)) and not bias,
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)), normalization=_arg(args, "normalization", "LayerNorm"),
        norm_eps=_arg(args, "norm_epsilon", 1e-5), activation=activation, add_bias_linear=bias,
        hidden_dropout=_arg(args, "hidden_dropout", 0.1), attention_dropout=_arg(args, "attention_dropout", 0.1),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        init_method_std=_arg(args, "init_method_std", 0.02),
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", 128),
        mtp_num_layers=_arg(args, "mtp_num_layers"), mtp_loss_scaling_factor=_arg(args, "mtp_loss_scaling_factor", 0.1),
        **_moe(args, activation, bias))
    try:
        config.validate()
    except ValueError as err:
        raise ValueError(f"the checkpoint's args do not describe a model megalite can build: {err}") from None
    return config
