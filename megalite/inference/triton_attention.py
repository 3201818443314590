"""A Triton kernel for decode attention over the paged KV cache, read in place through the block tables.

The static decode step's SDPA attention (:class:`megalite.inference.static_decode.StaticDecodeCache`)
first gathers every row's blocks, padded to its context bucket, into a new tensor: it writes and reads the keys
and values once more than attention needs.  This kernel reads each block where it lies instead: one program per
(row, KV group) walks the row's blocks up to its context length (from the window's first block on a
sliding-window model), keeps the group's query heads in registers and accumulates an online softmax in fp32.
Shapes and launch grid depend only on the bucket, and the lengths are read on the device, so it can be captured
in a CUDA graph.  ``EngineConfig.decode_attention`` ``"triton"`` selects it, and its default ``"auto"`` on CUDA;
Triton must be installed (it comes with PyTorch's CUDA builds).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps the SDPA path
    triton = None

if triton is not None:
    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, contexts_ptr, out_ptr, scale, window,
                      stride_qb, stride_qh, stride_kg, stride_kb, stride_kt, stride_tb, stride_c, stride_ob, stride_oh,
                      PER_GROUP: tl.constexpr, PG: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr, WINDOWED: tl.constexpr):
        row = tl.program_id(0)
        group = tl.program_id(1)
        heads, dims, slots = tl.arange(0, PG), tl.arange(0, DP), tl.arange(0, BS)
        head_ok, dim_ok = heads < PER_GROUP, dims < D
        q = tl.load(q_ptr + row * stride_qb + (group * PER_GROUP + heads)[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        context = tl.load(contexts_ptr + row * stride_c)
        first = 0
        if WINDOWED:  # every block walked holds at least one visible key, so the running max is finite
            first = tl.maximum(context - 1 - window, 0) // BS
        m = tl.full([PG], float("-inf"), tl.float32)
        total = tl.zeros([PG], tl.float32)
        acc = tl.zeros([PG, DP], tl.float32)
        for j in range(first, tl.cdiv(context, BS)):
            block = tl.load(tables_ptr + row * stride_tb + j)
            where = group.to(tl.int64) * stride_kg + block * stride_kb + slots[:, None] * stride_kt + dims[None, :]
            k = tl.load(k_ptr + where, mask=dim_ok[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + where, mask=dim_ok[None, :], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            pos = j * BS + slots
            visible = pos < context
            if WINDOWED:
                visible = visible & (pos >= context - 1 - window)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        tl.store(out_ptr + row * stride_ob + (group * PER_GROUP + heads)[:, None] * stride_oh + dims[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def available() -> bool:
    """Whether the kernel can run (Triton is installed)."""
    return triton is not None


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                 contexts: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """One query per row: ``q [B, heads, d]`` over ``keys``/``values`` ``[groups, blocks, block_size, d]``
    through ``tables [B, C]`` (int64 block ids) for ``contexts [B]`` keys each -> ``[B, heads, d]``.
    ``block_size`` must be a power of two."""
    b, heads, d = q.shape
    groups, _, bs, _ = keys.shape
    if q.stride(2) != 1 or keys.stride(3) != 1 or values.stride() != keys.stride() or tables.stride(1) != 1:
        raise ValueError("paged_decode needs the head dimension and each row of block ids contiguous, and keys and "
                         "values laid out alike")
    out = torch.empty_like(q)
    _paged_decode[(b, groups)](
        q, keys, values, tables, contexts, out, scale, 0 if window is None else window,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), tables.stride(0),
        contexts.stride(0), out.stride(0), out.stride(1), PER_GROUP=heads // groups,
        PG=triton.next_power_of_2(heads // groups), BS=bs, D=d, DP=triton.next_power_of_2(d),
        WINDOWED=window is not None)
    return out
