"""Tiny GPT configurations and helpers shared by the model tests."""

from __future__ import annotations

import torch

from megalite.models import GPTConfig
from megalite.tensor_parallel import pad_vocab_size

VOCAB = 100


def config(kind: str = "gpt2", **overrides) -> GPTConfig:
    """``gpt2``: LayerNorm, GELU, learned positions.  ``llama``: RMSNorm, SwiGLU, RoPE, GQA, no biases.
    ``llama_kv``: llama with a head dimension other than hidden/heads, RoPE on half of it, tanh GELU.
    ``qwen``: llama with a Q/K/V-only bias, per-head q/k norms, head dim 12, interleaved YaRN RoPE.
    ``mla``: llama with DeepSeek's multi-latent attention and YaRN RoPE (4x past 8 positions, mscale)."""
    base = dict(vocab_size=VOCAB, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
                make_vocab_size_divisible_by=8)
    if kind == "llama_kv":
        base.update(normalization="RMSNorm", activation="gelu_tanh", position_embedding_type="rope",
                    num_query_groups=2, kv_channels=12, rotary_percent=0.5, rotary_base=500000.0)
    if kind == "qwen":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                    add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, kv_channels=12,
                    rotary_interleaved=True, rope_scaling="yarn", rope_scaling_factor=4.0,
                    rope_original_max_position_embeddings=8)
    if kind == "llama":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", num_query_groups=2,
                    add_bias_linear=False, ffn_hidden_size=48, norm_eps=1e-6)
    if kind == "mla":
        base.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False,
                    ffn_hidden_size=48, norm_eps=1e-6, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12,
                    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_scaling="yarn", rope_scaling_factor=4.0,
                    rope_original_max_position_embeddings=8, yarn_mscale=0.9, yarn_mscale_all_dim=0.7)
    base.update(overrides)
    return GPTConfig(**base)


def batch(seed: int = 0, b: int = 2, s: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels ``[b, s]``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def full_to_shard(name, full, param, cfg, rank, tp):
    """This TP rank's block of a tp=1 tensor (weight or grad), in megalite's per-rank layout."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if "word_embeddings" in name or "output_layer" in name:
        vocab = cfg.vocab_size
        padded = pad_vocab_size(vocab, cfg.make_vocab_size_divisible_by, tp)
        full = torch.cat([full[:vocab], full.new_zeros(padded - vocab, *full.shape[1:])])
    if "linear_fc1" in name and cfg.activation == "swiglu":
        ffn = full.shape[0] // 2  # the MLP's ffn_hidden_size, or an MoE shared expert's
        full = full.view(2, tp, ffn // tp, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
    return full.chunk(tp, dim=param.partition_dim)[rank]


def left_padded(seed: int = 0, b: int = 3, s: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids (pad id 0), next-token labels and masks ``[b, s]``; row ``r > 0`` has ``r + 1`` pads."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (b, s + 1), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(1, b):
        mask[row, :row + 1] = 0
    return tokens[:, :-1] * mask, tokens[:, 1:] * mask, mask
