"""Bytes one rank puts into collectives in one training step, per process-group axis.

A collective's bytes are its whole buffer on this rank: the tensor of an all-reduce or broadcast, the
output of an all-gather, the input of a reduce-scatter or all-to-all, a point-to-point send (receives
are the sender's sends).  So the count does not depend on gloo standing in for NCCL's reduce-scatter and
all-gather with an all-reduce and broadcasts.  Groups of one rank move nothing and count nothing.
(:mod:`megalite.plan.estimate`'s step time still counts its exposed collectives its own way; deriving
them from these volumes needs MoE under TP and FSDP2 modelled here first.)

Keys are the :mod:`megalite.topology` axes: ``tp``, ``cp`` (the p2p attention ring), ``pp`` (stage-to-stage
sends of activations and their gradients), ``dp`` (the dense gradient buffers over dp x cp, ZeRO-1's
parameter gather, the metrics mean), ``ep`` (token all-to-alls), ``expert_dp`` (expert gradient buffers),
``embedding`` (the tied word embedding's gradient between the first and last stage), ``expert_tp`` (the
expert gradient norm's sum) and ``world`` (the trainer's per-step flags: a data error, the NaN guard).

Exact, to the byte, for the dense GPT under DDP and ZeRO-1 with tp, sequence parallelism, full recompute,
cp (the p2p ring), pp (1F1B, interleaved, zero-bubble, V), and for MoE layers' exchanged counts and expert
buffers.  Approximate: the all-to-all payload depends on where tokens are routed, so ``ep`` is the
expectation under uniform routing (:func:`megalite.moe.dispatcher.ranks_per_token`), exact over an EP
group when every token reaches every rank.  Not modelled: the all-gather and a2a context-parallel
attention, MoE layers under tp/etp > 1, FSDP2 (torch's own collectives), MLA, ``--log-num-zeros-in-grad``
and ``--log-params-norm``, and objects (the pipeline's pickled metrics broadcast).  Gradient clipping is
assumed on (the default) and the step not skipped (an fp16 overflow skips the norm and ZeRO-1's gather).
"""

from __future__ import annotations

from megalite.models.config import GPTConfig
from megalite.moe.dispatcher import ranks_per_token
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.plan.memory import ddp_buffer, rank_chunks
from megalite.tensor_parallel.vocab_embedding import pad_vocab_size

FLOAT32, INT32, INT64, FLOAT64 = 4, 4, 8, 8
LOGGED_METRICS = 1
"""Values the GPT forward step reports per micro-batch (``lm_loss``), averaged over dp x cp each step."""


def _sequence_parallel_numel(config: GPTConfig, layers: int, post_process: bool) -> int:
    """Elements of one chunk's parameters replicated over TP under sequence parallelism (norms, row
    biases), whose gradients are summed over TP after the last micro-batch."""
    norm = config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)
    per_layer = 2 * norm + (2 * config.hidden_size if config.add_bias_linear else 0)
    return layers * per_layer + (norm if post_process else 0)


def _buffer_numel(params, layout: Layout, expert: bool) -> int:
    buffer = ddp_buffer(params, layout, expert)
    return 0 if buffer is None else buffer[3]


