"""Rotary position embeddings (RoPE): cos/sin tables and their application to queries and keys."""

from __future__ import annotations

import torch
from torch import nn

from megalite import kernels


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[*positions.shape, d]`` in the rotate-half convention.

    Frequency ``i`` (of ``d/2``) is ``base ** (-2i/d)``; both halves of the
    head dimension share it, so ``cat([freqs, freqs])`` gives one angle per
    channel.  Tables are computed in fp32 on the fly: they are cheap next to
    attention and carry no state that could differ between ranks.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.base = base

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, head_dim]`` for integer ``positions`` (``[s]``, or ``[s, b]`` per row)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.base ** exponents)
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [s, b, nq, d]`` and ``k [s, b, nk, d]`` by tables ``[s, d]`` (shared) or ``[s, b, d]`` (per row).

    Per-row tables fold the batch into the sequence dimension, so both cases
    run on :func:`megalite.kernels.apply_rotary`.  Tables narrower than the
    head (``rotary_percent < 1``) rotate the leading channels only, as Megatron does.
    """
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rot], k[..., :rot], cos, sin)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
    if cos.dim() == 2:
        return kernels.apply_rotary(q, k, cos, sin)
    s, b = q.shape[:2]
    q, k = kernels.apply_rotary(q.reshape(s * b, 1, *q.shape[2:]), k.reshape(s * b, 1, *k.shape[2:]),
                                cos.reshape(s * b, -1), sin.reshape(s * b, -1))
    return q.view(s, b, *q.shape[2:]), k.view(s, b, *k.shape[2:])
