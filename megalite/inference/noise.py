"""The engine's random numbers: a stateless, counter-based stream per sample, computed for a whole batch at once.

A sample's randomness at token position ``t`` (the index in its sequence, prompt included, of the token being
chosen) is a pure function of ``(seed, t)``: one uniform per vocabulary entry, turned into ``Exp(1)`` noise for
the draw ``argmax(p / q)``, which picks token ``j`` with probability ``p_j`` (speculative verification compares
each draft with this draw at the draft's position).  There is no generator state: a sample's tokens depend only on its seed and its own logits,
whatever batch it runs in, and a generation resumed at position ``t`` (a partial rollout continued after a weight
update) draws what an uninterrupted one would have drawn there.

The mixing function is the 32-bit "lowbias32" integer hash (Wellons' hash prospector: xor-shift 16, multiply
``0x7feb352d``, xor-shift 15, multiply ``0x846ca68b``, xor-shift 16), evaluated on int64 tensors holding 32-bit
values: each product is reduced mod 2^32 by a mask, and the multiplier above 2^31 is used as its negative
representative ``0x846ca68b - 2^32``, so no product leaves the signed 64-bit range.  The uniform of
``(seed, t, j)`` is ``((h >> 9) + 1/2) / 2^23`` (exact in fp32, never 0 or 1) with
``h = mix(mix(k1 ^ j) ^ k2)``, where the row keys are ``k = mix(mix(mix(t ^ c) ^ lo) ^ hi)`` for ``c`` = ``KEY1``
(``k1``) and ``KEY2`` (``k2``), ``lo`` and ``hi`` the low and high 32 bits of
the seed (a signed 64-bit integer: :func:`as_seed`): three rounds of mixing per row, two per entry.
"""

from __future__ import annotations

import torch

MASK = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_SIGNED = tuple(m - 2 ** 32 if m >= 2 ** 31 else m for m in _MULTIPLIERS)  # congruent mod 2^32, |m| < 2^31
KEY1, KEY2 = 0x2545F491, 0x192B07E3


def as_seed(seed: int) -> int:
    """``seed`` mod 2^64 as the signed 64-bit integer the noise functions take (any Python int is a seed)."""
    return (int(seed) + 2 ** 63) % 2 ** 64 - 2 ** 63


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of an int64 tensor of 32-bit values, in place (returns ``x``)."""
    x ^= x >> 16
    x.mul_(_SIGNED[0]).bitwise_and_(MASK)
    x ^= x >> 15
    x.mul_(_SIGNED[1]).bitwise_and_(MASK)
    x ^= x >> 16
    return x


def _row_keys(seeds: list[int], positions: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys ``[r]`` of each row's ``(seed, position)``."""
    position, seed = torch.tensor([positions, seeds], dtype=torch.int64, device=device)
    constants = torch.tensor([KEY1, KEY2], dtype=torch.int64, device=device)
    keys = mix(position.bitwise_and_(MASK)[:, None] ^ constants)
    keys = mix(keys.bitwise_xor_((seed & MASK)[:, None]))
    return mix(keys.bitwise_xor_((seed >> 32).bitwise_and_(MASK)[:, None])).unbind(1)


def uniform(seeds: list[int], positions: list[int], width: int, device="cpu") -> torch.Tensor:
    """Uniforms in (0, 1) ``[r, width]`` (fp32, each a multiple of 2^-24 in ``[2^-24, 1 - 2^-24]``): row ``i``
    is sample ``seeds[i]``'s (signed 64-bit, :func:`as_seed`) at ``positions[i]``."""
    k1, k2 = _row_keys(seeds, positions, device)
    x = mix(k1[:, None] ^ torch.arange(width, dtype=torch.int64, device=device))
    x = mix(x.bitwise_xor_(k2[:, None]))
    return (x >> 9).float().add_(0.5).mul_(2.0 ** -23)


def exponential(seeds: list[int], positions: list[int], width: int, device="cpu") -> torch.Tensor:
    """``Exp(1)`` noise ``[r, width]`` (fp32, every entry > 0): ``-log`` of :func:`uniform`."""
    return uniform(seeds, positions, width, device).log_().neg_()

