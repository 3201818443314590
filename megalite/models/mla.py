"""Multi-latent attention (MLA, DeepSeek-V2/V3): queries and keys/values through low-rank latents.

Per token, the hidden state is projected down to a query latent (``q_lora_rank``,
or straight to the heads when it is None) and to one joint key/value latent
(``kv_lora_rank``) plus one rotary key part (``qk_pos_emb_head_dim``) shared by
every head.  The latents are normalised (RMSNorm) and projected up to each
head's non-rotary query/key channels (``qk_head_dim``) and value channels
(``v_head_dim``); the query's rotary channels come from the query up-projection.
Each head attends with ``[nope; rope]`` queries and keys.

Tensor parallelism as Megatron-Core does it: the down-projections and the
latent norms are replicated (under sequence parallelism they run on this
rank's tokens and their gradients are summed over TP), the up-projections are
column-parallel (heads split; the weight rows are head-major, ``[nope_j; rope_j]``
for the query and ``[nope_j; v_j]`` for ``linear_kv_up_proj``, as Hugging Face's
``q_b_proj``/``kv_b_proj``) and ``linear_proj`` is row-parallel.  The shared
rotary key is all-gathered over the sequence under SP; its gradient, partial
per rank, is reduced back.

The softmax scale is ``1/sqrt(qk_head_dim + qk_pos_emb_head_dim)`` times YaRN's
``yarn_mscale(factor, yarn_mscale_all_dim) ** 2`` (under ``rope_scaling='yarn'``); the extra factor is folded into
the queries, so every core-attention backend (KV cache, context parallel) serves MLA unchanged.

A cache with ``attend_latent`` (the inference engine's paged step) stores the
normalised latent and the rotary key, ``kv_lora_rank + qk_pos_emb_head_dim``
values per token, instead of per-head keys and values: the layer then attends
in the weight-absorbed form (W_UK folded into the query, W_UV applied after).
Under TP the latent is replicated, so each rank caches all of it and absorbs
with its own heads' rows of ``linear_kv_up_proj``; ``linear_proj`` sums the heads.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite import topology
from megalite.models.attention import Attention, AttentionCache
from megalite.models.init import normal_init, scaled_normal_init
from megalite.models.norms import build_norm
from megalite.models.rotary import apply_rotary, yarn_mscale
from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tensor_parallel_region,
                                      gather_from_sequence_parallel_region)


def check_mla_config(config) -> None:
    """Raise ValueError naming the numbers if ``config``'s MLA sizes cannot build a model."""
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
    rank = config.q_lora_rank
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"GPTConfig.q_lora_rank must be a positive integer or None, got {rank!r}")
    if config.position_embedding_type != "rope" or config.rotary_percent != 1.0:
        raise ValueError(f"multi-latent attention needs position_embedding_type 'rope' with rotary_percent 1, got "
                         f"{config.position_embedding_type!r} and {config.rotary_percent}")
    if config.num_query_groups != config.num_attention_heads:
        raise ValueError(f"multi-latent attention has no query groups: num_query_groups={config.num_query_groups} "
                         f"must equal num_attention_heads={config.num_attention_heads}")


def mla_flops_per_token(config, seq_length: int) -> float:
    """Forward FLOPs per token of one MLA layer: its projections plus ``QK^T`` and ``AV`` (no causal discount)."""
    h, heads, rope = config.hidden_size, config.num_attention_heads, config.qk_pos_emb_head_dim
    qk, v, kv_rank = config.qk_head_dim + rope, config.v_head_dim, config.kv_lora_rank
    q_rank = config.q_lora_rank
    query = h * heads * qk if q_rank is None else h * q_rank + q_rank * heads * qk
    weights = query + h * (kv_rank + rope) + kv_rank * heads * (config.qk_head_dim + v) + heads * v * h
    return 2.0 * weights + 2.0 * seq_length * heads * (qk + v)


