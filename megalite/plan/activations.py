"""Activation bytes one micro-batch keeps for backward, and how many micro-batches a schedule keeps.

Counted per tensor megalite's layers save (the tensors autograd holds, each storage once), per
token of a rank: ``T = micro_batch * seq / cp`` tokens, ``T / tp`` of them in the sequence-parallel
regions.  Per transformer layer, without recompute:

- the layer input, the two norms' outputs (the QKV and fc1 inputs) and the residual after attention;
- the QKV projection ``(heads + 2 groups) * d / tp`` (and RoPE's rotated q and k), the attention
  output ``heads * d / tp``, the attention's fp32
  log-sum-exp per head;
- fc1's output and the activation's output (``2 * ffn`` and ``ffn`` for SwiGLU);
- each norm's fp32 statistics (two per token), one-byte dropout masks when dropout is on and the run keeps them
  (:func:`keeps_dropout_masks`: megalite's CUDA kernels draw the mask again in the backward and keep none).

Selective recompute drops the core attention's saved state (the log-sum-exp: flash-style attention
keeps no ``s x s`` matrix to begin with); full recompute keeps only each layer's input.  The last
stage adds the final norm, the logits ``[T, vocab / tp]`` and the loss; the first stage the embedding's
dropout (a mask of the activation dtype).  Context parallelism's ring
keeps the key/value blocks it received, counted as the whole sequence's keys and values.

``torchtitan-op`` is torchtitan's op-level selective checkpointing (its ``selective_ac_option = 'op'``,
which its Llama presets use), modelled for published torchtitan runs; megalite's trainer does not run it.  Within
each checkpointed block it keeps the outputs of scaled-dot-product attention and of every odd-numbered
matmul in the block's order (``wq wk wv wo w1 w3 w2``: ``wq``, ``wv``, ``w1`` and ``w2``), with the block's
input, and recomputes the rest in the backward: the even matmuls ``wk``, ``wo``, ``w3`` (their FLOPs are
:func:`op_recompute_flops_per_token`) and the norms, RoPE and activation.

Checked against autograd's saved tensors at tp 1-2 with and without sequence parallelism, for each
recompute option (tests/plan/test_activations.py, within 5%).  The CP and MoE terms are not checked
yet: a probe at cp=2 found them 15-20% high.
"""

from __future__ import annotations

from functools import lru_cache

from megalite.hardware import Hardware
from megalite.models.config import GPTConfig
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.tensor_parallel.vocab_embedding import pad_vocab_size

STAT_BYTES = 4
"""Norm statistics and attention log-sum-exp are fp32 whatever the activation dtype."""


TORCHTITAN_OP = "torchtitan-op"


def _block_matmuls(config: GPTConfig, tp: int) -> list[tuple[int, int]]:
    """``(in, out)`` features per token of a torchtitan Llama block's forward matmuls on one TP rank, in order:
    ``wq wk wv wo`` then ``w1 w3 w2`` (SwiGLU) or ``w1 w2``."""
    if config.multi_latent_attention or config.moe is not None:
        raise ValueError(f"recompute {TORCHTITAN_OP!r} models torchtitan's dense Llama block (no MoE or MLA)")
    h, d, ffn = config.hidden_size, config.kv_channels, config.ffn_hidden_size // tp
    q, kv = config.num_attention_heads // tp * d, config.num_query_groups // tp * d
    mlp = [(h, ffn), (h, ffn), (ffn, h)] if config.activation == "swiglu" else [(h, ffn), (ffn, h)]
    return [(h, q), (h, kv), (h, kv), (q, h)] + mlp


def op_recompute_flops_per_token(config: GPTConfig) -> float:
    """FLOPs per token ``torchtitan-op`` adds to a step: every layer's even-numbered matmuls run again."""
    return config.num_layers * sum(2 * i * o for i, o in _block_matmuls(config, 1)[1::2])


def keeps_dropout_masks(hw: Hardware, ops: str | None = None) -> bool:
    """Whether a run on ``hw`` keeps dropout's keep-masks for the backward: a calibrated CPU (a profile with
    ``cores``) runs the CPU kernels, which read a mask drawn by torch and keep it, as torch's own dropout does for
    another system's ops (``ops``); megalite's CUDA kernels, which a GPU profile prices, draw it again instead."""
    return hw.cores is not None or ops is not None


