"""Stream a TP/PP-sharded GPT's weights as full tensors under Hugging Face names.

For inference engines that take weight updates name by name: each parameter
is all-gathered over TP, re-laid-out (vocabulary padding dropped, grouped QKV
split into q/k/v, SwiGLU's per-rank [gate; up] blocks regrouped), broadcast
from the pipeline stage that holds it, and yielded one at a time, so at most
one full tensor is alive per call.  Names follow GPT-2 (``transformer.h.{i}.*``)
for LayerNorm/GELU/learned-position configs and Llama (``model.layers.{i}.*``)
for RMSNorm/SwiGLU/RoPE configs; GPT-2's Conv1D weights are transposed.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megalite import topology
from megalite.models.rlhf.unwrap import unwrap

_GPT2 = {
    "input_layernorm": "ln_1", "pre_mlp_layernorm": "ln_2", "self_attention.linear_proj": "attn.c_proj",
    "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj",
}
_LLAMA = {
    "input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
    "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj",
}


def hf_style(config) -> str:
    """``"llama"`` for RMSNorm/SwiGLU/RoPE configs, ``"gpt2"`` for LayerNorm/GELU/learned positions."""
    if (config.normalization, config.activation, config.position_embedding_type) == ("RMSNorm", "swiglu", "rope"):
        return "llama"
    if config.normalization == "LayerNorm" and config.activation.startswith("gelu") \
            and config.position_embedding_type == "learned_absolute":
        return "gpt2"
    raise ValueError(f"no Hugging Face naming for normalization={config.normalization}, activation="
                     f"{config.activation}, position_embedding_type={config.position_embedding_type}")


def _convert(name: str, full: torch.Tensor, config, tp: int) -> list[tuple[str, torch.Tensor]]:
    """One full megalite tensor -> its Hugging Face (name, tensor) pairs."""
    style = hf_style(config)
    llama = style == "llama"
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight" if llama else "transformer.wte.weight",
           "embedding.position_embeddings.weight": "transformer.wpe.weight",
           "output_layer.weight": "lm_head.weight",
           "decoder.final_layernorm.weight": "model.norm.weight" if llama else "transformer.ln_f.weight",
           "decoder.final_layernorm.bias": "transformer.ln_f.bias"}
    if name in top:
        if "word_embeddings" in name or "output_layer" in name:
            full = full[:config.vocab_size]
        return [(top[name], full)]
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    prefix = f"model.layers.{index}." if llama else f"transformer.h.{index}."
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    if module == "self_attention.linear_qkv":
        blocks = full.view(groups, per_group + 2, d, *full.shape[1:])
        q = blocks[:, :per_group].reshape(-1, *full.shape[1:])
        k, v = blocks[:, per_group].reshape(-1, *full.shape[1:]), blocks[:, per_group + 1].reshape(-1, *full.shape[1:])
        if llama:
            return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in (("q", q), ("k", k), ("v", v))]
        qkv = torch.cat([q, k, v])
        return [(f"{prefix}attn.c_attn.{kind}", qkv.t().contiguous() if kind == "weight" else qkv)]
    if module == "mlp.linear_fc1" and llama:
        halves = full.view(tp, 2, -1, *full.shape[1:])
        gate, up = (halves[:, i].reshape(-1, *full.shape[1:]) for i in (0, 1))
        return [(f"{prefix}mlp.gate_proj.{kind}", gate), (f"{prefix}mlp.up_proj.{kind}", up)]
    mapped = (_LLAMA if llama else _GPT2)[module]
    if not llama and kind == "weight" and module.startswith(("self_attention", "mlp")):
        full = full.t().contiguous()
    return [(f"{prefix}{mapped}.{kind}", full)]


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _gather_tp(param: torch.Tensor, tp_group) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or topology.group_size(tp_group) == 1:
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(topology.group_size(tp_group))]
    dist.all_gather(parts, param.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=param.partition_dim)


@torch.no_grad()
def export_hf_weights(model_chunk, pp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every weight, on every rank of the model replica (TP x PP).

    Every rank of the replica must consume the whole iterator (it runs collectives).
    A weight tied to the embedding (the output layer of a tied config) is not repeated.
    """
    model = unwrap(model_chunk)
    config, tp_group = model.config, model.tp_group
    tp = topology.group_size(tp_group)
    pp_group = topology.resolve_group(pp_group, "pp")
    tied = not config.untie_embeddings_and_output_weights
    params = {n: p for n, p in model.named_parameters() if not (tied and n == "output_layer.weight")}
    mine = [(n, _full_shape(p, tp), p.dtype) for n, p in params.items()]
    listing = [mine]
    if topology.group_size(pp_group) > 1:
        listing = [None] * topology.group_size(pp_group)
        dist.all_gather_object(listing, mine, group=pp_group)
    me = topology.group_rank(pp_group)
    device = next(model.parameters()).device
    for stage, entries in enumerate(listing):
        for name, shape, dtype in entries:
            if stage == me:
                full = _gather_tp(params[name], tp_group)
            else:
                full = torch.empty(shape, dtype=dtype, device=device)
            if len(listing) > 1:
                dist.broadcast(full.contiguous() if stage == me else full, src=dist.get_global_rank(pp_group, stage),
                               group=pp_group)
            yield from _convert(name, full, config, tp)
