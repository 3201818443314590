"""The one architecture comparison: which config fields must match for saved weights to mean the same model.

A checkpoint stores its :class:`GPTConfig` as plain data (:func:`config_to_dict`).  Loading it into a
model, or resuming a run from it, is only right when every field that fixes the weights' shapes or
the function they compute is equal: those are :data:`ARCHITECTURE_FIELDS` (and, for MoE layers,
:data:`MOE_ARCHITECTURE_FIELDS`).  Fields that only change how a model trains or runs (dropout,
recompute, init, vocabulary padding, routing losses, dispatcher) are free to differ.  The
checkpoint loader and the trainer both call :func:`compare_architecture`; each words the
differences for its own user (the trainer names flags).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megalite.models.config import GPTConfig
from megalite.moe import MoEConfig

ARCHITECTURE_FIELDS = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type",
                       "rotary_base", "rotary_percent", "rotary_interleaved", "rope_scaling", "rope_scaling_factor",
                       "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
                       "yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor", "yarn_truncate", "yarn_mscale",
                       "yarn_mscale_all_dim", "normalization", "norm_eps", "activation", "add_bias_linear",
                       "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "moe_layer_freq",
                       "window_size", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                       "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers")
"""GPTConfig fields that fix the model's weights or its function."""
MOE_ARCHITECTURE_FIELDS = ("num_experts", "ffn_hidden_size", "topk", "activation", "add_bias", "pre_softmax",
                           "shared_expert_intermediate_size", "shared_expert_gate", "score_function",
                           "enable_expert_bias", "routed_scaling_factor", "num_groups", "group_topk")
"""MoEConfig fields that fix the experts' weights or the routing function."""


class Difference(NamedTuple):
    """One architecture field that differs: ``field`` is a GPTConfig field or ``moe.<MoEConfig field>``."""

    field: str
    saved: object
    current: object


def config_to_dict(config: GPTConfig | None) -> dict | None:
    """``config`` (with its MoEConfig) as plain JSON data."""
    return None if config is None else dataclasses.asdict(config)


def _build(cls, values: dict, what: str):
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"the saved {what} has fields this megalite does not know: {', '.join(unknown)}")
    return cls(**values)


def config_from_dict(values: dict) -> GPTConfig:
    """The GPTConfig saved by :func:`config_to_dict`; fields added since it was written take their defaults."""
    values = dict(values)
    moe = values.pop("moe", None)
    config = _build(GPTConfig, values, "GPTConfig")
    if moe is not None and "router_order" in moe:
        # Written before ``pre_softmax``: both router orders ("softmax_topk", "topk_softmax") renormalised
        # the top-k weights, which is pre_softmax=False.
        moe = {k: v for k, v in moe.items() if k != "router_order"}
    config.moe = None if moe is None else _build(MoEConfig, moe, "MoEConfig")
    return config


def architecture_values(config: GPTConfig) -> dict[str, object]:
    """``{field: value}`` of every architecture field of ``config`` (MoE fields as ``moe.<field>``;
    ``moe.num_experts`` is None for a dense model)."""
    values = {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}
    if config.moe is None:
        values["moe.num_experts"] = None
    else:
        values.update({f"moe.{name}": getattr(config.moe, name) for name in MOE_ARCHITECTURE_FIELDS})
    return values


def compare_architecture(saved: GPTConfig, current: GPTConfig) -> list[Difference]:
    """Every architecture field where ``saved`` and ``current`` differ, in field order (empty: the same model).

    When only one of them has MoE layers, that is the one difference ``moe.num_experts`` (a number
    against None).
    """
    old, new = architecture_values(saved), architecture_values(current)
    return [Difference(name, old[name], new[name]) for name in old if name in new and old[name] != new[name]]
