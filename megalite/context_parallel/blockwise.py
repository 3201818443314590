"""Causal, document-aware attention computed tile by tile, with the log-sum-exp kept for exact merging.

Queries and keys carry their global sequence index (``positions``, ``[s]``)
and optionally their document id (``documents``, ``[b, s]``, non-decreasing
along the sequence).  Query ``i`` may attend key ``j`` when ``pos_j <= pos_i``
and both lie in the same document (or the key in the trunk of the query's
branched document, see :mod:`megalite.context_parallel.sequence_split`); with a sliding ``window`` also
``seq_i - seq_j <= window`` (each query sees itself and the ``window`` keys
before it; Hugging Face's ``sliding_window`` is ``window + 1``), where ``seq`` is the index along the token's own
sequence (:func:`~megalite.context_parallel.sequence_split.sequence_positions`: the global index, but a
branch's tokens follow their trunk, not the sibling branches packed between).  Work is cut into tiles of at most
``tile`` consecutive positions: a tile pair that is entirely masked is
skipped, one that is entirely visible runs without a mask, and only the
partial pairs build a ``[tile, tile]`` mask, so no ``s x s`` mask is ever made.

The forward returns the normalized output and the log-sum-exp of each query's
scores; :func:`merge` combines partial results over disjoint key sets exactly.
The backward recomputes the scores from the *final* output and log-sum-exp
(as flash attention does), so the gradient of one key block is exact even when
that block was only part of what a query attended to.  All math is fp32;
tensors are ``[b, heads, s, d]``, and keys/values may have fewer (grouped)
heads than queries.
"""

from __future__ import annotations

import torch

from megalite.context_parallel.sequence_split import document_of, sees

DEFAULT_TILE = 512


class Tokens:
    """The global indices (``[s]``) and optional document ids (``[b, s]``) of a block of tokens, cut into tiles.

    ``sequence`` (``[b, s]``, with documents) holds the tokens' positions along their own sequences
    (:func:`~megalite.context_parallel.sequence_split.sequence_positions`), which a sliding window measures
    when the row may branch; without it the window measures the global indices.
    """

    def __init__(self, positions: torch.Tensor, documents: torch.Tensor | None, tile: int = DEFAULT_TILE,
                 sequence: torch.Tensor | None = None):
        self.positions = positions
        self.documents = documents
        self.sequence = sequence
        self.tiles = _tiles(positions.tolist(), tile)
        # Per tile: first and last global index, and each row's first and last document (branches dropped,
        # for skipping) and document id (branches kept, for telling a tile of one branch).
        self.bounds = [(positions[a].item(), positions[b - 1].item()) for a, b in self.tiles]
        self.doc_bounds = self.id_bounds = None
        if documents is not None:
            docs = document_of(documents)
            self.doc_bounds = [(docs[:, a], docs[:, b - 1]) for a, b in self.tiles]
            self.id_bounds = [(documents[:, a], documents[:, b - 1]) for a, b in self.tiles]
        # Each row's least and greatest sequence position per tile (branches make them non-monotonic).
        self.sequence_bounds = None if sequence is None else [
            (sequence[:, a:b].amin(dim=-1), sequence[:, a:b].amax(dim=-1)) for a, b in self.tiles]


def _tiles(positions: list[int], tile: int) -> list[tuple[int, int]]:
    """Local ``[start, end)`` slices: runs of consecutive global indices, each cut to at most ``tile``."""
    tiles, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1 or i - start == tile:
            tiles.append((start, i))
            start = i
    return tiles


