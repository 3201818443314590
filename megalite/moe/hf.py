"""Hugging Face MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) in megalite's MoE terms: config and weights.

The checkpoint converter calls these for the MoE part of a layer; everything else about the
families (attention, norms, embeddings) is the converter's.

Routing: Mixtral renormalises its top-k softmax probabilities, which is megalite's default (top-k
logits softmaxed among themselves); Qwen-MoE does so only with ``norm_topk_prob``, otherwise it
keeps the top-k of the full softmax (``MoEConfig.pre_softmax``).  Qwen2-MoE adds a shared expert
whose output is scaled by ``sigmoid(x . shared_expert_gate)``.  Which layers are MoE: Mixtral all;
Qwen-MoE layer ``i`` when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
``mlp_only_layers``, which megalite writes as a per-layer ``moe_layer_freq`` list.
DeepSeek-V3 routes by sigmoid scores with a balancing bias (``gate.e_score_correction_bias``, megalite's
``router.expert_bias``) among ``topk_group`` of ``n_group`` groups, scaled by ``routed_scaling_factor``;
its shared experts (``shared_experts.``, ungated) and dense first ``first_k_dense_replace`` layers.

Weight names inside one layer (``take`` reads a Hugging Face tensor by its full name):

================================  ==========================================================
megalite (under ``mlp.``)         Hugging Face on disk (under ``mlp.``; Mixtral: ``block_sparse_moe.``)
================================  ==========================================================
``router.weight`` [E, h]          ``gate.weight``
``experts.fc1_weight`` [E, 2f, h] ``experts.{e}.gate_proj`` / ``up_proj`` (Mixtral ``w1`` / ``w3``), as [gate; up]
``experts.fc2_weight`` [E, h, f]  ``experts.{e}.down_proj`` (Mixtral ``w2``)
``shared_experts.linear_fc1``     ``shared_expert.gate_proj`` / ``up_proj``, as [gate; up]
``shared_experts.linear_fc2``     ``shared_expert.down_proj``
``shared_expert_gate`` [1, h]     ``shared_expert_gate.weight``
================================  ==========================================================

transformers >= 5 holds the experts fused in memory (``experts.gate_up_proj`` [E, 2f, h],
``experts.down_proj`` [E, h, f], Mixtral under ``mlp.``); :func:`moe_tensors_from_hf` reads that
layout as well, and :func:`moe_tensor_to_hf` writes the on-disk one, which every reader loads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from megalite.moe.config import MoEConfig

HF_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
HF_MOE_READ_FAMILIES = HF_MOE_FAMILIES + ("deepseek_v3",)
"""``moe_config_to_hf`` writes the first three; DeepSeek-V3's config is ``checkpoint/hf/deepseek.py``'s."""
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_QWEN_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _family(hf: dict, families: tuple[str, ...] = HF_MOE_FAMILIES) -> str:
    kind = hf.get("model_type")
    if kind not in families:
        raise ValueError(f"model_type {kind!r} is not a Hugging Face MoE family megalite knows {families}")
    return kind


def moe_config_from_hf(hf: dict) -> tuple[MoEConfig, int | list[int]]:
    """``(MoEConfig, moe_layer_freq)`` of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json`` (a dict).

    Dropless (no capacity) and no router losses: Hugging Face's training-only aux loss is not
    carried over (set ``--moe-aux-loss-coeff`` to fine-tune with one).
    """
    kind = _family(hf, HF_MOE_READ_FAMILIES)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{kind} hidden_act {hf['hidden_act']!r} is not supported (megalite's SwiGLU uses silu)")
    layers = hf["num_hidden_layers"]
    if kind == "deepseek_v3":
        return _deepseek_config(hf, layers)
    # transformers names it num_local_experts in memory (an attribute alias), Qwen's files num_experts.
    num_experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    if kind == "mixtral":
        config = MoEConfig(num_experts=num_experts, ffn_hidden_size=hf["intermediate_size"],
                           topk=hf["num_experts_per_tok"], activation="swiglu")
        return config, 1
    shared = hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    config = MoEConfig(num_experts=num_experts, ffn_hidden_size=hf["moe_intermediate_size"],
                       topk=hf["num_experts_per_tok"], activation="swiglu",
                       pre_softmax=not hf.get("norm_topk_prob", False), shared_expert_intermediate_size=shared or None,
                       shared_expert_gate=bool(shared))
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{kind} decoder_sparse_step must be a positive integer, got {step!r}")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return config, 1 if all(pattern) else pattern


def _deepseek_config(hf: dict, layers: int) -> tuple[MoEConfig, list[int]]:
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ValueError("deepseek_v3 norm_topk_prob=false is not supported (megalite normalises the top-k weights)")
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(f"deepseek_v3 scores a group by its best 2 experts; megalite (as Megatron-Core) by its best "
                         f"num_experts_per_tok / topk_group = {topk} / {group_topk}: these differ")
    shared = hf.get("n_shared_experts") or 0
    config = MoEConfig(num_experts=hf["n_routed_experts"], ffn_hidden_size=hf["moe_intermediate_size"], topk=topk,
                       activation="swiglu", score_function="sigmoid", enable_expert_bias=True,
                       routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                       num_groups=groups if groups > 1 else None, group_topk=group_topk if groups > 1 else None,
                       shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared if shared else None)
    dense = hf.get("first_k_dense_replace") or 0
    return config, [int(i >= dense) for i in range(layers)]


def moe_config_to_hf(config: MoEConfig, moe_layer_freq: int | list[int], num_layers: int, model_type: str) -> dict:
    """The ``config.json`` keys of the MoE part of ``model_type``; a ValueError names what it cannot represent."""
    kind = _family({"model_type": model_type})
    pattern = [int(bool(moe_layer_freq[i])) if isinstance(moe_layer_freq, list) else int(i % moe_layer_freq == 0)
               for i in range(num_layers)]
    problems = []
    if config.activation != "swiglu" or config.add_bias:
        problems.append(f"experts with activation={config.activation!r}, add_bias={config.add_bias} (needs swiglu, "
                        "no bias)")
    if kind == "mixtral" and (config.pre_softmax or not all(pattern)):
        problems.append(f"pre_softmax={config.pre_softmax}, moe_layer_freq={moe_layer_freq} (Mixtral renormalises "
                        "the top-k weights and has MoE on every layer)")
    shared = config.shared_expert_intermediate_size
    if kind == "qwen2_moe" and (shared is None or not config.shared_expert_gate):
        problems.append(f"shared_expert_intermediate_size={shared}, shared_expert_gate={config.shared_expert_gate} "
                        "(Qwen2-MoE has a gated shared expert)")
    if kind != "qwen2_moe" and shared is not None:
        problems.append(f"shared_expert_intermediate_size={shared} ({kind} has no shared expert)")
    if problems:
        raise ValueError(f"{model_type} cannot represent MoE " + "; ".join(problems))
    keys = {"num_experts_per_tok": config.topk}
    if kind == "mixtral":
        return {**keys, "num_local_experts": config.num_experts, "intermediate_size": config.ffn_hidden_size}
    keys.update(num_experts=config.num_experts, moe_intermediate_size=config.ffn_hidden_size,
                norm_topk_prob=not config.pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if kind == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = shared
    return keys


def _block(model_type: str, names: Collection[str], layer_prefix: str) -> str:
    """The MoE block's name prefix: Mixtral's on-disk ``block_sparse_moe.``, else ``mlp.``."""
    if model_type == "mixtral" and any(n.startswith(layer_prefix + "block_sparse_moe.") for n in names):
        return layer_prefix + "block_sparse_moe."
    return layer_prefix + "mlp."


def moe_tensors_from_hf(take: Callable[[str], torch.Tensor], names: Collection[str], layer_prefix: str,
                        model_type: str, config: MoEConfig) -> dict[str, torch.Tensor]:
    """Global megalite tensors (names under the layer's ``mlp.``) of the HF MoE block of one layer.

    ``layer_prefix`` is the layer's HF prefix (``"model.layers.3."``), ``names`` every HF tensor
    name (to tell the on-disk from the fused layout) and ``take(name)`` returns one tensor.
    """
    kind = _family({"model_type": model_type}, HF_MOE_READ_FAMILIES)
    src = _block(kind, names, layer_prefix)
    out = {"router.weight": take(src + "gate.weight")}
    if src + "experts.gate_up_proj" in names:
        out["experts.fc1_weight"] = take(src + "experts.gate_up_proj")
        out["experts.fc2_weight"] = take(src + "experts.down_proj")
    else:
        part = _MIXTRAL_EXPERT if kind == "mixtral" else _QWEN_EXPERT
        fc1 = fc2 = None
        for e in range(config.num_experts):  # each expert read into the stacked result: no second copy of them all
            expert = f"{src}experts.{e}."
            gate_up = torch.cat([take(f"{expert}{part['gate']}.weight"), take(f"{expert}{part['up']}.weight")])
            down = take(f"{expert}{part['down']}.weight")
            if fc1 is None:
                fc1 = gate_up.new_empty((config.num_experts, *gate_up.shape))
                fc2 = down.new_empty((config.num_experts, *down.shape))
            fc1[e], fc2[e] = gate_up, down
        out["experts.fc1_weight"], out["experts.fc2_weight"] = fc1, fc2
    if kind == "deepseek_v3":
        out["router.expert_bias"] = take(src + "gate.e_score_correction_bias")
    if config.shared_expert_intermediate_size is not None:
        shared = src + ("shared_experts." if kind == "deepseek_v3" else "shared_expert.")
        out["shared_experts.linear_fc1.weight"] = torch.cat([take(shared + "gate_proj.weight"),
                                                              take(shared + "up_proj.weight")])
        out["shared_experts.linear_fc2.weight"] = take(shared + "down_proj.weight")
    if config.shared_expert_gate:
        out["shared_expert_gate"] = take(src + "shared_expert_gate.weight")
    return out


def moe_tensor_to_hf(name: str, tensor: torch.Tensor, layer_prefix: str, model_type: str
                     ) -> list[tuple[str, torch.Tensor]]:
    """The on-disk HF ``(name, tensor)`` pairs of one global megalite MoE tensor (``name`` under ``mlp.``)."""
    kind = _family({"model_type": model_type}, HF_MOE_READ_FAMILIES)
    dst = layer_prefix + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
    shared = dst + ("shared_experts." if kind == "deepseek_v3" else "shared_expert.")
    part = _MIXTRAL_EXPERT if kind == "mixtral" else _QWEN_EXPERT
    if name == "router.weight":
        return [(dst + "gate.weight", tensor)]
    if name == "router.expert_bias" and kind == "deepseek_v3":
        return [(dst + "gate.e_score_correction_bias", tensor)]
    if name == "experts.fc1_weight":
        pairs = []
        for e, weight in enumerate(tensor):
            gate, up = weight.chunk(2)
            pairs += [(f"{dst}experts.{e}.{part['gate']}.weight", gate), (f"{dst}experts.{e}.{part['up']}.weight", up)]
        return pairs
    if name == "experts.fc2_weight":
        return [(f"{dst}experts.{e}.{part['down']}.weight", weight) for e, weight in enumerate(tensor)]
    if name == "shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return [(shared + "gate_proj.weight", gate), (shared + "up_proj.weight", up)]
    if name == "shared_experts.linear_fc2.weight":
        return [(shared + "down_proj.weight", tensor)]
    if name == "shared_expert_gate":
        return [(dst + "shared_expert_gate.weight", tensor)]
    raise ValueError(f"{model_type} has no Hugging Face tensor for the MoE tensor mlp.{name}")
