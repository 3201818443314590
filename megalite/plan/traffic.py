"""Bytes one rank puts into collectives in one training step, per process-group axis.

A collective's bytes are its whole buffer on this rank: the tensor of an all-reduce or broadcast, the
output of an all-gather, the input of a reduce-scatter or all-to-all, a point-to-point send (receives
are the sender's sends).  So the count does not depend on gloo standing in for NCCL's reduce-scatter and
all-gather with an all-reduce and broadcasts.  Groups of one rank move nothing and count nothing.
:mod:`megalite.plan.estimate`'s step time is these bytes over each axis's link, less what overlaps compute.

Keys are the :mod:`megalite.topology` axes: ``tp``, ``cp`` (attention's keys and values), ``pp``
(stage-to-stage sends of activations and their gradients), ``dp`` (the dense gradient buffers over dp x cp,
ZeRO-1's parameter gather, FSDP2's gathers and reduce-scatters, the metrics mean), ``ep`` (token
all-to-alls), ``expert_dp`` (expert gradient buffers, FSDP2's expert units), ``embedding`` (the tied word
embedding's gradient between the first and last stage), ``expert_tp`` (routed rows gathered to and reduced
from the expert shards, the expert gradient norm's sum) and ``world`` (the trainer's per-step flags: a data
error, the NaN guard).

Exact, to the byte, for the dense GPT (standard or multi-latent attention) under DDP, ZeRO-1 and FSDP2
(each unit gathered in the compute dtype per forward and, unless kept after it, per backward, padded per
parameter to the shard count, its gradients reduce-scattered once) with tp, sequence parallelism, full
recompute, cp (each of the p2p ring, all-gather and a2a), pp (1F1B, interleaved, zero-bubble, V), and for
MoE layers' exchanged counts, router statistics and expert buffers, with or without tp, sequence
parallelism, expert TP and cp, and either dispatcher.  Approximate: the all-to-all dispatcher's payload depends
on where tokens are routed, so its ``ep`` and ``expert_tp`` are the expectation under uniform routing
(:func:`megalite.moe.dispatcher.ranks_per_token`), exact when every token reaches every EP rank.  Not
modelled: ``--log-num-zeros-in-grad`` and ``--log-params-norm``, and objects (the pipeline's pickled
metrics broadcast).  Gradient clipping is assumed on (the default) and the step not skipped (an fp16
overflow skips the norm and ZeRO-1's gather).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.models.config import GPTConfig
from megalite.moe.dispatcher import ranks_per_token
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.plan.memory import ddp_buffer, fsdp_rows, rank_chunks
from megalite.tensor_parallel.vocab_embedding import pad_vocab_size

FLOAT32, INT32, INT64, FLOAT64 = 4, 4, 8, 8
LOGGED_METRICS = 1
"""Values the GPT forward step reports per micro-batch (``lm_loss``), averaged over dp x cp each step."""


def _sequence_parallel_numel(params, layout: Layout, dp_rank: int) -> int:
    """Elements of one chunk's sequence-parallel parameters (norms, row biases, MLA's down-projections; see
    :class:`~megalite.plan.memory.ParamSpec`), whose gradients are summed over TP after the last micro-batch;
    under FSDP2 of this rank's shards of them (the sum runs on the sharded gradients)."""
    specs = [p for p in params if p.sequence_parallel]
    if not layout.fsdp:
        return sum(p.numel for p in specs)
    size = layout.dp * layout.cp
    return sum(fsdp_rows(p.shape[0], size, dp_rank) * (p.numel // p.shape[0]) for p in specs)


def _tp_widths(config: GPTConfig) -> tuple[int, int]:
    """Elements per token of one layer's column-parallel inputs and of its row-parallel outputs: the QKV and
    first MLP inputs and the projection and second MLP outputs; MLA's column inputs are the query input (the
    hidden state or its latent), the key/value latent and its shared rotary key (gathered like one)."""
    h = config.hidden_size
    if not config.multi_latent_attention:
        return 2 * h, 2 * h
    query = h if config.q_lora_rank is None else config.q_lora_rank
    return query + config.kv_lora_rank + config.qk_pos_emb_head_dim + h, 2 * h


def _cp_layer_bytes(config: GPTConfig, layout: Layout, tokens: int, e: int) -> int:
    """One layer's context-parallel bytes for one micro-batch of ``tokens`` tokens per rank.

    ``p2p``: the ring sends this rank's keys and values (one tensor) cp - 1 times forward, again in the
    backward (and in a full recompute's forward), plus cp sends of their fp32 gradient accumulators.
    ``all_gather``: the keys and values are gathered (output: cp blocks) in each forward and their
    gradients reduce-scattered (input: cp blocks).  ``a2a``: queries, keys, values and the output each go
    through one all-to-all per forward and one per backward.
    """
    tp, cp = layout.tp, layout.cp
    heads = config.num_attention_heads // tp
    if config.multi_latent_attention:  # one key/value head per query head, keys [nope; rope]
        groups, dk, dv = heads, config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    else:
        groups, dk, dv = config.num_query_groups // tp, config.kv_channels, config.kv_channels
    kv = groups * tokens * (dk + dv)
    forwards = 2 if layout.recompute == "full" else 1
    if layout.cp_comm_type == "all_gather":
        return (forwards + 1) * cp * kv * e
    if layout.cp_comm_type == "a2a":
        return (forwards + 1) * (kv + heads * tokens * (dk + dv)) * e
    return (cp - 1) * (forwards + 1) * kv * e + cp * kv * FLOAT32


def _tp_layer_numel(layout: Layout, columns: int, rows: int) -> int:
    """Elements per token one layer puts into TP collectives per micro-batch, for ``columns`` elements of
    column-parallel inputs and ``rows`` of row-parallel outputs (see :func:`_tp_widths`): an all-reduce per
    column input (backward) and per row output (forward) without sequence parallelism; an all-gather and a
    reduce-scatter each with it; a full recompute repeats the forward ones."""
    sp = layout.sequence_parallel and layout.tp > 1
    return (2 if sp else 1) * (columns + rows) + (layout.recompute == "full") * ((columns if sp else 0) + rows)


def _moe_layer_bytes(config: GPTConfig, layout: Layout, tokens: int, e: int) -> dict[str, float]:
    """One MoE layer's bytes per axis for one micro-batch of ``tokens`` tokens per rank (expected, see the module).

    Each TP rank routes its 1/tp of the tokens: under sequence parallelism its own; without it, its block of
    the replicated tokens (padded to a multiple of tp), so the outputs are all-gathered over TP forward, the
    tokens' and their float32 gates' gradients backward.  The router's float64 statistics (expert counts,
    z-loss sum, token count, the balancing loss's counts and scores per sequence) are all-reduced over the
    groups the tokens are split over: TP under sequence parallelism, CP.  EP: the [ep] int64 row counts; then
    one row per (token, EP rank reached) out and back, forward and backward (a rank's rows back equal, on
    average, its rows out), with each row's k int64 local expert ids and k float32 gates out and the gates'
    gradient back.  Expert TP: the received row count is all-gathered, then every row, with its expert ids and
    gates, gathered to the etp shards (an all-to-all whose input is the row repeated etp times) and the partial
    outputs reduce-scattered back; the backward the same rows the other way, with the gates' gradient.  A full
    recompute repeats the forward collectives.  The ``allgather`` dispatcher moves the same per-row payload, but
    each rank gathers every EP rank's rows (and the expert-TP gather every rank's of those): exact, whatever the
    routing.
    """
    moe, h, k = config.moe, config.hidden_size, config.moe.topk
    tp, ep, etp = layout.tp, layout.ep, layout.expert_tp
    sp = layout.sequence_parallel and tp > 1
    forwards = 2 if layout.recompute == "full" else 1
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "expert_tp": 0.0}
    if tp > 1 and not sp:
        padded = -(-tokens // tp) * tp
        out["tp"] += forwards * padded * h * e + padded * (h * e + k * FLOAT32)
    sequences = layout.micro_batch_size if moe.load_balancing_type == "seq_aux_loss" else 1
    stats = FLOAT64 * (moe.num_experts + 2 + 2 * sequences * moe.num_experts)
    for axis, size in (("tp", tp if sp else 1), ("cp", layout.cp)):
        if size > 1:
            out[axis] += forwards * stats
    if moe.dispatcher == "allgather":  # every rank's rows (padding included) gathered over EP, then over expert TP
        rows = (tokens / tp if sp else -(-tokens // tp)) * ep
    else:
        rows = tokens / tp * ranks_per_token(moe.num_experts, k, ep, moe.group_topk)
    forward_row, backward_row = 2 * h * e + k * (INT64 + FLOAT32), 2 * h * e + k * FLOAT32
    if ep > 1:
        out["ep"] += forwards * (ep * INT64 + rows * forward_row) + rows * backward_row
    if etp > 1:
        out["expert_tp"] += forwards * etp * (INT64 + rows * forward_row) + etp * rows * backward_row
    return out


def _padded_numel(params, size: int) -> int:
    """Elements FSDP2 gathers for ``params``: each one's dim 0 padded to a multiple of ``size``."""
    return sum(-(-p.shape[0] // size) * size * (p.numel // p.shape[0]) for p in params)


def _buffer_numel(params, layout: Layout, expert: bool) -> int:
    buffer = ddp_buffer(params, layout, expert)
    return 0 if buffer is None else buffer[3]


def _fsdp_units(layout: Layout, params) -> dict[str, int]:
    """Padded elements of one chunk's FSDP2 units per axis: each layer's dense parameters and the chunk's
    rest (embedding, final norm, output layer) over dp x cp, each MoE layer's experts over expert dp
    (padding is per parameter, so the units' sum is the chunk's)."""
    sizes = {"dp": layout.dp * layout.cp, "expert_dp": layout.expert_dp}
    return {axis: _padded_numel([p for p in params if p.expert == (axis == "expert_dp")], size)
            for axis, size in sizes.items() if size > 1}


@dataclass(frozen=True)
class _Chunk:
    """What one model chunk's traffic needs that the micro-batch size and recompute do not change."""

    dense: int  # DDP buffer elements
    expert: int
    fsdp_units: dict  # FSDP2: padded elements per axis
    sequence_parallel: int  # elements summed over TP under SP
    layers: int
    moe_layers: int
    first: bool
    last: bool
    pp_sends: int  # neighbouring stages on another rank (each gets this chunk's activation or gradient)


def _chunks(config: GPTConfig, layout: Layout, pp_rank: int, dp_rank: int) -> list[_Chunk]:
    stages = layout.stage_map()
    out = []
    for chunk, (params, bounds) in enumerate(zip(rank_chunks(config, layout, pp_rank),
                                                 layout.chunk_ranges(config.num_layers)[pp_rank])):
        first, last = stages.is_first(pp_rank, chunk), stages.is_last(pp_rank, chunk)
        stage = stages.stage(pp_rank, chunk)
        sends = 0
        if layout.pp > 1:
            sends = int(not last and stages.rank_of(stage + 1) != pp_rank)
            sends += int(not first and stages.rank_of(stage - 1) != pp_rank)
        buffers = (0, 0) if layout.fsdp else (_buffer_numel(params, layout, False), _buffer_numel(params, layout, True))
        out.append(_Chunk(*buffers, _fsdp_units(layout, params) if layout.fsdp else {},
                          _sequence_parallel_numel(params, layout, dp_rank), bounds[1] - bounds[0],
                          sum(config.is_moe_layer(i) for i in range(*bounds)), first, last, sends))
    return out


def _static_key(layout: Layout, pp_rank: int, dp_rank: int) -> tuple:
    """The :class:`Layout` fields :func:`_chunks` depends on (all but the micro-batch size, recompute,
    sequence parallelism and the CP comm type), with the ranks."""
    return (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.etp, layout.vpp, layout.schedule,
            layout.zero1, layout.fsdp, layout.precision, layout.grad_reduce_in_fp32, layout.bucket_size,
            layout.first_stage_layers, layout.last_stage_layers, pp_rank, dp_rank)


def collective_bytes(config: GPTConfig, layout: Layout, seq_length: int, global_batch_size: int,
                     pp_rank: int = 0, dp_rank: int = 0, cache: dict | None = None) -> dict[str, int]:
    """Bytes per axis that pipeline rank ``pp_rank`` sends into collectives in one step (see the module).

    ``dp_rank`` (over dp x cp) matters only under FSDP2, whose last shards may hold fewer rows.  ``cache``:
    a dict kept across calls for one model (the planner's search), holding what the micro-batch size and
    recompute do not change.
    """
    out = {axis: 0 for axis in ("tp", "cp", "pp", "dp", "ep", "expert_tp", "expert_dp", "embedding", "world")}
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    e, h, tp = DTYPE_BYTES[layout.precision], config.hidden_size, layout.tp
    grad_bytes = 4 if layout.grad_reduce_in_fp32 else DTYPE_BYTES[layout.precision] if layout.fsdp \
        else layout.param_bytes
    tokens = layout.micro_batch_size * seq_length // layout.cp
    activation = tokens * h * e
    sp = layout.sequence_parallel and tp > 1
    stages = layout.stage_map()
    tied = not config.untie_embeddings_and_output_weights
    dp_span = layout.dp * layout.cp
    key = ("traffic", _static_key(layout, pp_rank, dp_rank))
    if cache is None or key not in cache:
        chunks = _chunks(config, layout, pp_rank, dp_rank)
        if cache is not None:
            cache[key] = chunks
    else:
        chunks = cache[key]
    for chunk in chunks:
        first, last, layers, moe_layers = chunk.first, chunk.last, chunk.layers, chunk.moe_layers
        if tp > 1:
            # Each layer's column inputs and row outputs (an MoE layer's own are in _moe_layer_bytes).  The
            # embedding and the output layer add one each way; cross entropy all-reduces the max, then sum-exp
            # and target.
            columns, rows = _tp_widths(config)
            out["tp"] += m * (layers - moe_layers) * _tp_layer_numel(layout, columns, rows) * tokens * e
            if moe_layers:  # the attention's, and a shared expert's (a dense MLP) when there is one
                mlp = h if config.moe.shared_expert_intermediate_size is not None else 0
                out["tp"] += m * moe_layers * _tp_layer_numel(layout, columns - h + mlp, rows - h + mlp) * tokens * e
            ends = int(first) + int(last)
            out["tp"] += m * (2 if sp else 1) * ends * activation
            if last:
                out["tp"] += m * 3 * tokens * FLOAT32
            if sp:
                out["tp"] += chunk.sequence_parallel * (4 if layout.fsdp else grad_bytes)
        if layout.cp > 1:
            out["cp"] += m * layers * _cp_layer_bytes(config, layout, tokens, e)
        if layout.pp > 1:
            out["pp"] += chunk.pp_sends * m * (activation // (tp if sp else 1))
            if tied and (first or last):
                vocab = pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp) // tp
                out["embedding"] += (fsdp_rows(vocab, dp_span, dp_rank) * h * 4 if layout.fsdp
                                     else vocab * h * grad_bytes)
        if moe_layers:
            for axis, nbytes in _moe_layer_bytes(config, layout, tokens, e).items():
                out[axis] += round(m * moe_layers * nbytes)
        if layout.fsdp:
            gathers = 2 if layout.reshard_after_forward else 1
            for axis, numel in chunk.fsdp_units.items():
                # Every unit is gathered for each micro-batch's forward and, resharded after it, again for its
                # backward (resharded after each); the gradients are reduce-scattered once, after the last one.
                out[axis] += numel * (gathers * m * e + grad_bytes)
            continue
        if dp_span > 1:
            out["dp"] += chunk.dense * (grad_bytes + (layout.param_bytes if layout.zero1 else 0))
        if layout.expert_dp > 1:
            out["expert_dp"] += chunk.expert * (grad_bytes + (layout.param_bytes if layout.zero1 else 0))
    if dp_span > 1 and pp_rank == stages.last_rank:
        out["dp"] += LOGGED_METRICS * FLOAT64  # the loss, on the last stage
    # The global gradient norm: one float32 sum over each model-parallel group (and the ZeRO-1 shards' group)
    # for the dense and the expert parameters; fp16's inf check a float32 max over dp, tp and pp.
    sizes = {"tp": tp, "pp": layout.pp, "dp": dp_span, "ep": layout.ep, "expert_dp": layout.expert_dp,
             "expert_tp": layout.expert_tp}
    axes = ["tp", "pp", "expert_tp", "ep", "pp"] + (["dp", "expert_dp"] if layout.zero1 or layout.fsdp else [])
    axes += ["dp", "tp", "pp"] if layout.precision == "fp16" else []
    for axis in axes:
        if sizes[axis] > 1:
            out[axis] += FLOAT32
    world = layout.world
    if world > 1:
        out["world"] += FLOAT32 + INT32 * world
    return out