class ReplicatedLinear(nn.Module):
    """``x @ weight.T`` with the full weight on every TP rank (MLA's down-projections).

    Drawn from the default generator like a column-parallel master, so every TP
    rank holds the same weight.  Under sequence parallelism each rank sees its own
    tokens, so the weight is marked ``sequence_parallel`` and its gradient summed over TP.
    """

    def __init__(self, in_features: int, out_features: int, *, init_method, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        init_method(self.weight.data)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class MultiLatentAttention(Attention):
    """MLA over tensor-parallel heads; input ``[s, b, h]`` (``[s/tp, b, h]`` under SP).

    Returns ``(output, proj_bias)`` as :class:`~megalite.models.attention.SelfAttention`
    does; ``rotary`` is the cos/sin pair of the rotary channels (plain or YaRN).
    """

    def __init__(self, config, layer_number: int, *, tp_group=None, cp_group=None, cp_comm_type: str = "p2p",
                 sequence_parallel: bool = False):
        tp = topology.group_size(tp_group)
        heads_local = config.num_attention_heads // tp
        super().__init__(config, layer_number, heads_local=heads_local, groups_local=heads_local,
                         cp_group=cp_group, cp_comm_type=cp_comm_type)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.heads_local = heads_local
        self.nope, self.rope, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.query_scale = yarn_mscale(config.rope_scaling_factor, config.yarn_mscale_all_dim) ** 2 \
            if config.rope_scaling == "yarn" else 1.0
        h, heads, std = config.hidden_size, config.num_attention_heads, config.init_method_std
        norm = (config.normalization,)
        column = dict(bias=False, sequence_parallel=sequence_parallel, tp_group=tp_group, init_method=normal_init(std))
        q_size = heads * (self.nope + self.rope)
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_size, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, init_method=normal_init(std),
                                                       sequence_parallel=sequence_parallel)
            self.q_layernorm = build_norm(*norm, config.q_lora_rank, config.norm_eps,
                                          sequence_parallel=sequence_parallel)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_size, **column)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.rope, init_method=normal_init(std),
                                                    sequence_parallel=sequence_parallel)
        self.kv_layernorm = build_norm(*norm, self.kv_lora_rank, config.norm_eps, sequence_parallel=sequence_parallel)
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_dim), **column)
        self.linear_proj = RowParallelLinear(
            heads * self.v_dim, h, bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            sequence_parallel=sequence_parallel, tp_group=tp_group,
            init_method=scaled_normal_init(std, config.num_layers))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: AttentionCache | None = None, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None):
        if hasattr(self, "linear_q_proj"):
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        s, b = q.shape[:2]
        q_nope, q_rope = q.view(s, b, self.heads_local, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_layernorm(latent)
        # The rotary key feeds this rank's heads only: its gradient is partial per TP rank.
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, self.tp_group)
        else:
            k_rope = copy_to_tensor_parallel_region(k_rope, self.tp_group)
        k_rope = k_rope.unsqueeze(2)
        if rotary is not None:
            q_rope, k_rope = apply_rotary(q_rope, k_rope, *rotary, interleaved=self.rotary_interleaved)
        if hasattr(kv_cache, "attend_latent"):
            return self.linear_proj(self._attend_absorbed(q_nope, q_rope, latent, k_rope, kv_cache, mask))
        kv = self.linear_kv_up_proj(latent).view(s, b, self.heads_local, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.heads_local, -1)], dim=-1)
        return self.linear_proj(self.attend(q, k, v, kv_cache, mask, documents))

    def _attend_absorbed(self, q_nope, q_rope, latent, k_rope, kv_cache, mask) -> torch.Tensor:
        """Attention over a latent cache (the inference engine's): per head ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``,
        so the query is folded through W_UK and attends to the cached ``[c; k_rope]`` of every head at once;
        W_UV is applied to the attention-weighted latent afterwards.  Returns ``[s, b, heads_local * v_head_dim]``."""
        weight = self.linear_kv_up_proj.weight.view(self.heads_local, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = weight.split([self.nope, self.v_dim], dim=1)
        q = torch.cat([torch.einsum("sbhn,hnr->sbhr", q_nope, w_uk), q_rope], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        key = torch.cat([latent.unsqueeze(2), k_rope], dim=-1)
        context = kv_cache.attend_latent(self.layer_number, q, key, (self.nope + self.rope) ** -0.5, mask)
        s, b = context.shape[:2]
        context = context.view(s, b, self.heads_local, self.kv_lora_rank)
        return torch.einsum("sbhr,hvr->sbhv", context, w_uv).reshape(s, b, self.heads_local * self.v_dim)
