"""Plain-torch versions of every fused kernel.

These define what each fused op must compute, and they are what megalite
runs whenever the extension is not built or the inputs do not qualify.
Reductions run in fp32 and results come back in the input dtype, as the
fused kernels do.  One piece is not plain torch: on CUDA, dropout's
keep-mask is the counter-based draw of megalite.kernels.philox (a Triton
kernel), the one the CUDA kernels make.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import philox


def layer_norm(x, weight, bias, eps: float):
    """LayerNorm over the last dim."""
    return F.layer_norm(x.float(), (x.shape[-1],), _float(weight), _float(bias), eps).to(x.dtype)


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight."""
    return F.rms_norm(x.float(), (x.shape[-1],), _float(weight), eps).to(x.dtype)


def bias_gelu(x, bias):
    """gelu(x + bias) with the tanh approximation."""
    y = x if bias is None else x + bias
    return F.gelu(y.float(), approximate="tanh").to(x.dtype)


def bias_swiglu(x, bias):
    """silu(gate) * up where [gate, up] are the halves of the last dim of x + bias."""
    y = (x if bias is None else x + bias).float()
    gate, up = y.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rotate_half(x):
    """cat(-x2, x1) for the two halves x1, x2 of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin):
    """Rotary embedding of q [s, b, nq, d] and k [s, b, nk, d] with cos/sin [s, d]."""
    c = cos.float()[:, None, None, :]
    s = sin.float()[:, None, None, :]

    def rotate(x):
        xf = x.float()
        return (xf * c + rotate_half(xf) * s).to(x.dtype)

    return rotate(q), rotate(k)


def dropout_mask(x, p: float):
    """Keep-mask (bool, True = kept) for dropout with drop probability p.

    Drawn from the default generator of x's device, so RNG forks and
    activation recompute reproduce it, and the same mask the fused op
    draws.  On CPU one fp32 uniform per element compared with 1 - p (about
    three times cheaper there than ``bernoulli_`` into a bool tensor), which
    the CPU kernel reads; on CUDA the counter-based draw the CUDA kernels
    make inside themselves from a seed (megalite.kernels.philox).
    """
    if x.device.type == "cuda":
        return philox.keep_mask(philox.dropout_seed(x.device), x.shape, philox.keep_threshold(p))
    return torch.rand(x.shape, device=x.device) < (1.0 - p)


def bias_dropout_add(x, bias, residual, p: float, training: bool):
    """residual + dropout(x + bias)."""
    y = x if bias is None else x + bias
    if training and p > 0.0:
        y = y * dropout_mask(x, p) * (1.0 / (1.0 - p))
    return residual + y


def scaled_upper_triang_masked_softmax(x, scale: float):
    """softmax(x * scale) over the last dim with entries j > i masked (causal)."""
    sq, sk = x.shape[-2], x.shape[-1]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x.float() * scale).masked_fill(causal, float("-inf")), dim=-1).to(x.dtype)


def scaled_masked_softmax(x, mask, scale: float):
    """softmax(x * scale) over the last dim with mask == True masked; fully masked rows give zeros."""
    s = (x.float() * scale).masked_fill(mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    return (e / denom.clamp_min(torch.finfo(torch.float32).tiny)).to(x.dtype)


def permute_row_map(expert_indices):
    """Flat (token * k + slot) indices of kept assignments, stably sorted by expert id."""
    flat = expert_indices.reshape(-1)
    # On CUDA the radix sort makes a pass per key byte: int32 keys (any expert count) take half of int64's.
    order = torch.argsort(flat.int() if flat.is_cuda else flat, stable=True)
    dropped = int((flat < 0).sum())
    return order[dropped:]


def permute(tokens, expert_indices):
    """Rows of tokens [T, h] regrouped by expert: (permuted [n, h], row_map [n])."""
    row_map = permute_row_map(expert_indices)
    return tokens.index_select(0, torch.div(row_map, expert_indices.shape[1], rounding_mode="floor")), row_map


def unpermute(permuted, row_map, probs, num_tokens: int):
    """[num_tokens, h]: for every kept assignment, probs[t, slot] * its permuted row, summed per token."""
    k = probs.shape[1]
    weight = probs.reshape(-1).index_select(0, row_map).float()
    token = torch.div(row_map, k, rounding_mode="floor")
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=torch.float32, device=permuted.device)
    out = out.index_add(0, token, permuted.float() * weight[:, None])
    return out.to(permuted.dtype)


def paged_attention(q, keys, values, block_tables, starts, lengths, first, scale: float):
    """Attention of a few new queries per sequence over its paged KV cache (the fused op's contract).

    q ``[T, heads, d]`` packed new tokens; keys/values ``[groups, num_blocks, block, d]``;
    sequence s owns rows ``first[s] .. first[s] + lengths[s]``, its query i sits at position
    ``starts[s] + i`` and sees keys ``0 ..`` that position, read through ``block_tables[s]``.
    Heads are grouped by KV group (GQA).  Rows outside every sequence are 0.
    """
    groups, _, block, d = keys.shape
    per_group = q.shape[1] // groups
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for table, start, length, row in zip(block_tables.tolist(), starts.tolist(), lengths.tolist(), first.tolist()):
        context = start + length
        blocks = table[:-(-context // block)]
        key = keys[:, blocks].reshape(groups, -1, d)[:, :context].float().repeat_interleave(per_group, 0)
        value = values[:, blocks].reshape(groups, -1, d)[:, :context].float().repeat_interleave(per_group, 0)
        query = q[row:row + length].float().transpose(0, 1)
        visible = torch.arange(context, device=q.device)[None, :] <= start + torch.arange(length, device=q.device)[:, None]
        scores = (query @ key.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out[row:row + length] = (scores.softmax(-1) @ value).transpose(0, 1)
    return out.to(q.dtype)


def _float(t):
    return None if t is None else t.float()
