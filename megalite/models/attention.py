"""Causal self-attention with grouped-query attention over tensor-parallel heads.

QKV layout of ``linear_qkv`` (Megatron's grouped layout).  With ``ng`` query
groups, ``nq`` heads, ``r = nq // ng`` heads per group and head dim ``d``, the
full (master) weight has ``ng * (r + 2) * d`` output rows ordered group by
group: ``[q_g0 (r*d rows), k_g0 (d), v_g0 (d), q_g1, k_g1, v_g1, ...]``, where
query head ``j`` belongs to group ``j // r``.  TP rank ``i`` holds the
contiguous block of groups ``i*ng/tp .. (i+1)*ng/tp``, so the same master
weight serves every TP size.  The bias follows the same layout.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megalite import batch_invariant, topology
from megalite.context_parallel import check_heads, context_parallel_attention
from megalite.models.init import normal_init, scaled_normal_init
from megalite.models.norms import build_norm
from megalite.models.rotary import apply_rotary
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, get_rng_tracker, recompute


class AttentionCache(Protocol):
    """What the model asks of a cache of earlier tokens' keys and values.

    A structural type, so that a cache defined anywhere (the contiguous
    ``models.kv_cache.KVCache``, the inference engine's paged step) plugs in
    without this module importing it.  The cache chooses the attention backend:
    a contiguous cache runs :func:`core_attention`, a paged one gathers keys and
    values through block tables.
    """

    offset: int
    """Tokens already cached in front of this call's tokens (0 for a cache that takes explicit positions)."""

    window: int | None
    """The sliding window the cache applies itself (read with ``getattr``, default None: it applies none)."""

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Store this call's keys/values of one layer; return the attention context ``[s, b, heads*d]``."""

    def advance(self, num_tokens: int) -> None:
        """Called once per model forward, after every layer ran."""


def padding_causal_mask(attention_mask: torch.Tensor, seq: int, offset: int) -> torch.Tensor:
    """Boolean ``[b, 1, seq, offset + seq]`` (True = may attend) for the last ``seq`` of ``offset + seq`` tokens.

    ``attention_mask [b, offset + seq]`` marks real tokens (1) and padding (0).
    Query ``i`` sees the real keys ``0 .. offset + i`` and always itself, so a
    padding query has one key and its (unused) output stays finite.
    """
    total = offset + seq
    device = attention_mask.device
    causal = torch.ones(seq, total, dtype=torch.bool, device=device).tril(diagonal=offset)
    allowed = causal & attention_mask.bool()[:, None, :]
    allowed[:, torch.arange(seq, device=device), offset + torch.arange(seq, device=device)] = True
    return allowed.unsqueeze(1)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, offset: int,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with a causal mask; ``[s, b, n, d]`` in, ``[s, b, n*dv]`` out.

    ``k``/``v`` may have fewer (grouped) heads than ``q`` and ``offset`` more
    (cached) positions in front: query ``i`` sees keys ``0 .. offset + i``.
    An explicit boolean ``mask`` (see :func:`padding_causal_mask`) replaces the
    causal mask.  Attention dropout runs on the model-parallel RNG state, since
    each TP rank holds different heads.  Runs on torch's
    scaled_dot_product_attention (flash kernels on GPU without ``mask``), or under
    ``batch_invariant.mode`` on :func:`megalite.batch_invariant.attention` (no dropout there).
    """
    s, b, heads, d = q.shape
    if batch_invariant.enabled():
        allowed = mask[:, 0] if mask is not None else torch.ones(
            s, k.shape[0], dtype=torch.bool, device=q.device).tril(diagonal=offset).expand(b, s, k.shape[0])
        out = batch_invariant.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed, d ** -0.5)
        return out.transpose(0, 1)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    causal = False
    if mask is None:
        causal = offset == 0 and s > 1
        if offset and s > 1:
            mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=offset)
    gqa = k.shape[1] != heads
    if dropout > 0.0:
        with get_rng_tracker().fork():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * v.shape[-1])


class Attention(nn.Module):
    """What every attention variant shares: the core attention after the projections.

    :meth:`attend` runs queries, keys and values ``[s, b, heads, d]`` (values may
    have their own head dim) through the KV cache, the context-parallel /
    packed-document / sliding-window path, or plain causal attention, with
    selective recompute; subclasses own the projections around it (and rotate
    with ``rotary_interleaved``, halves or neighbouring pairs).
    """

    def __init__(self, config, layer_number: int, *, heads_local: int, groups_local: int, cp_group=None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.cp_group = cp_group
        self.cp_comm_type = cp_comm_type
        cp = topology.group_size(cp_group)
        if cp > 1:
            check_heads(heads_local, groups_local, cp, cp_comm_type)
            if config.attention_dropout > 0.0:
                raise ValueError(f"attention dropout {config.attention_dropout} is not supported with context "
                                 f"parallelism (cp={cp}); set it to 0")
        self.context_parallel = cp > 1
        self.layer_number = layer_number
        self.attention_dropout = config.attention_dropout
        self.window_size = config.window_size
        self.recompute_core = config.recompute_granularity == "selective"
        self.rotary_interleaved = config.rotary_interleaved

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: AttentionCache | None,
               mask: torch.Tensor | None, documents: torch.Tensor | None) -> torch.Tensor:
        """The attention context ``[s, b, heads * dv]`` of rotated ``q``/``k`` and ``v``."""
        s = q.shape[0]
        dropout = self.attention_dropout if self.training else 0.0
        window = self.window_size
        if window is not None and mask is not None:
            queries = torch.arange(s, device=mask.device) + (0 if kv_cache is None else kv_cache.offset)
            mask = mask & (queries[:, None] - torch.arange(mask.shape[-1], device=mask.device) <= window)
        if kv_cache is not None:
            if window is not None and mask is None and getattr(kv_cache, "window", None) != window:
                raise ValueError(f"sliding-window attention (window_size={window}) needs an attention mask or a "
                                 f"KV cache that applies the same window")
            return kv_cache.attend(self.layer_number, q, k, v, dropout, mask)
        if batch_invariant.enabled() and (self.context_parallel or documents is not None):
            raise ValueError("batch-invariant attention runs without context parallelism or packed documents")
        if self.context_parallel or documents is not None or (window is not None and mask is None):
            if dropout > 0.0:
                raise ValueError(f"attention dropout {dropout} is not supported with packed-sequence (document) or "
                                 f"sliding-window attention; set it to 0")
            if self.recompute_core and self.training:
                return recompute(self._document_attention, q, k, v, documents)
            return self._document_attention(q, k, v, documents)
        if self.recompute_core and self.training:
            return recompute(core_attention, q, k, v, dropout, 0, mask)
        return core_attention(q, k, v, dropout, 0, mask)

    def _document_attention(self, q, k, v, documents):
        return context_parallel_attention(q, k, v, group=self.cp_group, comm_type=self.cp_comm_type,
                                          documents=documents, window=self.window_size)


class SelfAttention(Attention):
    """``linear_qkv`` (column-parallel) -> [per-head q/k norm] -> rotary -> core attention -> ``linear_proj``.

    Input ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); ``rotary``
    is a pair of cos/sin tables from :class:`RotaryEmbedding` and ``mask`` an
    optional :func:`padding_causal_mask`.  Returns ``(output, proj_bias)`` with
    the bias left for the fused bias-dropout-add.

    With a context-parallel group of more than one rank (``cp_group``), ``s``
    is this rank's share of the sequence and the core attention is
    :func:`context_parallel_attention` (``cp_comm_type``); so it is for packed
    sequences (``documents [b, s]``), which attend within their document only,
    and for a sliding window (``config.window_size``), whose blockwise tiles
    skip what lies outside the window.  A padding ``mask`` (also with the
    contiguous KV cache) gets the window added to it; a cache without a mask must
    apply the window itself (its ``window`` attribute, as the inference engine's
    paged step does), else one ValueError.
    """

    def __init__(self, config, layer_number: int, *, tp_group=None, cp_group=None, cp_comm_type: str = "p2p",
                 sequence_parallel: bool = False):
        tp = topology.group_size(tp_group)
        super().__init__(config, layer_number, heads_local=config.num_attention_heads // tp,
                         groups_local=config.num_query_groups // tp, cp_group=cp_group, cp_comm_type=cp_comm_type)
        self.head_dim = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.num_groups_local = config.num_query_groups // tp
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group, init_method=normal_init(config.init_method_std))
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, sequence_parallel=sequence_parallel, tp_group=tp_group,
            init_method=scaled_normal_init(config.init_method_std, config.num_layers))
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            # One weight shared by every head; each TP rank holds other heads, so its
            # gradient is partial and summed over TP like a sequence-parallel one.
            norm_args = (config.normalization, self.head_dim, config.norm_eps)
            self.q_layernorm = build_norm(*norm_args, sequence_parallel=tp > 1)
            self.k_layernorm = build_norm(*norm_args, sequence_parallel=tp > 1)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: AttentionCache | None = None, mask: torch.Tensor | None = None,
                documents: torch.Tensor | None = None):
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups_local, self.heads_per_group + 2, self.head_dim)
        # split, not three slices: its backward writes the three gradients into one tensor (a cat), where a
        # slice's backward zero-fills a whole QKV-sized tensor per slice and autograd then adds the three
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        q, k, v = q.reshape(s, b, -1, self.head_dim), k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:
            # k is a strided view into the QKV output: made contiguous it takes the fused norm kernel, not the
            # reference's several passes (rotary would copy it anyway)
            q, k = self.q_layernorm(q), self.k_layernorm(k.contiguous())
        if rotary is not None:
            q, k = apply_rotary(q, k, *rotary, interleaved=self.rotary_interleaved)
        return self.linear_proj(self.attend(q, k, v, kv_cache, mask, documents))
