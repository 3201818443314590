"""Tiny GPT configurations and padded prompts shared by the RLHF tests."""

from __future__ import annotations

import torch

from megalite.models import GPTConfig

VOCAB = 40


def config(kind: str = "gpt2", **overrides) -> GPTConfig:
    """``gpt2``: LayerNorm/GELU/learned positions; ``llama``: RMSNorm/SwiGLU/RoPE/GQA without biases."""
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=24,
                make_vocab_size_divisible_by=8, seed=7)
    if kind == "llama":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                    add_bias_linear=False, ffn_hidden_size=48, norm_eps=1e-6)
    base.update(overrides)
    return GPTConfig(**base)


def padded_prompts(seed: int = 0, b: int = 3, p: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ``[b, p]`` (pad id 0) of lengths p, p-2, p-3, ... and their masks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, p), generator=g)
    mask = torch.ones(b, p, dtype=torch.long)
    for row in range(1, b):
        mask[row, :row + 1] = 0
    return ids * mask, mask