def _tile_mask(queries: Tokens, qt: int, keys: Tokens, kt: int, window: int | None = None):
    """``None`` to skip the tile pair, ``True`` when fully visible, else a boolean mask.

    The mask is ``[Tq, Tk]`` (causal, sliding window) or ``[b, 1, Tq, Tk]`` (documents).
    """
    q_first, q_last = queries.bounds[qt]
    k_first, k_last = keys.bounds[kt]
    near = far = True  # some pair within the window; every pair within it
    if window is not None and queries.sequence is None:
        near, far = q_first - k_last <= window, q_last - k_first <= window
    elif window is not None:
        (qs_least, qs_most), (ks_least, ks_most) = queries.sequence_bounds[qt], keys.sequence_bounds[kt]
        near = bool((qs_least - ks_most <= window).any())
        far = bool((qs_most - ks_least <= window).all())
    if k_first > q_last or not near:
        return None
    causal_full = k_last <= q_first and far
    doc_full = True
    if queries.documents is not None:
        qd_first, qd_last = queries.doc_bounds[qt]
        kd_first, kd_last = keys.doc_bounds[kt]
        if bool(((kd_first > qd_last) | (kd_last < qd_first)).all()):
            return None
        qi_first, qi_last = queries.id_bounds[qt]
        ki_first, ki_last = keys.id_bounds[kt]
        doc_full = bool(((qi_first == qi_last) & (ki_first == ki_last) & sees(qi_first, ki_first)).all())
    if causal_full and doc_full:
        return True
    qa, qb = queries.tiles[qt]
    ka, kb = keys.tiles[kt]
    q_positions, k_positions = queries.positions[qa:qb], keys.positions[ka:kb]
    if doc_full and (far or queries.sequence is None):  # the rule needs no document ids here
        return visible(q_positions, k_positions, window=None if far else window)
    sequence = (None, None) if queries.sequence is None else (queries.sequence[:, qa:qb], keys.sequence[:, ka:kb])
    return visible(q_positions, k_positions, queries.documents[:, qa:qb], keys.documents[:, ka:kb], window,
                   *sequence)


def tile_pairs(queries: Tokens, keys: Tokens, window: int | None = None) -> list[tuple[int, int, bool]]:
    """``(query tile, key tile, wholly visible)`` of every tile pair :func:`attention_forward` and
    :func:`attention_backward` compute (wholly masked pairs are skipped): what the run planner counts the
    blockwise attention's work and ops from."""
    out = []
    for qt in range(len(queries.tiles)):
        for kt in range(len(keys.tiles)):
            mask = _tile_mask(queries, qt, keys, kt, window)
            if mask is not None:
                out.append((qt, kt, mask is True))
    return out


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor, q_documents: torch.Tensor | None = None,
            k_documents: torch.Tensor | None = None, window: int | None = None,
            q_sequence: torch.Tensor | None = None, k_sequence: torch.Tensor | None = None) -> torch.Tensor:
    """The attention rule as a boolean mask (True: the query may attend the key).

    Query ``i`` sees key ``j`` when ``pos_j <= pos_i`` and, given documents (``[b, Tq]`` and ``[b, Tk]``), both
    lie in the same document and branch, or the key in the trunk of the query's document
    (:func:`megalite.context_parallel.sequence_split.sees`); with a ``window`` also within ``window`` of it,
    measured along the sequence: ``q_sequence - k_sequence`` (``[b, Tq]`` and ``[b, Tk]``, given with documents:
    the tokens' :func:`~megalite.context_parallel.sequence_split.sequence_positions`) when the row may branch,
    else ``pos_i - pos_j``.
    ``[Tq, Tk]`` without documents, else ``[b, 1, Tq, Tk]``.
    """
    distance = q_positions[:, None] - k_positions[None, :]
    mask = distance >= 0
    if window is not None and q_sequence is None:
        mask &= distance <= window
    if q_documents is None:
        return mask
    mask = mask & sees(q_documents[:, :, None], k_documents[:, None, :])
    if window is not None and q_sequence is not None:
        mask &= q_sequence[:, :, None] - k_sequence[:, None, :] <= window
    return mask.unsqueeze(1)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped keys/values ``[b, g, s, d]`` -> one per query head ``[b, heads, s, d]``."""
    groups = kv.shape[1]
    return kv if groups == heads else kv.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Adjoint of :func:`_expand`: sum the per-head gradients of each group."""
    b, heads, s, d = grad.shape
    return grad if groups == heads else grad.view(b, groups, heads // groups, s, d).sum(dim=2)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two softmax-normalized partial results over disjoint key sets into one (exact)."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    safe = _safe(new)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)), new


def _count(stats: dict | None, key: str, q: torch.Tensor, rows: int, cols: int) -> None:
    if stats is not None:
        b, heads, _, d = q.shape
        stats[key] = stats.get(key, 0) + 4 * b * heads * rows * cols * d


def attention_forward(q, k, v, queries: Tokens, keys: Tokens, scale: float, stats: dict | None = None,
                      window: int | None = None):
    """Output ``[b, n, sq, dv]`` and log-sum-exp ``[b, n, sq]`` (fp32; ``-inf`` for a query that sees no key).

    Values may have their own head dim ``dv`` (multi-latent attention).

    ``stats``, when a dict, accumulates the matmul FLOPs of the tiles computed (``forward_flops``).
    """
    q, k, v = q.float(), _expand(k.float(), q.shape[1]), _expand(v.float(), q.shape[1])
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for qt, (qa, qb) in enumerate(queries.tiles):
        acc, acc_lse = None, None
        for kt, (ka, kb) in enumerate(keys.tiles):
            mask = _tile_mask(queries, qt, keys, kt, window)
            if mask is None:
                continue
            _count(stats, "forward_flops", q, qb - qa, kb - ka)
            scores = torch.matmul(q[:, :, qa:qb], k[:, :, ka:kb].transpose(-1, -2)) * scale
            if mask is not True:
                scores = scores.masked_fill(~mask, float("-inf"))
            tile_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _safe(tile_lse).unsqueeze(-1))
            acc, acc_lse = merge(acc, acc_lse, torch.matmul(probs, v[:, :, ka:kb]), tile_lse)
        if acc is not None:
            out[:, :, qa:qb], lse[:, :, qa:qb] = acc, acc_lse
    return out, lse


