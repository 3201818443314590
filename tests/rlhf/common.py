"""Tiny GPT configurations and padded prompts shared by the RLHF tests."""

from __future__ import annotations

import torch

from megalite.models import GPTConfig
from megalite.rlhf.generation import GenerationOutput
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


def scripted_output(prompts: torch.Tensor, prompt_mask: torch.Tensor, actions: list[list[int]], pad: int,
                    log_prob: float) -> GenerationOutput:
    """What a sampler returns when row ``i`` of ``prompts`` samples ``actions[i]``, every token at ``log_prob``."""
    b, p = prompts.shape
    n = max(len(a) for a in actions)
    tokens = torch.cat([prompts, torch.full((b, n), pad)], dim=1)
    response_mask = torch.zeros(b, n, dtype=torch.long)
    for i, action in enumerate(actions):
        tokens[i, p:p + len(action)] = torch.tensor(action)
        response_mask[i, :len(action)] = 1
    return GenerationOutput(tokens, torch.cat([prompt_mask, response_mask], dim=1), log_prob * response_mask.float(),
                            response_mask)
