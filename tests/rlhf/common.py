"""Tiny GPT configurations and padded prompts shared by the RLHF tests."""

from __future__ import annotations

import torch

from megalite.models import GPTConfig
from tests.models.common import config as base_config

VOCAB = 40


def config(kind: str = "gpt2", **overrides) -> GPTConfig:
    """The models tests' tiny ``gpt2``/``llama`` configs with a smaller vocabulary and longer positions."""
    return base_config(kind, **{"vocab_size": VOCAB, "max_position_embeddings": 24, "seed": 7, **overrides})


def padded_prompts(seed: int = 0, b: int = 3, p: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ``[b, p]`` (pad id 0) of lengths p, p-2, p-3, ... and their masks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, p), generator=g)
    mask = torch.ones(b, p, dtype=torch.long)
    for row in range(1, b):
        mask[row, :row + 1] = 0
    return ids * mask, mask
