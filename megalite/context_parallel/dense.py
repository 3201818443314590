"""Packed-document attention at one CP rank as one fused scaled-dot-product call over a dense mask.

Without context parallelism, a row's attention (causal within each document, within a sliding window when the
model has one) can be a single ``scaled_dot_product_attention`` call given the whole ``[b, 1, s, s]`` mask of
:func:`megalite.context_parallel.blockwise.visible` (the one attention rule), instead of the tiled path's
Python loop over tiles.  The fused kernel computes every score, masked or not, while the tiled path skips
tile pairs that lie wholly above the diagonal or across documents, so the dense path wins on short rows and
loses on long ones.  Measured on one CPU thread (``benchmarks/document_attention.py``: ``[b, 4 heads, s, 64]``,
2 key/value heads, forward and backward; numbers in benchmarks/README.md): 2.7-3.3x faster at the DPO
benchmark's 317-token rows, 1.6-2.0x at 1024, 1.1-1.3x at 1792, 0.95-1.18x at 2048 (a tie), and 1.3-4.3x
slower from 4096 on.  With a sliding window (one document, windows of 31 to s/2 tokens): 2.1-3.3x faster up to
1024 tokens, 0.97-1.19x at 1792 (a tie; the tiles skip what lies outside the window, but their Python loop costs as
much).  The math is fp32, as on the tiled path, and the output is cast back to the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.context_parallel.blockwise import visible
from megalite.context_parallel.sequence_split import sequence_positions

DENSE_MAX_LENGTH = 1792
"""The longest row that runs dense: the longest measured faster than the tiled path with a margin."""


def use_dense(seq_length: int, cp: int) -> bool:
    """Whether a row of ``seq_length`` tokens attends through :func:`dense_attention` rather than the tiles."""
    return cp == 1 and seq_length <= DENSE_MAX_LENGTH


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Causal, document-masked (and sliding-``window``) attention of a whole sequence: ``q [b, n, s, d]``,
    ``k [b, g, s, d]`` and ``v [b, g, s, dv]`` (``g`` grouped heads), ``documents [b, s]`` or None ->
    ``[b, n, s, dv]``.

    Every query sees at least itself, so no row of the mask is empty.  The window measures distance along each
    token's own sequence (:func:`sequence_positions`: a branch's tokens follow their trunk).
    """
    positions = torch.arange(q.shape[2], device=q.device)
    sequence = None if window is None or documents is None else sequence_positions(documents)
    mask = visible(positions, positions, documents, documents, window, sequence, sequence)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.to(q.dtype)
