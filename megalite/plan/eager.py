"""The memory-bound ops of torchtitan's Llama run in eager PyTorch (no ``torch.compile``), for its published runs.

:mod:`megalite.plan.compute` prices megalite's own memory-bound ops (its fused norm and SwiGLU kernels).  An
eager torchtitan run executes its model's unfused ops instead, each a kernel that reads and writes its tensors
in full.  The ops and their dtypes are read from torchtitan's source at commit 9dec370 (Dec 2024, the version of
``benchmarks/llama3_h100_202412_torchtitan.md``): ``torchtitan/models/llama/model.py`` (``apply_rotary_emb``,
``repeat_kv``, ``Attention``, ``FeedForward``, ``TransformerBlock``, ``Transformer.forward``),
``torchtitan/models/norms.py`` (``RMSNorm``: ``norm_type = "rmsnorm"`` in ``train_configs/llama3_8b.toml``) and
``train.py`` (``loss_fn``: cross entropy over ``pred.float()``).  Activations are bf16 (FSDP2's ``param_dtype``);
the norm, RoPE and the loss compute in fp32.  Backward bytes are those of the ops' autograd formulas.

Under ``torchtitan-op`` selective checkpointing (``_save_list`` in ``torchtitan/parallelisms/parallelize_llama.py``
keeps only matmuls, attention and reduce-scatters) every elementwise op of a block runs again in the backward,
as under full recompute; the final norm and the loss sit outside the blocks and run once.

Nothing here is fitted: bytes move at the profile's ``hbm_bandwidth`` and each kernel costs ``op_overhead_s``.
The weight-gradient passes are priced as for megalite (:func:`megalite.plan.compute.layer_elements`: read two,
write one per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.models.config import GPTConfig
from megalite.plan.activations import TORCHTITAN_OP
from megalite.plan.layout import Layout

TORCHTITAN_EAGER = "torchtitan-eager"
"""The op graph :func:`eager_time` prices (``compute_time(..., ops=TORCHTITAN_EAGER)``)."""

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class EagerOp:
    """One module's unfused ops: bytes read and written per element of its input, and kernels launched, forward
    and backward."""

    forward_bytes: int
    backward_bytes: int
    forward_kernels: int
    backward_kernels: int


RMSNORM = EagerOp(
    # x.float() 2+4, pow 4+4, mean 4, add/rsqrt (per row), x*rsqrt 4+4, type_as 4+2, *weight 2+2
    forward_bytes=(BF16 + FP32) + 2 * FP32 + FP32 + 2 * FP32 + (FP32 + BF16) + 2 * BF16,
    # *weight: dx 2+2, dweight product 2+2+2 and its sum 2; type_as 2+4; x*rsqrt: dx 4+4, d(rsqrt) product
    # 4+4+4 and its row sum 4; mean's expand 4; pow's 2*x*g 4+4+4; the two dx summed 4+4+4; float() 4+2
    backward_bytes=(2 * BF16) + (3 * BF16) + BF16 + (BF16 + FP32) + 2 * FP32 + 3 * FP32 + FP32 + FP32
    + 3 * FP32 + 3 * FP32 + (FP32 + BF16),
    forward_kernels=8, backward_kernels=12)
"""``RMSNorm.forward``: ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight``."""

ROPE = EagerOp(
    # per element of q (or k): float() 2+4, complex multiply by freqs_cis 4+4, type_as 4+2
    forward_bytes=(BF16 + FP32) + 2 * FP32 + (FP32 + BF16),
    backward_bytes=(BF16 + FP32) + 2 * FP32 + (FP32 + BF16),
    forward_kernels=3, backward_kernels=4)
"""``apply_rotary_emb`` for one of q, k (``view_as_complex`` / ``view_as_real`` are views; the backward's
complex multiply takes the conjugate of ``freqs_cis`` as one more small kernel)."""

SWIGLU = EagerOp(
    # per ffn element: silu 2+2, the product with w3's output 2+2+2
    forward_bytes=2 * BF16 + 3 * BF16,
    # the product's two gradients 2+2+2 each, silu's gradient 2+2+2
    backward_bytes=2 * 3 * BF16 + 3 * BF16,
    forward_kernels=2, backward_kernels=3)
"""``FeedForward.forward``'s ``F.silu(w1(x)) * w3(x)``."""

RESIDUAL = EagerOp(forward_bytes=3 * BF16, backward_bytes=3 * BF16, forward_kernels=1, backward_kernels=1)
"""One residual sum (``x + attention(...)``, ``h + feed_forward(...)``) and, backward, autograd's sum of the
two gradients at its branch point."""

