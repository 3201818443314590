"""The fused ops of the megalite._C extension, wired into autograd and torch.compile.

The extension defines forward and backward ops under ``torch.ops.megalite``
with CPU (and, when built, CUDA) kernels.  This module registers each
forward op's backward formula (built from the backward ops) and a fake
kernel for every op, so the ops work under autograd and torch.compile, and
exposes one function per public kernel.  Callers go through
megalite.kernels, which checks the inputs first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import philox, reference

try:
    from megalite import _C
except ImportError:
    _C = None

BUILT = _C is not None
WITH_CUDA = BUILT and bool(_C.WITH_CUDA)
OPS = ("layer_norm", "rms_norm", "bias_gelu", "bias_swiglu", "apply_rotary", "bias_dropout_add",
       "scaled_upper_triang_masked_softmax", "scaled_masked_softmax", "permute", "unpermute", "paged_attention")


# The CUDA norm and softmax kernels hold a row in registers: rows up to this many elements.
CUDA_MAX_ROW = _C.CUDA_MAX_ROW if WITH_CUDA else 0


def row_fits(x) -> bool:
    """True unless x is a CUDA tensor whose rows are longer than the row kernels hold."""
    return x.device.type != "cuda" or x.shape[-1] <= CUDA_MAX_ROW


def supports_device(device: torch.device) -> bool:
    """True when the extension has kernels for this device."""
    return BUILT and (device.type == "cpu" or (device.type == "cuda" and WITH_CUDA))


def _rows(x) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _bias_grad(grad_input, bias):
    return None if bias is None else grad_input.reshape(-1, grad_input.shape[-1]).sum(0)


def _register() -> None:
    ops = torch.ops.megalite
    fake = torch.library.register_fake
    autograd = torch.library.register_autograd

    # Norms: weights arrive as float32; mean/rstd are per-row float32 saved for the backward.
    @fake("megalite::layer_norm_fwd")
    def _(x, weight, bias, eps):
        stats = x.new_empty(_rows(x), dtype=torch.float32)
        return torch.empty_like(x), stats, torch.empty_like(stats)

    @fake("megalite::layer_norm_bwd")
    def _(grad, x, weight, mean, rstd):
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)

    def layer_norm_setup(ctx, inputs, output):
        x, weight, _, _ = inputs
        ctx.save_for_backward(x, weight, output[1], output[2])

    def layer_norm_backward(ctx, grad, _grad_mean, _grad_rstd):
        x, weight, mean, rstd = ctx.saved_tensors
        gx, gw, gb = ops.layer_norm_bwd(grad.contiguous(), x, weight, mean, rstd)
        return gx, gw, gb, None

    autograd("megalite::layer_norm_fwd", layer_norm_backward, setup_context=layer_norm_setup)

    @fake("megalite::rms_norm_fwd")
    def _(x, weight, eps):
        return torch.empty_like(x), x.new_empty(_rows(x), dtype=torch.float32)

    @fake("megalite::rms_norm_bwd")
    def _(grad, x, weight, rstd):
        return torch.empty_like(x), torch.empty_like(weight)

    def rms_norm_setup(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])

    def rms_norm_backward(ctx, grad, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        gx, gw = ops.rms_norm_bwd(grad.contiguous(), x, weight, rstd)
        return gx, gw, None

    autograd("megalite::rms_norm_fwd", rms_norm_backward, setup_context=rms_norm_setup)

    # Bias + activation: the backward recomputes the activation from the saved input.
    def save_x_bias(ctx, inputs, output):
        x, bias = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, bias)

    @fake("megalite::bias_gelu_fwd")
    def _(x, bias):
        return torch.empty_like(x)

    @fake("megalite::bias_gelu_bwd")
    def _(grad, x, bias):
        return torch.empty_like(x)

    def bias_gelu_backward(ctx, grad):
        x, bias = ctx.saved_tensors
        gx = ops.bias_gelu_bwd(grad.contiguous(), x, bias)
        return gx, _bias_grad(gx, bias)

    autograd("megalite::bias_gelu_fwd", bias_gelu_backward, setup_context=save_x_bias)

    @fake("megalite::bias_swiglu_fwd")
    def _(x, bias):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @fake("megalite::bias_swiglu_bwd")
    def _(grad, x, bias):
        return torch.empty_like(x)

    def bias_swiglu_backward(ctx, grad):
        x, bias = ctx.saved_tensors
        gx = ops.bias_swiglu_bwd(grad.contiguous(), x, bias)
        return gx, _bias_grad(gx, bias)

    autograd("megalite::bias_swiglu_fwd", bias_swiglu_backward, setup_context=save_x_bias)

    # Rotary: the backward is the transposed rotation, same op with backward=True.
    @fake("megalite::rotary")
    def _(x, cos, sin, backward):
        return torch.empty_like(x)

    def rotary_setup(ctx, inputs, output):
        _, cos, sin, backward = inputs
        ctx.backward = backward
        ctx.save_for_backward(cos, sin)

    def rotary_backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return ops.rotary(grad.contiguous(), cos, sin, not ctx.backward), None, None, None

    autograd("megalite::rotary", rotary_backward, setup_context=rotary_setup)

    # Bias + dropout + residual.  CPU: the keep-mask comes in, drawn by torch's generator.  CUDA: the kernels
    # draw it from a seed (megalite.kernels.philox), and the backward draws it again: no mask is saved.
    @fake("megalite::bias_dropout_add_fwd")
    def _(x, bias, residual, mask, scale):
        return torch.empty_like(x)

    @fake("megalite::dropout_bwd")
    def _(grad, mask, scale):
        return torch.empty_like(grad)

    @fake("megalite::bias_dropout_add_philox_fwd")
    def _(x, bias, residual, seed, threshold, scale):
        return torch.empty_like(x)

    @fake("megalite::dropout_philox_bwd")
    def _(grad, seed, threshold, scale):
        return torch.empty_like(grad)

    def bias_dropout_add_setup(ctx, inputs, output):
        _, bias, _, keep, *threshold, scale = inputs  # keep: the CPU's mask, or the CUDA seed and its threshold
        ctx.threshold, ctx.scale, ctx.has_bias = threshold, scale, bias is not None
        ctx.save_for_backward(keep)

    def bias_dropout_add_backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.threshold:
            gx = ops.dropout_philox_bwd(grad, keep, ctx.threshold[0], ctx.scale)
        else:
            gx = grad if keep is None else ops.dropout_bwd(grad, keep, ctx.scale)
        gb = gx.reshape(-1, gx.shape[-1]).sum(0) if ctx.has_bias else None
        return (gx, gb, grad) + (None,) * (2 + len(ctx.threshold))

    autograd("megalite::bias_dropout_add_fwd", bias_dropout_add_backward, setup_context=bias_dropout_add_setup)
    autograd("megalite::bias_dropout_add_philox_fwd", bias_dropout_add_backward, setup_context=bias_dropout_add_setup)

    # Softmax: both masked variants share the backward, which needs only the output.
    @fake("megalite::causal_softmax_fwd")
    def _(x, scale):
        return torch.empty_like(x)

    @fake("megalite::masked_softmax_fwd")
    def _(x, mask, scale):
        return torch.empty_like(x)

    @fake("megalite::softmax_bwd")
    def _(grad, y, scale):
        return torch.empty_like(y)

    def softmax_setup(ctx, inputs, output):
        ctx.scale = inputs[-1]
        ctx.save_for_backward(output)

    def causal_softmax_backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return ops.softmax_bwd(grad.contiguous(), y, ctx.scale), None

    def masked_softmax_backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return ops.softmax_bwd(grad.contiguous(), y, ctx.scale), None, None

    autograd("megalite::causal_softmax_fwd", causal_softmax_backward, setup_context=softmax_setup)
    autograd("megalite::masked_softmax_fwd", masked_softmax_backward, setup_context=softmax_setup)

    # MoE: the row map's length is the number of kept assignments, known only from the data.
    @fake("megalite::permute_row_map")
    def _(expert_indices):
        return expert_indices.new_empty(torch.library.get_ctx().new_dynamic_size())

    # MoE permute/unpermute over a precomputed row map.
    @fake("megalite::permute_fwd")
    def _(tokens, row_map, k):
        return tokens.new_empty(row_map.shape[0], tokens.shape[1])

    @fake("megalite::permute_bwd")
    def _(grad, row_map, num_tokens, k):
        return grad.new_empty(num_tokens, grad.shape[1])

    def permute_setup(ctx, inputs, output):
        tokens, row_map, k = inputs
        ctx.num_tokens, ctx.k = tokens.shape[0], k
        ctx.save_for_backward(row_map)

    def permute_backward(ctx, grad):
        (row_map,) = ctx.saved_tensors
        return ops.permute_bwd(grad.contiguous(), row_map, ctx.num_tokens, ctx.k), None, None

    autograd("megalite::permute_fwd", permute_backward, setup_context=permute_setup)

    @fake("megalite::unpermute_fwd")
    def _(permuted, row_map, probs, num_tokens):
        return permuted.new_empty(num_tokens, permuted.shape[1])

    @fake("megalite::unpermute_bwd")
    def _(grad, permuted, row_map, probs):
        return torch.empty_like(permuted), torch.empty_like(probs)

    def unpermute_setup(ctx, inputs, output):
        permuted, row_map, probs, _ = inputs
        ctx.save_for_backward(permuted, row_map, probs)

    def unpermute_backward(ctx, grad):
        permuted, row_map, probs = ctx.saved_tensors
        gperm, gprobs = ops.unpermute_bwd(grad.contiguous(), permuted, row_map, probs)
        return gperm, None, gprobs, None

    autograd("megalite::unpermute_fwd", unpermute_backward, setup_context=unpermute_setup)

    # Paged attention is inference-only (no backward).
    @fake("megalite::paged_attention")
    def _(q, keys, values, block_tables, starts, lengths, first, scale):
        return torch.empty_like(q)


if BUILT:
    _register()


def layer_norm(x, weight, bias, eps):
    """torch's own LayerNorm for fp32 on CPU, which is already one fused, vectorized kernel per pass
    and has a faster backward than ours; the extension's kernel for half types and on GPU."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return F.layer_norm(x, (x.shape[-1],), weight.float(), bias.float(), eps)
    return torch.ops.megalite.layer_norm_fwd(x, weight.float(), bias.float(), eps)[0]


