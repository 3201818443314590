"""Fused kernels with automatic fallback to plain torch.

Each function validates its inputs, then runs the fused op from the
``megalite._C`` extension when it is built, fusion is enabled and the inputs
qualify (a supported dtype, a device the extension was built for, contiguous
tensors); otherwise it runs the matching function in ``reference``.
``set_fused(False)`` or ``MEGALITE_NO_FUSED=1`` forces the reference
everywhere, which is how model-level parity tests compare the two.
``python -m megalite.kernels`` prints what is fused on this machine.
"""

from __future__ import annotations

import os

import torch

from . import fused as _fused
from . import reference

__all__ = [
    "apply_rotary", "available_ops", "bias_dropout_add", "bias_gelu", "bias_swiglu", "fused_enabled",
    "layer_norm", "paged_attention", "paged_attention_fused", "permute", "reference", "rms_norm", "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax", "set_fused", "unpermute",
]

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_enabled = os.environ.get("MEGALITE_NO_FUSED") != "1"


def set_fused(enabled: bool) -> None:
    """Turn fused kernels on or off for every later call in this process."""
    global _enabled
    _enabled = bool(enabled)


def fused_enabled() -> bool:
    """True when calls use fused kernels (enabled and the extension is built)."""
    return _enabled and _fused.BUILT


def available_ops() -> dict[str, bool]:
    """Op name -> whether a fused kernel for it is built on this machine."""
    return {name: _fused.BUILT for name in _fused.OPS}


def _qualifies(*tensors) -> bool:
    """Fused path allowed for these tensors (None entries are ignored)."""
    if not fused_enabled():
        return False
    present = [t for t in tensors if t is not None]
    device = present[0].device
    if not _fused.supports_device(device):
        return False
    return all(t.device == device and t.is_contiguous() for t in present)


def _float_dtype(*tensors) -> bool:
    present = [t for t in tensors if t is not None]
    return all(t.dtype in _FLOAT_TYPES for t in present) and len({t.dtype for t in present}) == 1


def _check_last_dim(name: str, x, param_name: str, param) -> None:
    if param is not None and tuple(param.shape) != (x.shape[-1],):
        raise ValueError(f"{name}: {param_name} has shape {tuple(param.shape)}, expected ({x.shape[-1]},) "
                         f"to match the last dim of x {tuple(x.shape)}")


def _import_apex_norms():
    """apex's fused norm module when NVIDIA apex imports, else None: apex is optional."""
    try:
        from apex.normalization import fused_layer_norm
    except Exception:
        return None
    return fused_layer_norm


_APEX_NORMS = _import_apex_norms()


def _apex_applies(x, *params) -> bool:
    return (_APEX_NORMS is not None and fused_enabled() and x.is_cuda
            and all(p is not None for p in params) and _float_dtype(x))


