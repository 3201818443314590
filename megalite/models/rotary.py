"""Rotary position embeddings (RoPE): frequencies, cos/sin tables and their application to queries and keys.

Frequency ``i`` (of ``d/2``, ``d`` the rotated channels) is ``base ** (-2i/d)``.  ``GPTConfig.rope_scaling``
stretches them for contexts longer than the model was first trained on:

- ``"linear"``: every frequency divided by ``rope_scaling_factor`` (position interpolation; Megatron's
  ``--rotary-seq-len-interpolation-factor``).
- ``"llama3"`` (Llama 3.1+): wavelengths shorter than ``original / rope_high_freq_factor`` kept, longer
  than ``original / rope_low_freq_factor`` divided by the factor, a smooth blend between
  (``original`` = ``rope_original_max_position_embeddings``).
- ``"yarn"``: per-frequency blend of the kept and the divided frequency along a linear ramp between the
  dimensions that turn ``yarn_beta_fast`` and ``yarn_beta_slow`` times over the original context
  (ramp ends rounded outwards when ``yarn_truncate``), and cos/sin scaled by ``yarn_attention_factor``,
  by default ``yarn_mscale(factor, yarn_mscale) / yarn_mscale(factor, yarn_mscale_all_dim)`` (Megatron's
  and DeepSeek's ``mscale``/``mscale_all_dim``; ``0.1 ln(factor) + 1`` with their defaults 1 and 0).
  Multi-latent attention also multiplies its softmax scale by ``yarn_mscale(factor, yarn_mscale_all_dim) ** 2``.

The formulas are those of the Llama 3.1 and YaRN papers, in the order Hugging Face evaluates them
in fp32, so converted checkpoints compute the same tables.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megalite import batch_invariant, kernels


def inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim/2] fp32, cos/sin scale)`` of a GPTConfig's rotary embedding."""
    dim, base = config.rotary_dim, config.rotary_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    kind, factor = config.rope_scaling, config.rope_scaling_factor
    if kind is None:
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = config.rope_original_max_position_embeddings
    if kind == "llama3":
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, blended, scaled), 1.0
    return _yarn(config, dim, base, factor, original)


def _yarn(config, dim: int, base: float, factor: float, original: int) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.yarn_beta_fast), correction_dim(config.yarn_beta_slow)
    if config.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    scale = config.yarn_attention_factor
    if scale is None:
        scale = yarn_mscale(factor, config.yarn_mscale) / yarn_mscale(factor, config.yarn_mscale_all_dim)
    return inv_freq, float(scale)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[*positions.shape, d]`` of a GPTConfig (``d`` = ``config.rotary_dim``).

    Tables are in the rotate-half convention: both halves of the rotated
    channels share frequency ``i``, so ``cat([freqs, freqs])`` gives one angle
    per channel (:func:`apply_rotary` maps interleaved pairs onto it).  They
    are computed in fp32 on the fly: cheap next to attention, and no state
    that could differ between ranks.
    """

    def __init__(self, config):
        super().__init__()
        if config.rotary_dim % 2:
            raise ValueError(f"rotary embeddings need an even number of rotated channels, got {config.rotary_dim}")
        self.head_dim = config.rotary_dim
        self.inv_freq, self.scale = inverse_frequencies(config)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, head_dim]`` for integer ``positions`` (``[s]``, or ``[s, b]`` per row)."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        angles = torch.cat([angles, angles], dim=-1)
        if batch_invariant.enabled():  # a fixed-shape call per row: no element in a vector loop's scalar tail
            cos, sin = batch_invariant.rowwise(torch.cos, angles), batch_invariant.rowwise(torch.sin, angles)
        else:
            cos, sin = angles.cos(), angles.sin()
        if self.scale == 1.0:
            return cos, sin
        return cos * self.scale, sin * self.scale


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]`` (rotate-half layout)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_halves`."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [s, b, nq, d]`` and ``k [s, b, nk, d]`` by tables ``[s, d]`` (shared) or ``[s, b, d]`` (per row).

    Per-row tables fold the batch into the sequence dimension, so both cases
    run on :func:`megalite.kernels.apply_rotary`.  Tables narrower than the
    head (``rotary_percent < 1``) rotate the leading channels only, as Megatron does.
    ``interleaved`` rotates neighbouring channel pairs (GPT-J, Megatron's
    ``--rotary-interleaved``) instead of the two halves: the pairs are gathered
    into halves, rotated, and put back.
    """
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rot], k[..., :rot], cos, sin, interleaved)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
    if interleaved:
        q, k = apply_rotary(_halves(q), _halves(k), cos, sin)
        return _pairs(q), _pairs(k)
    if cos.dim() == 2:
        return kernels.apply_rotary(q, k, cos, sin)
    s, b = q.shape[:2]
    q, k = kernels.apply_rotary(q.reshape(s * b, 1, *q.shape[2:]), k.reshape(s * b, 1, *k.shape[2:]),
                                cos.reshape(s * b, -1), sin.reshape(s * b, -1))
    return q.view(s, b, *q.shape[2:]), k.view(s, b, *k.shape[2:])
