"""Rotary position embeddings (RoPE): cos/sin tables (plain or YaRN-scaled) and their application."""

from __future__ import annotations

import math

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

    def inv_freq(self, device) -> torch.Tensor:
        """The ``head_dim / 2`` angular frequencies ``base ** (-2i/d)`` (fp32)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.base ** exponents)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, head_dim]`` for integer ``positions`` (``[s]``, or ``[s, b]`` per row)."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq(positions.device)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class YarnRotaryEmbedding(RotaryEmbedding):
    """YaRN RoPE (Megatron's ``--rope-type yarn``, Hugging Face's ``rope_type: "yarn"``) for a context
    stretched ``factor`` times past ``original_max_position_embeddings``.

    Frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those that turn more than
    ``beta_fast`` times keep their value, with a linear ramp between (the ramp's
    ends rounded outward, as DeepSeek does).  The cos/sin tables are multiplied
    by ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``;
    the softmax scale's own factor ``yarn_mscale(factor, mscale_all_dim) ** 2``
    is the attention module's (see :func:`yarn_mscale`).
    """

    def __init__(self, head_dim: int, base: float, factor: float, original_max_position_embeddings: int,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0):
        super().__init__(head_dim, base)
        self.factor, self.original = factor, original_max_position_embeddings
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.table_scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)

    def _correction_dim(self, rotations: float) -> float:
        """The channel whose frequency turns ``rotations`` times over the original context."""
        return self.head_dim * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

    def inv_freq(self, device) -> torch.Tensor:
        plain = super().inv_freq(device)
        low = max(math.floor(self._correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(self._correction_dim(self.beta_slow)), self.head_dim - 1)
        span = max(high - low, 0.001)
        ramp = ((torch.arange(self.head_dim // 2, dtype=torch.float32, device=device) - low) / span).clamp(0, 1)
        return plain / self.factor * ramp + plain * (1 - ramp)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(positions)
        return cos * self.table_scale, sin * self.table_scale


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
