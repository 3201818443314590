"""Batch-invariant numerics: each output computed in an order that does not depend on the batch around it.

A model run with ``GPTConfig.batch_invariant`` gives every token the same bits whether it is computed alone or in a
batch of 32, left-padded in a training batch or packed into an inference step, in one prefill or decoded token by
token.  So the rollout engine's log-probs equal the trainer's exactly, and PPO's first ratio is exactly 1.  (The
idea is that of the batch-invariant kernels of Thinking Machines, vLLM and SGLang: reductions that never split
differently for a different batch; this is its CPU form over torch's own kernels.)

Where plain torch is not invariant, and what is done instead:

- matmul: a BLAS call picks its kernel (and so its summation order) by the number of rows; :func:`linear` runs
  every row through a call of one fixed shape (:data:`TILE` rows, the last tile padded with zeros, every tile
  64-byte aligned).  This assumes what GEMM micro-kernels do (MKL's here): within one call every row is summed
  over the inner dimension in the same order, whatever its place in the tile; ``tests/rlhf/test_batch_invariant.py``
  checks it end to end on the machine it runs on.
- elementwise activations (silu, gelu, sigmoid): torch's vectorised body and its scalar tail round some values
  differently, and which elements land in the tail depends on the tensor's size; :func:`rowwise` runs them in
  fixed-shape tiles too, so no element ever reaches a tail (one intra-op thread, or rows short enough that a tile
  stays below torch's parallel grain, keeps the tiles unsplit).
- attention: the trainer sees ``[s]`` keys of a left-padded row, the engine the ``ctx`` keys of a sequence in its
  KV pool.  :func:`attention` sums over the head dimension and over keys one index at a time (elementwise
  adds), so masked keys add exact zeros and the sums of the real keys run in the same order either way.
- the tensor-parallel all-reduce: a ring over more than two ranks sums an element in an order set by the tensor's
  size; :func:`all_reduce` gathers the partials and adds them in rank order.
- log-probs: :func:`log_probs` is the one expression both the trainer and the engine use (the full
  vocabulary row, one row kernel).

Norms (one row per token) and log-softmax over equal rows are already invariant in torch.  The model enters
:func:`mode` for its forward (``GPTModel``), and the layers below consult :func:`enabled`; code outside a forward
(the engine's log-probs) reads ``config.batch_invariant`` itself.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist
import torch.nn.functional as F

TILE = 32
"""Rows per fixed-shape call of :func:`linear` and :func:`rowwise`."""

_ENABLED = contextvars.ContextVar("megalite_batch_invariant", default=False)


@contextlib.contextmanager
def mode(enabled: bool = True):
    """Run the enclosed code (one model forward) with batch-invariant ops when ``enabled``."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    """Whether the current code runs under :func:`mode`."""
    return _ENABLED.get()


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (which maps rows ``[n, c]`` to rows ``[n, c']`` independently) over the rows of ``x [..., c]``, called
    on tiles of exactly :data:`TILE` rows (zeros pad the last), so every row sees the same call."""
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = -n % TILE
    if pad or not rows.is_contiguous() or rows.data_ptr() % 64:  # a fresh copy: contiguous, 64-byte aligned
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([fn(tile) for tile in rows.split(TILE)])[:n]
    return out.reshape(*lead, out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, each row by a matmul of :data:`TILE` rows; the bias is added after the product."""
    out = rowwise(lambda tile: F.linear(tile, weight), x)
    return out if bias is None else out + bias


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group`` (a new tensor): the partials gathered, then added in rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over the allowed keys, summed one index at a time.

    ``q [n, qn, heads, d]`` queries of ``n`` sequences, ``k``/``v`` ``[n, kn, groups, d]`` their keys in position
    order (grouped-query heads: ``heads`` a multiple of ``groups``), ``allowed [n, qn, kn]`` (bool) which keys each
    query sees (at least one per query).  Returns ``[n, qn, heads * dv]``.  The scores sum over ``d``, the
    normaliser and the context over keys, each by elementwise adds in index order, so keys a query does not see
    (padding, the future, other layouts' filler) add exact zeros and change no bit.
    """
    n, qn, heads, d = q.shape
    groups, dv = k.shape[2], v.shape[-1]
    q = q.reshape(n, qn, groups, heads // groups, d).permute(0, 2, 3, 1, 4)   # [n, g, r, qn, d]
    k, v = k.permute(0, 2, 1, 3).unsqueeze(2), v.permute(0, 2, 1, 3).unsqueeze(2)  # [n, g, 1, kn, d]
    scores = q[..., 0, None] * k[..., None, :, 0]                                 # [n, g, r, qn, kn]
    for i in range(1, d):
        scores = scores + q[..., i, None] * k[..., None, :, i]
    see = allowed[:, None, None]
    scores = (scores * scale).masked_fill(~see, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    weights = rowwise(torch.exp, scores - peak)  # exp(-inf) = 0 for the keys not seen
    total = weights[..., 0]
    for j in range(1, weights.shape[-1]):
        total = total + weights[..., j]
    probs = weights / total[..., None]
    context = probs[..., 0, None] * v[:, :, :, 0, None, :]                       # [n, g, r, qn, dv]
    for j in range(1, probs.shape[-1]):
        context = context + probs[..., j, None] * v[:, :, :, j, None, :]
    return context.permute(0, 3, 1, 2, 4).reshape(n, qn, heads * dv)


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)`` in fp32 over full-vocabulary rows ``[..., v]``: the one expression of
    sampled tokens' log-probs, for the engine and (in batch-invariant mode) the trainer."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()  # x / 1 is x: skip the pass
    return scaled.log_softmax(dim=-1)
