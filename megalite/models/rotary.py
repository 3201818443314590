"""Rotary position embeddings (RoPE): the cos/sin tables for megalite.kernels.apply_rotary."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[s, d]`` in the rotate-half convention.

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
        """cos and sin of shape ``[len(positions), head_dim]`` for integer ``positions``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.base ** exponents)
        angles = torch.outer(positions.to(torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()