def collective_bytes(config: GPTConfig, layout: Layout, seq_length: int, global_batch_size: int,
                     pp_rank: int = 0) -> dict[str, int]:
    """Bytes per axis that pipeline rank ``pp_rank`` sends into collectives in one step (see the module)."""
    out = {axis: 0 for axis in ("tp", "cp", "pp", "dp", "ep", "expert_tp", "expert_dp", "embedding", "world")}
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    e, h, tp = DTYPE_BYTES[layout.precision], config.hidden_size, layout.tp
    grad_bytes = 4 if layout.grad_reduce_in_fp32 else layout.param_bytes
    tokens = layout.micro_batch_size * seq_length // layout.cp
    activation = tokens * h * e
    sp = layout.sequence_parallel and tp > 1
    stages = layout.stage_map()
    ranges = layout.chunk_ranges(config.num_layers)[pp_rank]
    tied = not config.untie_embeddings_and_output_weights
    dp_span = layout.dp * layout.cp
    for chunk, params in enumerate(rank_chunks(config, layout, pp_rank)):
        first, last = stages.is_first(pp_rank, chunk), stages.is_last(pp_rank, chunk)
        layers = range(*ranges[chunk])
        moe_layers = sum(config.is_moe_layer(i) for i in layers)
        if tp > 1:
            # Per layer: two column and two row layers; an all-reduce each way (forward, backward) without
            # sequence parallelism, an all-gather and a reduce-scatter each way with it.  The embedding and
            # the output layer add one each way; cross entropy all-reduces the max, then sum-exp and target.
            per_layer = 8 if sp else 4
            if layout.recompute == "full":
                per_layer += 4 if sp else 2  # the recomputed forward's collectives
            ends = int(first) + int(last)
            out["tp"] += m * (per_layer * len(layers) + (2 if sp else 1) * ends) * activation
            if last:
                out["tp"] += m * 3 * tokens * FLOAT32
            if sp:
                out["tp"] += _sequence_parallel_numel(config, len(layers), last) * grad_bytes
        if layout.cp > 1:
            # The p2p ring per layer: cp - 1 sends of this rank's keys and values (one tensor) forward, again in
            # the backward (and in a full recompute's forward), plus cp sends of their fp32 gradient accumulators.
            kv = config.num_query_groups // tp * tokens * 2 * config.kv_channels
            forwards = 3 if layout.recompute == "full" else 2
            out["cp"] += m * len(layers) * ((layout.cp - 1) * forwards * kv * e + layout.cp * kv * FLOAT32)
        if layout.pp > 1:
            stage = stages.stage(pp_rank, chunk)
            sent = activation // (tp if sp else 1)
            if not last and stages.rank_of(stage + 1) != pp_rank:
                out["pp"] += m * sent
            if not first and stages.rank_of(stage - 1) != pp_rank:
                out["pp"] += m * sent
            if tied and (first or last):
                vocab = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp) // tp
                out["embedding"] += vocab * h * grad_bytes
        if moe_layers and layout.ep > 1:
            # Per MoE layer and micro-batch: the [ep] int64 row counts; then one row per (token, rank reached)
            # out and back, forward and backward (a rank's rows back equal, on average, its rows out), with
            # each row's k int64 local expert ids and k float32 gates out, and the gates' gradient back.
            moe = config.moe
            rows = tokens * ranks_per_token(moe.num_experts, moe.topk, layout.ep, moe.group_topk)
            per_row = 4 * h * e + moe.topk * (INT64 + 2 * FLOAT32)
            out["ep"] += round(m * moe_layers * (layout.ep * INT64 + rows * per_row))
        if dp_span > 1:
            numel = _buffer_numel(params, layout, expert=False)
            out["dp"] += numel * grad_bytes + (numel * layout.param_bytes if layout.zero1 else 0)
        if layout.expert_dp > 1:
            numel = _buffer_numel(params, layout, expert=True)
            out["expert_dp"] += numel * grad_bytes + (numel * layout.param_bytes if layout.zero1 else 0)
    if dp_span > 1 and pp_rank == stages.last_rank:
        out["dp"] += LOGGED_METRICS * FLOAT64  # the loss, on the last stage
    # The global gradient norm: one float32 sum over each model-parallel group (and the ZeRO-1 shards' group)
    # for the dense and the expert parameters; fp16's inf check a float32 max over dp, tp and pp.
    sizes = {"tp": tp, "pp": layout.pp, "dp": dp_span, "ep": layout.ep, "expert_dp": layout.expert_dp,
             "expert_tp": layout.expert_tp}
    axes = ["tp", "pp", "expert_tp", "ep", "pp"] + (["dp", "expert_dp"] if layout.zero1 else [])
    axes += ["dp", "tp", "pp"] if layout.precision == "fp16" else []
    for axis in axes:
        if sizes[axis] > 1:
            out[axis] += FLOAT32
    world = layout.world
    if world > 1:
        out["world"] += FLOAT32 + INT32 * world
    return out
