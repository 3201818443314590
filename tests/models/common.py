"""Tiny GPT configurations and helpers shared by the model tests."""

from __future__ import annotations

import torch

from megalite.models import GPTConfig

VOCAB = 100


def config(kind: str = "gpt2", **overrides) -> GPTConfig:
    """``gpt2``: LayerNorm, GELU, learned positions.  ``llama``: RMSNorm, SwiGLU, RoPE, GQA, no biases."""
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                make_vocab_size_divisible_by=8)
    if kind == "llama":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                    add_bias_linear=False, ffn_hidden_size=48, norm_eps=1e-6)
    base.update(overrides)
    return GPTConfig(**base)


def batch(seed: int = 0, b: int = 2, s: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels ``[b, s]``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
