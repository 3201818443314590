"""Dropout's keep-mask on CUDA: a counter-based draw, not a tensor read from memory.

The fused CUDA kernels draw each element's keep decision inside the kernel (csrc/cuda/common.cuh,
``philox`` and ``keep_mask``), so neither the forward nor the backward moves a mask: a byte per element
written by a mask kernel and read back cost a third more traffic than the op itself.  This module holds
the definition of that draw for the reference ops (and so for their parity tests): Triton's
Philox4x32-10 (``tl.randint4x``) keyed by a 64-bit seed, element ``e`` taking word ``e % 4`` of draw
``e // 4`` (the draw's counter keeps the low 32 bits of ``e // 4``), kept when the word is below
``keep_threshold(p)``.

The seed is drawn from the device's default generator (``dropout_seed``), so RNG forks and activation
recompute replay the mask as they replay torch's own dropout, and CUDA graphs capture it.
"""

from __future__ import annotations

import torch


def dropout_seed(device: torch.device) -> torch.Tensor:
    """One int64 in [0, 2^63) from the default generator of ``device``, left on the device (no sync)."""
    return torch.empty((), dtype=torch.int64, device=device).random_()


def keep_threshold(p: float) -> int:
    """The 32-bit bound a draw's word must fall below to keep its element: probability 1 - p, to 2^-32."""
    return min(round((1.0 - p) * 2**32), 2**32 - 1)


def keep_mask(seed: torch.Tensor, shape, threshold: int) -> torch.Tensor:
    """The bool keep-mask of ``shape`` that the CUDA kernels draw under ``seed`` (see the module's docstring)."""
    out = torch.empty(shape, dtype=torch.bool, device=seed.device)
    n = out.numel()
    if n:
        kernel = _keep_mask_kernel()
        kernel[(-(-n // (4 * _BLOCK)),)](seed, out, n, threshold, BLOCK=_BLOCK)
    return out


_BLOCK = 1024  # draws per Triton program (4 elements each)
_KERNEL = None


def _keep_mask_kernel():
    """The Triton kernel, built on first use: Triton is imported only where a mask is drawn this way."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["n", "threshold"])
        def kernel(seed_ptr, out_ptr, n, threshold, BLOCK: tl.constexpr):
            draw = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            # A 32-bit offset: counter (draw mod 2^32, 0, 0, 0) in every Triton release's randint4x.
            w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), draw.to(tl.uint32))
            bound = threshold.to(tl.int64)
            e = draw * 4
            tl.store(out_ptr + e, w0.to(tl.uint32, bitcast=True).to(tl.int64) < bound, mask=e < n)
            tl.store(out_ptr + e + 1, w1.to(tl.uint32, bitcast=True).to(tl.int64) < bound, mask=e + 1 < n)
            tl.store(out_ptr + e + 2, w2.to(tl.uint32, bitcast=True).to(tl.int64) < bound, mask=e + 2 < n)
            tl.store(out_ptr + e + 3, w3.to(tl.uint32, bitcast=True).to(tl.int64) < bound, mask=e + 3 < n)

        _KERNEL = kernel
    return _KERNEL