def attention_backward(dout, q, k, v, out, lse, queries: Tokens, keys: Tokens, scale: float,
                       stats: dict | None = None, window: int | None = None):
    """Gradients ``(dq, dk, dv)`` (fp32) of this key block, given the final ``out``/``lse`` of the queries."""
    groups, heads = k.shape[1], q.shape[1]
    q, k, v, dout = q.float(), _expand(k.float(), heads), _expand(v.float(), heads), dout.float()
    delta = (dout * out).sum(dim=-1)
    lse = _safe(lse)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qt, (qa, qb) in enumerate(queries.tiles):
        for kt, (ka, kb) in enumerate(keys.tiles):
            mask = _tile_mask(queries, qt, keys, kt, window)
            if mask is None:
                continue
            _count(stats, "backward_flops", q, 2 * (qb - qa), kb - ka)
            q_t, k_t, v_t, do_t = q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], dout[:, :, qa:qb]
            scores = torch.matmul(q_t, k_t.transpose(-1, -2)) * scale
            if mask is not True:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.exp(scores - lse[:, :, qa:qb].unsqueeze(-1))
            dv[:, :, ka:kb] += torch.matmul(probs.transpose(-1, -2), do_t)
            dscores = probs * (torch.matmul(do_t, v_t.transpose(-1, -2)) - delta[:, :, qa:qb].unsqueeze(-1))
            dq[:, :, qa:qb] += torch.matmul(dscores, k_t) * scale
            dk[:, :, ka:kb] += torch.matmul(dscores.transpose(-1, -2), q_t) * scale
    return dq, _fold(dk, groups), _fold(dv, groups)


class BlockwiseAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`attention_forward` for one rank's queries against keys it holds."""

    @staticmethod
    def forward(ctx, q, k, v, queries: Tokens, keys: Tokens, scale: float, window: int | None = None):
        out, lse = attention_forward(q, k, v, queries, keys, scale, window=window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tokens, ctx.scale, ctx.window = (queries, keys), scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *ctx.tokens, ctx.scale, window=ctx.window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