def layer_activation_bytes(config: GPTConfig, layout: Layout, seq_length: int, layer: int = 0,
                           recompute: str | None = None, dropout_masks: bool = True) -> int:
    """Bytes one transformer layer saves for one micro-batch on one rank (``dropout_masks``:
    :func:`keeps_dropout_masks`)."""
    e = DTYPE_BYTES[layout.precision]
    tp, cp = layout.tp, layout.cp
    tokens = layout.micro_batch_size * seq_length // cp
    sp_tokens = tokens // tp if layout.sequence_parallel and tp > 1 else tokens
    h, d = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
    if recompute == "full":
        return e * sp_tokens * h
    if recompute == TORCHTITAN_OP:  # the input, the odd matmuls' outputs, attention's output and log-sum-exp
        saved = sum(o for _, o in _block_matmuls(config, tp)[::2])
        return e * (sp_tokens * h + tokens * (saved + heads * d)) + STAT_BYTES * tokens * heads
    elements = sp_tokens * h * 2 + tokens * h * 2
    elements += tokens * (heads + 2 * groups) * d + tokens * heads * d
    if config.position_embedding_type == "rope":
        elements += tokens * (heads + groups) * d
    if cp > 1:
        elements += 2 * layout.micro_batch_size * seq_length * groups * d
    if config.is_moe_layer(layer):
        moe = config.moe
        routed = tokens * moe.topk // tp if not layout.sequence_parallel else sp_tokens * moe.topk
        ffn = moe.ffn_hidden_size // layout.expert_tp
        elements += routed * (3 if moe.activation == "swiglu" else 2) * ffn + routed * h
    else:
        ffn = config.ffn_hidden_size // tp
        elements += tokens * (3 if config.activation == "swiglu" else 2) * ffn
    stats = 4 * sp_tokens
    if recompute != "selective":
        stats += tokens * heads
    masks = 2 * sp_tokens * h if config.hidden_dropout > 0 and dropout_masks else 0
    return e * elements + STAT_BYTES * stats + masks


def head_activation_bytes(config: GPTConfig, layout: Layout, seq_length: int) -> int:
    """Bytes the last stage's final norm, output layer and loss save for one micro-batch."""
    e = DTYPE_BYTES[layout.precision]
    tokens = layout.micro_batch_size * seq_length // layout.cp
    tp = layout.tp
    sp_tokens = tokens // tp if layout.sequence_parallel and tp > 1 else tokens
    h = config.hidden_size
    vocab = config.vocab_size if tp == 1 else pad_vocab_size(config.vocab_size,
                                                             config.make_vocab_size_divisible_by, tp) // tp
    return e * (sp_tokens * h + tokens * h + tokens * vocab) + STAT_BYTES * 2 * sp_tokens + 8 * tokens


def microbatch_activation_bytes(config: GPTConfig, layout: Layout, seq_length: int, pp_rank: int = 0,
                                dropout_masks: bool = True) -> int:
    """Bytes all of pipeline rank ``pp_rank``'s chunks save for one micro-batch (under ``layout.recompute``;
    ``dropout_masks``: :func:`keeps_dropout_masks`)."""
    stages = layout.stage_map()
    e = DTYPE_BYTES[layout.precision]
    tokens = layout.micro_batch_size * seq_length // layout.cp
    sp_tokens = tokens // layout.tp if layout.sequence_parallel and layout.tp > 1 else tokens
    total = 0
    for chunk, (start, end) in enumerate(layout.chunk_ranges(config.num_layers)[pp_rank]):
        if stages.is_first(pp_rank, chunk) and config.hidden_dropout > 0:
            total += e * sp_tokens * config.hidden_size
        moe_layers = sum(config.is_moe_layer(i) for i in range(start, end))
        if moe_layers:
            first_moe = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
            total += moe_layers * layer_activation_bytes(config, layout, seq_length, first_moe, layout.recompute,
                                                         dropout_masks)
        if end - start - moe_layers:
            first_dense = next(i for i in range(config.num_layers) if not config.is_moe_layer(i))
            total += (end - start - moe_layers) * layer_activation_bytes(config, layout, seq_length, first_dense,
                                                                         layout.recompute, dropout_masks)
        if stages.is_last(pp_rank, chunk):
            total += head_activation_bytes(config, layout, seq_length)
    return total


def _peak_forwards(ops) -> int:
    """Most forwards whose input-gradient pass has not run yet, over an op list of ``(kind, mb, chunk)``."""
    live = peak = 0
    for kind, _, _ in ops:
        live += kind == "F"
        live -= kind == "B"
        peak = max(peak, live)
    return peak


def microbatches_in_flight(layout: Layout, num_microbatches: int, pp_rank: int = 0) -> float:
    """How many micro-batches' activations pipeline rank ``pp_rank`` holds at its peak, in whole-rank units.

    1F1B: ``pp - rank`` (its warm-up plus one; capped by the micro-batches).  Interleaved: the schedule's
    warm-up ``(pp - rank - 1) * 2 + (vpp - 1) * pp`` chunk forwards plus one (all of them when
    ``m == pp``), over ``vpp`` chunks.  ZB-H1 and ZBV: the peak of forwards not yet followed by their B
    pass in the schedule's own op list (:mod:`megalite.pipeline.zero_bubble`), over the rank's chunks.
    """
    return _in_flight(layout.schedule, layout.pp, layout.stage_map().chunks, num_microbatches, pp_rank)


@lru_cache(maxsize=65536)
def _in_flight(schedule: str | None, pp: int, chunks: int, m: int, pp_rank: int) -> float:
    from megalite.pipeline.zero_bubble import zb_h1_order, zbv_order

    if pp == 1:
        return 1.0
    if schedule == "zbv":
        return _peak_forwards(zbv_order(pp, pp_rank, m)) / 2
    if schedule == "zero-bubble-h1":
        return float(_peak_forwards(zb_h1_order(pp, pp_rank, m)))
    if chunks > 1:
        total = m * chunks
        warmup = total if m == pp else min((pp - pp_rank - 1) * 2 + (chunks - 1) * pp, total)
        return min(total, warmup + 1) / chunks
    return float(min(m, pp - pp_rank))