def rms_norm(x, weight, eps):
    return torch.ops.megalite.rms_norm_fwd(x, weight.float(), eps)[0]


def bias_gelu(x, bias):
    return torch.ops.megalite.bias_gelu_fwd(x, bias)


def bias_swiglu(x, bias):
    return torch.ops.megalite.bias_swiglu_fwd(x, bias)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return torch.ops.megalite.rotary(q, cos, sin, False), torch.ops.megalite.rotary(k, cos, sin, False)


def bias_dropout_add(x, bias, residual, p, training):
    """Without dropout nothing is left to fuse but two adds: torch's add (the bias added in place)
    costs less than a custom op's autograd wrapper at transformer sizes, and no mask is drawn."""
    if training and p > 0.0:
        if x.device.type == "cuda":
            return torch.ops.megalite.bias_dropout_add_philox_fwd(x, bias, residual, philox.dropout_seed(x.device),
                                                                  philox.keep_threshold(p), 1.0 / (1.0 - p))
        return torch.ops.megalite.bias_dropout_add_fwd(x, bias, residual, reference.dropout_mask(x, p), 1.0 / (1.0 - p))
    out = torch.add(residual, x)
    return out if bias is None else out.add_(bias)


def scaled_upper_triang_masked_softmax(x, scale):
    return torch.ops.megalite.causal_softmax_fwd(x, scale)


def scaled_masked_softmax(x, mask, scale):
    """x of 2 to 4 dims is viewed as 4-d; the mask is an expanded (stride-0) view of x's shape."""
    lead = (None,) * (4 - x.dim())
    mask4 = mask.expand(x.shape)[lead]
    if mask4.stride(3) != 1:
        mask4 = mask4.contiguous()
    return torch.ops.megalite.masked_softmax_fwd(x[lead], mask4, scale).view(x.shape)


def permute(tokens, expert_indices):
    """The row map comes from the extension's counting sort (the order of the reference's stable argsort)."""
    row_map = torch.ops.megalite.permute_row_map(expert_indices)
    return torch.ops.megalite.permute_fwd(tokens, row_map, expert_indices.shape[1]), row_map


def unpermute(permuted, row_map, probs, num_tokens):
    return torch.ops.megalite.unpermute_fwd(permuted, row_map, probs.float().contiguous(), num_tokens)


def paged_attention(q, keys, values, block_tables, starts, lengths, first, scale):
    return torch.ops.megalite.paged_attention(q.contiguous(), keys, values, block_tables, starts, lengths, first, scale)
