"""Ring attention (``p2p``): key/value blocks travel around the CP ring while the block in hand is attended.

Step ``t`` on rank ``r`` attends the local queries to the keys/values of rank
``(r - t) mod cp``, having already posted the send of that block to ``r + 1``
and the receive of the next one from ``r - 1``, so the transfer overlaps the
attention.  Partial results merge exactly through their log-sum-exp.  The
backward sends the blocks around again, each with its gradient accumulator,
which after a full turn lands back on the block's owner.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megalite.context_parallel.blockwise import Tokens, attention_backward, attention_forward, merge


def _exchange(tensor: torch.Tensor, group):
    """Post the send of ``tensor`` to the next ring rank and the receive from the previous one."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests, stats: dict | None) -> None:
    start = time.perf_counter()
    for request in requests:
        request.wait()
    if stats is not None:
        stats["wait_s"] = stats.get("wait_s", 0.0) + time.perf_counter() - start


class RingAttention(torch.autograd.Function):
    """``q``/``k`` ``[b, n|g, s/cp, d]``, ``v [b, g, s/cp, dv]`` -> output ``[b, n, s/cp, dv]``.

    ``key_tokens[j]`` describes the tokens CP rank ``j`` holds; ``window`` is the
    sliding window (see :mod:`megalite.context_parallel.blockwise`).  ``stats``, when
    a dict, accumulates the seconds spent waiting on receives (``wait_s``), in
    the whole attention (``total_s``), and the tiles' matmul FLOPs.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, queries: Tokens, key_tokens: list, scale: float, stats: dict | None,
                window: int | None = None):
        start = time.perf_counter()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dk = k.shape[-1]  # keys and values travel as one tensor, concatenated on the head dim (which may differ)
        kv = torch.cat([k, v], dim=-1).contiguous()
        out = lse = None
        for step in range(size):
            requests = None
            if step < size - 1:
                received, requests = _exchange(kv, group)
            block_out, block_lse = attention_forward(q, kv[..., :dk], kv[..., dk:], queries,
                                                     key_tokens[(rank - step) % size], scale, stats, window)
            out, lse = merge(out, lse, block_out, block_lse)
            if requests is not None:
                _wait(requests, stats)
                kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.queries, ctx.key_tokens, ctx.scale, ctx.stats = group, queries, key_tokens, scale, stats
        ctx.window = window
        if stats is not None:
            stats["total_s"] = stats.get("total_s", 0.0) + time.perf_counter() - start
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        start = time.perf_counter()
        q, k, v, out, lse = ctx.saved_tensors
        group, stats = ctx.group, ctx.stats
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dk = k.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        dq = pending = None
        for step in range(size):
            requests = None
            if step < size - 1:
                received, requests = _exchange(kv, group)
            keys = ctx.key_tokens[(rank - step) % size]
            dq_b, dk_b, dv_b = attention_backward(dout, q, kv[..., :dk], kv[..., dk:], out, lse, ctx.queries, keys,
                                                  ctx.scale, stats, ctx.window)
            dq = dq_b if dq is None else dq + dq_b
            # The block's gradient accumulator arrives from the previous rank while this step computes.
            if pending is None:
                dkv = torch.cat([dk_b, dv_b], dim=-1)
            else:
                _wait(pending[1], stats)
                dkv = pending[0]
                dkv[..., :dk] += dk_b
                dkv[..., dk:] += dv_b
            pending = _exchange(dkv, group) + (dkv,)
            if requests is not None:
                _wait(requests, stats)
                kv = received
        # After a full turn each accumulator is back with its block's owner.
        _wait(pending[1], stats)
        dkv = pending[0]
        if stats is not None:
            stats["total_s"] = stats.get("total_s", 0.0) + time.perf_counter() - start
        return (dq.to(q.dtype), dkv[..., :dk].to(k.dtype), dkv[..., dk:].to(v.dtype), None, None, None, None, None,
                None)