def layer_norm(x, weight, bias, eps: float):
    """LayerNorm over the last dim of x with weight and bias of size x.shape[-1].

    On GPU, apex's fused LayerNorm when apex imports; otherwise megalite's own kernel.
    """
    _check_last_dim("layer_norm", x, "weight", weight)
    _check_last_dim("layer_norm", x, "bias", bias)
    if _apex_applies(x, weight, bias):
        return _APEX_NORMS.fused_layer_norm_affine(x, weight, bias, (x.shape[-1],), eps)
    if (weight is not None and bias is not None and _float_dtype(x) and _qualifies(x, weight, bias)
            and _fused.row_fits(x)):
        return _fused.layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last dim of x with weight of size x.shape[-1].

    On GPU, apex's fused RMSNorm when apex imports; otherwise megalite's own kernel.
    """
    _check_last_dim("rms_norm", x, "weight", weight)
    if _apex_applies(x, weight):
        return _APEX_NORMS.fused_rms_norm_affine(x, weight, (x.shape[-1],), eps)
    if weight is not None and _float_dtype(x) and _qualifies(x, weight) and _fused.row_fits(x):
        return _fused.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def bias_gelu(x, bias):
    """gelu(x + bias, approximate="tanh"); bias has size x.shape[-1] or is None."""
    _check_last_dim("bias_gelu", x, "bias", bias)
    if _float_dtype(x, bias) and _qualifies(x, bias):
        return _fused.bias_gelu(x, bias)
    return reference.bias_gelu(x, bias)


def bias_swiglu(x, bias):
    """silu(gate) * up for [gate, up] = halves of the last dim of x + bias (bias may be None)."""
    if x.shape[-1] % 2:
        raise ValueError(f"bias_swiglu: the last dim of x {tuple(x.shape)} must be even, got {x.shape[-1]}")
    _check_last_dim("bias_swiglu", x, "bias", bias)
    if _float_dtype(x, bias) and _qualifies(x, bias):
        return _fused.bias_swiglu(x, bias)
    return reference.bias_swiglu(x, bias)


def apply_rotary(q, k, cos, sin):
    """Rotate-half rotary embedding of q [s, b, nq, d] and k [s, b, nk, d] by cos/sin [s, d]."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"apply_rotary: {name} must be [s, b, heads, d], got shape {tuple(t.shape)}")
    s, d = q.shape[0], q.shape[-1]
    if k.shape[0] != s or k.shape[-1] != d or k.shape[1] != q.shape[1]:
        raise ValueError(f"apply_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in s, b and d")
    if d % 2:
        raise ValueError(f"apply_rotary: head dim d={d} must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (s, d):
            raise ValueError(f"apply_rotary: {name} has shape {tuple(t.shape)}, expected ({s}, {d})")
    if (fused_enabled() and _float_dtype(q, k) and not cos.requires_grad and not sin.requires_grad
            and cos.device == q.device and sin.device == q.device):
        # q and k are usually strided views into the fused QKV projection: one copy each for the
        # fused kernel still beats the eager rotate-half.
        q_dense, k_dense = q.contiguous(), k.contiguous()
        if _qualifies(q_dense, k_dense):
            return _fused.apply_rotary(q_dense, k_dense, cos, sin)
    return reference.apply_rotary(q, k, cos, sin)


def bias_dropout_add(x, bias, residual, p: float, training: bool):
    """residual + dropout(x + bias, p) (dropout only when training); bias may be None."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"bias_dropout_add: dropout probability p={p} must be in [0, 1)")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"bias_dropout_add: residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    _check_last_dim("bias_dropout_add", x, "bias", bias)
    if _float_dtype(x, bias, residual) and _qualifies(x, bias, residual):
        return _fused.bias_dropout_add(x, bias, residual, p, training)
    return reference.bias_dropout_add(x, bias, residual, p, training)


def scaled_upper_triang_masked_softmax(x, scale: float):
    """Causal softmax(x * scale) over the last dim of x [..., s, s]."""
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"scaled_upper_triang_masked_softmax: x must be [..., sq, sk] with sq == sk, "
                         f"got shape {tuple(x.shape)}")
    if _float_dtype(x) and _qualifies(x) and _fused.row_fits(x):
        return _fused.scaled_upper_triang_masked_softmax(x, scale)
    return reference.scaled_upper_triang_masked_softmax(x, scale)


def scaled_masked_softmax(x, mask, scale: float):
    """softmax(x * scale) over the last dim where mask (bool, True = masked) broadcasts to x."""
    if mask.dtype != torch.bool:
        raise ValueError(f"scaled_masked_softmax: mask must be bool, got {mask.dtype}")
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        raise ValueError(f"scaled_masked_softmax: mask {tuple(mask.shape)} does not broadcast to x "
                         f"{tuple(x.shape)}") from None
    if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
        raise ValueError(f"scaled_masked_softmax: mask {tuple(mask.shape)} broadcasts x {tuple(x.shape)} "
                         f"to a larger shape")
    if 2 <= x.dim() <= 4 and mask.device == x.device and _float_dtype(x) and _qualifies(x) and _fused.row_fits(x):
        return _fused.scaled_masked_softmax(x, mask, scale)
    return reference.scaled_masked_softmax(x, mask, scale)


def permute(tokens, expert_indices):
    """Group (token, slot) assignments by expert: returns (permuted [n, h], row_map [n]).

    tokens [T, h]; expert_indices [T, k] int64 with -1 for a dropped assignment.
    Rows are sorted stably by expert id and row_map[j] = t * k + slot.
    """
    if tokens.dim() != 2 or expert_indices.dim() != 2 or expert_indices.shape[0] != tokens.shape[0]:
        raise ValueError(f"permute: tokens must be [T, h] and expert_indices [T, k] with the same T, got "
                         f"{tuple(tokens.shape)} and {tuple(expert_indices.shape)}")
    if expert_indices.dtype != torch.int64:
        raise ValueError(f"permute: expert_indices must be int64, got {expert_indices.dtype}")
    if _float_dtype(tokens) and _qualifies(tokens, expert_indices):
        return _fused.permute(tokens, expert_indices)
    return reference.permute(tokens, expert_indices)


def unpermute(permuted, row_map, probs, num_tokens: int):
    """Inverse of permute: [num_tokens, h] = sum of probs[t, slot] * row over each token's kept rows."""
    if permuted.dim() != 2 or row_map.dim() != 1 or row_map.shape[0] != permuted.shape[0]:
        raise ValueError(f"unpermute: permuted must be [n, h] and row_map [n], got {tuple(permuted.shape)} "
                         f"and {tuple(row_map.shape)}")
    if probs.dim() != 2 or probs.shape[0] != num_tokens:
        raise ValueError(f"unpermute: probs must be [num_tokens={num_tokens}, k], got {tuple(probs.shape)}")
    if row_map.dtype != torch.int64:
        raise ValueError(f"unpermute: row_map must be int64, got {row_map.dtype}")
    if _float_dtype(permuted) and probs.dtype in _FLOAT_TYPES and _qualifies(permuted, row_map, probs):
        return _fused.unpermute(permuted, row_map, probs, num_tokens)
    return reference.unpermute(permuted, row_map, probs, num_tokens)


def paged_attention_fused(*tensors) -> bool:
    """True when :func:`paged_attention` runs the extension's kernel for these tensors (contiguous, CPU, fp32).

    The inference engine asks first: without the kernel its own batched gather path beats the
    per-sequence reference.
    """
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and _qualifies(*tensors)


def paged_attention(q, keys, values, block_tables, starts, lengths, first, scale: float):
    """Attention of a few new queries per sequence over its paged KV cache, read through block tables.

    q ``[T, heads, d]``; keys/values ``[groups, num_blocks, block, d]``; int64 ``block_tables [n, max_blocks]``,
    ``starts``/``lengths``/``first`` ``[n]`` (see ``reference.paged_attention``).  Returns ``[T, heads, d]``.
    """
    if q.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape or q.shape[-1] != keys.shape[-1]:
        raise ValueError(f"paged_attention: q must be [T, heads, d] and keys/values [groups, blocks, block, d], got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if q.shape[1] % keys.shape[0]:
        raise ValueError(f"paged_attention: {q.shape[1]} heads is not a multiple of {keys.shape[0]} KV groups")
    if paged_attention_fused(q, keys, values):
        return _fused.paged_attention(q, keys, values, block_tables, starts, lengths, first, scale)
    return reference.paged_attention(q, keys, values, block_tables, starts, lengths, first, scale)
