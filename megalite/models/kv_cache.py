"""Keys and values of already-processed tokens, for incremental decoding.

:class:`KVCache` is the contiguous :class:`~megalite.models.attention.AttentionCache`
(the static decoder's); the inference engine's paged step is the other one.
"""

from __future__ import annotations

import torch

from megalite.models.attention import core_attention


class KVCache:
    """Per-layer keys/values ``[t, b, groups_local, d]`` of the ``offset`` tokens seen so far.

    Pass the same cache to successive ``GPTModel.forward`` calls: the first
    call processes the prompt, each later call only the new tokens.  The model
    appends every layer's new keys/values and advances ``offset`` once per call,
    so positions continue where the previous call stopped.
    """

    def __init__(self):
        self.offset = 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values of layer ``layer_number``; return all of them so far."""
        if layer_number in self.keys:
            key = torch.cat([self.keys[layer_number], key], dim=0)
            value = torch.cat([self.values[layer_number], value], dim=0)
        self.keys[layer_number], self.values[layer_number] = key, value
        return key, value

    def attend(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Append ``k``/``v`` and attend ``q`` over every cached position (causal after ``offset``)."""
        k, v = self.append(layer_number, k, v)
        return core_attention(q, k, v, dropout, self.offset, mask)

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more tokens as processed by every layer."""
        self.offset += num_tokens
