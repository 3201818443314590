"""A plain single-process GPT in torch (nn.Linear, nn.Embedding, scaled_dot_product_attention).

It is the reference that megalite's GPTModel must match, and the torch-native
baseline of benchmarks/gpt_overhead.py.  Activations are batch-first
``[b, s, h]``; QKV is one ``[q; k; v]`` linear and SwiGLU's fc1 one
``[gate; up]`` linear, as in common torch GPTs.  ``load_megalite`` copies the
weights of a tp=1 megalite model, undoing its grouped QKV layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _norm(config):
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class PlainAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
        h = config.hidden_size
        self.qkv = nn.Linear(h, (self.heads + 2 * self.groups) * self.head_dim, bias=config.add_bias_linear)
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=config.add_bias_linear)
        self.dropout = config.attention_dropout

    def forward(self, x, rope):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.groups * self.head_dim,
                                     self.groups * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                             enable_gqa=self.groups != self.heads)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class PlainMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation = config.activation
        ffn = config.ffn_hidden_size
        self.fc1 = nn.Linear(config.hidden_size, 2 * ffn if self.activation == "swiglu" else ffn,
                             bias=config.add_bias_linear)
        self.fc2 = nn.Linear(ffn, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x):
        x = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.fc2(x)


class PlainBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1, self.attn = _norm(config), PlainAttention(config)
        self.norm2, self.mlp = _norm(config), PlainMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, rope):
        x = x + self.dropout(self.attn(self.norm1(x), rope))
        return x + self.dropout(self.mlp(self.norm2(x)))


class PlainGPT(nn.Module):
    """``forward(ids [b, s], labels=None)`` -> logits ``[b, s, v]`` or per-token loss ``[b, s]``."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.wpe = nn.Embedding(config.max_position_embeddings, h) if config.position_embedding_type != "rope" else None
        self.drop = nn.Dropout(config.hidden_dropout)
        self.blocks = nn.ModuleList(PlainBlock(config) for _ in range(config.num_layers))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        if not config.untie_embeddings_and_output_weights:
            self.lm_head.weight = self.wte.weight

    def _rope(self, s, device):
        d = self.config.kv_channels
        inv_freq = 1.0 / self.config.rotary_base ** (torch.arange(0, d, 2, device=device).float() / d)
        angles = torch.outer(torch.arange(s, device=device).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, ids, labels=None):
        b, s = ids.shape
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=ids.device))
        x = self.drop(x)
        rope = self._rope(s, ids.device) if self.wpe is None else None
        for block in self.blocks:
            x = block(x, rope)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(b, s)

    @torch.no_grad()
    def load_megalite(self, model) -> None:
        """Copy the weights of a tp=1 megalite GPTModel holding all layers."""
        c, v = self.config, self.config.vocab_size
        self.wte.weight.copy_(model.embedding.word_embeddings.weight[:v])
        if self.wpe is not None:
            self.wpe.weight.copy_(model.embedding.position_embeddings.weight)
        if model.output_layer is not None:
            self.lm_head.weight.copy_(model.output_layer.weight[:v])
        r, d = c.num_attention_heads // c.num_query_groups, c.kv_channels
        for i, block in enumerate(self.blocks):
            layer = model.decoder.layers[str(i)]
            self._copy_norm(block.norm1, layer.input_layernorm)
            self._copy_norm(block.norm2, layer.pre_mlp_layernorm)
            attn = layer.self_attention
            for name in ("weight", "bias"):
                qkv = getattr(attn.linear_qkv, name)
                if qkv is None:
                    continue
                grouped = qkv.view(c.num_query_groups, r + 2, d, -1)
                q, k, v_ = grouped[:, :r], grouped[:, r], grouped[:, r + 1]
                getattr(block.attn.qkv, name).copy_(torch.cat([t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v_)]))
                getattr(block.attn.proj, name).copy_(getattr(attn.linear_proj, name))
                getattr(block.mlp.fc1, name).copy_(getattr(layer.mlp.linear_fc1, name))
                getattr(block.mlp.fc2, name).copy_(getattr(layer.mlp.linear_fc2, name))
        self._copy_norm(self.norm, model.decoder.final_layernorm)

    @staticmethod
    def _copy_norm(dst, src):
        dst.weight.copy_(src.weight)
        if getattr(dst, "bias", None) is not None:
            dst.bias.copy_(src.bias)