LOSS = EagerOp(
    # per logit: pred.float() 2+4, log_softmax 4 (max and sum pass) + 4+4; nll_loss reads one logit a row
    forward_bytes=(BF16 + FP32) + 3 * FP32,
    # nll_loss backward writes a zero-filled fp32 gradient 4, log_softmax backward 4+4+4, float() 4+2
    backward_bytes=FP32 + 3 * FP32 + (FP32 + BF16),
    forward_kernels=4, backward_kernels=5)
"""``loss_fn``: ``cross_entropy(pred.flatten(0, 1).float(), labels)``."""


def layer_bytes(config: GPTConfig, layout: Layout, seq_length: int) -> tuple[float, float, int, int]:
    """``(forward bytes, backward bytes, forward kernels, backward kernels)`` of one block's memory-bound ops for
    one micro-batch on one rank: two RMSNorms and residual sums over the hidden states, RoPE on q and k,
    ``repeat_kv``'s copy of k and v to every query head (its backward the sum over the repeats), SwiGLU over
    ``ffn``.  Attention's transposes are views (flash attention takes and returns the strided layout)."""
    tp = layout.tp
    tokens = layout.micro_batch_size * seq_length / layout.cp
    sp_tokens = tokens / tp if layout.sequence_parallel and tp > 1 else tokens
    h, d = config.hidden_size, config.kv_channels
    q = config.num_attention_heads // tp * d
    kv = max(config.num_query_groups // tp, 1) * d
    ffn = config.ffn_hidden_size / tp
    parts = [(RMSNORM, 2 * sp_tokens * h), (RESIDUAL, 2 * sp_tokens * h), (ROPE, tokens * (q + kv)),
             (SWIGLU, tokens * ffn)]
    forward = sum(op.forward_bytes * n for op, n in parts)
    backward = sum(op.backward_bytes * n for op, n in parts)
    fwd_kernels = 2 * RMSNORM.forward_kernels + 2 * RESIDUAL.forward_kernels + 2 * ROPE.forward_kernels \
        + SWIGLU.forward_kernels
    bwd_kernels = 2 * RMSNORM.backward_kernels + 2 * RESIDUAL.backward_kernels + 2 * ROPE.backward_kernels \
        + SWIGLU.backward_kernels
    if q != kv:  # k and v: read kv, write q each; backward reads q and writes kv
        forward += 2 * tokens * (kv + q) * BF16
        backward += 2 * tokens * (q + kv) * BF16
        fwd_kernels += 2
        bwd_kernels += 2
    return forward, backward, fwd_kernels, bwd_kernels


def head_bytes(config: GPTConfig, layout: Layout, seq_length: int) -> tuple[float, int]:
    """``(bytes, kernels)`` of the embedding, the final RMSNorm and the loss for one micro-batch on one rank,
    forward and backward: the embedding's gather (read and write a row a token) and its backward's zero-filled
    gradient and index-add, the norm, the loss over the logits."""
    tp = layout.tp
    tokens = layout.micro_batch_size * seq_length / layout.cp
    h, vocab = config.hidden_size, config.vocab_size / tp
    embedding = 2 * tokens * h * BF16 + vocab * h * BF16 + 2 * tokens * h * BF16
    norm = tokens * h * (RMSNORM.forward_bytes + RMSNORM.backward_bytes)
    loss = tokens * vocab * (LOSS.forward_bytes + LOSS.backward_bytes)
    kernels = 1 + 2 + RMSNORM.forward_kernels + RMSNORM.backward_kernels + LOSS.forward_kernels \
        + LOSS.backward_kernels
    return embedding + norm + loss, kernels


def eager_time(config: GPTConfig, layout: Layout, hbm_bandwidth: float, op_overhead_s: float, seq_length: int,
               microbatches: int, weight_bytes: float) -> dict:
    """Seconds of the step's memory-bound ops and kernel launches on one rank, ``{"memory_bound", "op_overhead"}``:
    the blocks' ops (run twice forward under full or ``torchtitan-op`` recompute), the head's, and
    ``weight_bytes`` (the weight-gradient passes of one micro-batch) per micro-batch."""
    forwards = 2 if layout.recompute in ("full", TORCHTITAN_OP) else 1
    forward, backward, fwd_kernels, bwd_kernels = layer_bytes(config, layout, seq_length)
    layers = config.num_layers / layout.pp
    head, head_kernels = head_bytes(config, layout, seq_length)
    nbytes = layers * (forwards * forward + backward) + head / layout.pp + weight_bytes
    kernels = layers * (forwards * fwd_kernels + bwd_kernels) + head_kernels / layout.pp
    return {"memory_bound": microbatches * nbytes / hbm_bandwidth,
            "op_overhead": microbatches * kernels * op_overhead_s}
