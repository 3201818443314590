"""The attention entry point for context parallelism and packed sequences.

``context_parallel_attention`` takes the local queries, keys and values of
one CP rank (``[s/cp, b, heads, d]``, the rank's load-balanced chunks) and
returns the local attention output, computed exactly as causal (and
document-masked) attention over the whole sequence would.  ``comm_type``:

- ``p2p``: ring attention (:mod:`megalite.context_parallel.ring`).
- ``all_gather``: gather every rank's keys and values, attend the local
  queries; the backward reduce-scatters the key/value gradients.
- ``a2a`` (Ulysses): all-to-all from sequence-split to head-split, attend the
  whole sequence on ``heads/cp`` heads, all-to-all back.

With one rank, packed or sliding-window rows of at most ``dense.DENSE_MAX_LENGTH``
tokens run as one fused call over a dense document / window mask
(:mod:`megalite.context_parallel.dense`, faster there); longer rows
run the document-masked blockwise attention of
:mod:`megalite.context_parallel.blockwise` (tiles wholly masked are skipped).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel.blockwise import DEFAULT_TILE, BlockwiseAttention, Tokens
from megalite.context_parallel.dense import dense_attention, use_dense
from megalite.context_parallel.sequence_split import check_context_parallel, chunk_indices, sequence_positions
from megalite.context_parallel.ring import RingAttention
from megalite.tensor_parallel.mappings import gather_first, reduce_scatter_first


class _GatherKV(torch.autograd.Function):
    """``[b, g, s/cp, d]`` -> every rank's block concatenated along the sequence (rank order).

    The adjoint reduce-scatters the gradient back to each rank's block.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_first(x.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first(grad.permute(2, 0, 1, 3), ctx.group).permute(1, 2, 0, 3), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, n, s/cp, d]`` -> ``[b, n/cp, s, d]``: keep head block ``rank``, collect every rank's tokens."""
    cp = dist.get_world_size(group)
    b, n, s, d = x.shape
    parts = _all_to_all(x.view(b, cp, n // cp, s, d).transpose(0, 1), group)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`."""
    cp = dist.get_world_size(group)
    b, n, s, d = x.shape
    parts = _all_to_all(x.view(b, n, cp, s // cp, d).permute(2, 0, 1, 3, 4), group)
    return parts.transpose(0, 1).reshape(b, n * cp, s // cp, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def check_heads(num_heads: int, num_groups: int, cp: int, comm_type: str) -> None:
    """Ulysses splits the (local) query and key/value heads over CP: both must divide by ``cp``."""
    if comm_type == "a2a" and (num_heads % cp or num_groups % cp):
        raise ValueError(f"cp comm type a2a needs the attention heads {num_heads} and key/value heads {num_groups} "
                         f"(per tensor-parallel rank) to be divisible by the context-parallel size {cp}")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                               comm_type: str = "p2p", documents: torch.Tensor | None = None,
                               tile: int = DEFAULT_TILE, stats: dict | None = None,
                               window: int | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's ``q [s/cp, b, n, d]`` over the whole sequence -> ``[s/cp, b, n*d]``.

    ``k``/``v`` ``[s/cp, b, g, d]`` may have grouped heads.  ``documents``
    ``[b, s]`` (whole sequence, see :func:`sequence_split.document_ids`) confines
    attention to each document; a sliding ``window`` to the query and the
    ``window`` tokens before it along its own sequence (a branch's tokens follow their trunk,
    :func:`sequence_split.sequence_positions`; tile pairs wholly outside the window are skipped).
    ``group`` is the CP group (default: the topology's).  ``stats`` collects the ring's receive-wait time (p2p
    only).  ``tile`` sizes the blockwise tiles (the dense path at one rank, see :func:`dense.use_dense`, has none).
    """
    group = topology.resolve_group(group, "cp")
    cp, rank = topology.group_size(group), topology.group_rank(group)
    s_local, b, heads, d = q.shape
    seq = s_local * cp
    check_context_parallel(seq, cp, comm_type)
    check_heads(heads, k.shape[2], cp, comm_type)
    if documents is not None and tuple(documents.shape) != (b, seq):
        raise ValueError(f"documents must be [b, s] = [{b}, {seq}] (the whole sequence), got {tuple(documents.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"the attention window must be a non-negative integer or None, got {window!r}")
    scale = 1.0 / math.sqrt(d)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    # The tiles' window measures each token's position along its own sequence (the dense path finds its own).
    tiled_window = window is not None and documents is not None and not use_dense(seq, cp)
    sequence = sequence_positions(documents) if tiled_window else None

    def tokens(ranks):
        positions = torch.cat([chunk_indices(seq, cp, r, device=q.device) for r in ranks])
        return Tokens(positions, None if documents is None else documents[:, positions], tile,
                      None if sequence is None else sequence[:, positions])

    if use_dense(seq, cp):
        out = dense_attention(q, k, v, documents, scale, window)
    elif cp == 1:
        mine = tokens([0])
        out = BlockwiseAttention.apply(q, k, v, mine, mine, scale, window)
    elif comm_type == "p2p":
        out = RingAttention.apply(q, k, v, group, tokens([rank]), [tokens([r]) for r in range(cp)], scale, stats,
                                  window)
    elif comm_type == "all_gather":
        k, v = _GatherKV.apply(k, group), _GatherKV.apply(v, group)
        out = BlockwiseAttention.apply(q, k, v, tokens([rank]), tokens(range(cp)), scale, window)
    else:
        q, k, v = (_SeqToHead.apply(t, group) for t in (q, k, v))
        everyone = tokens(range(cp))
        out = _HeadToSeq.apply(BlockwiseAttention.apply(q, k, v, everyone, everyone, scale, window), group)
    return out.permute(2, 0, 1, 3).reshape(s_local, b, heads * out.shape[-1])
