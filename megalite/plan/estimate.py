"""Memory per GPU and step time of one layout: the planner's whole model of a training step.

Memory: the exact weights / gradients / optimizer bytes (:mod:`megalite.plan.memory`) plus one
micro-batch's activations (:mod:`megalite.plan.activations`) times the micro-batches in flight, plus
one recomputed layer under full recompute; the larger of the first and last pipeline rank.

Time: model FLOPs (the trainer's :func:`~megalite.models.config.gpt_flops_per_token`, plus what
recompute adds) at ``efficiency x peak``, stretched by the schedule's bubble
(:func:`~megalite.pipeline.timeline.analytic_bubble`), plus the communication left exposed:
TP/SP collectives (the column layer's backward all-reduce hides behind its weight-gradient GEMM),
the CP ring beyond the attention it overlaps, EP all-to-alls, PP sends, DP gradient reduction past
the last micro-batch's backward (ZeRO-1's parameter all-gather after the step; FSDP2's gathers
behind the whole step's compute), and the optimizer step at HBM bandwidth.  Collectives are ring
algorithms on the link their group spans (NVLink within a node, else the network).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.hardware import Hardware
from megalite.models.config import GPTConfig, gpt_flops_per_token
from megalite.moe.dispatcher import ranks_per_token
from megalite.pipeline.timeline import analytic_bubble
from megalite.plan.activations import (layer_activation_bytes, microbatch_activation_bytes,
                                       microbatches_in_flight)
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.plan.memory import rank_chunks, rank_state_bytes

RESERVED_FRACTION = 0.1
"""Share of device memory kept free for the allocator's fragmentation, workspaces and the CUDA context."""


@dataclass
class Estimate:
    layout: Layout
    num_microbatches: int
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    step_time_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0

    @property
    def memory_total(self) -> int:
        return self.memory["total"]


def schedule_name(layout: Layout) -> str:
    if layout.schedule is not None:
        return layout.schedule
    return "interleaved-1f1b" if (layout.vpp or 1) > 1 else "1f1b"


@lru_cache(maxsize=4096)
def _bubble(schedule: str, pp: int, m: int, vpp: int) -> float:
    if pp == 1:
        return 0.0
    if schedule == "zbv":
        return analytic_bubble(schedule, pp, min(m, 4 * pp), 2)
    return analytic_bubble(schedule, pp, m, vpp)


def _ring(bytes_: float, n: int, link: tuple[float, float], passes: float) -> float:
    """``passes`` x (n-1)/n of ``bytes_`` over the link, plus a latency per ring step."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return passes * ((n - 1) / n * bytes_ / bandwidth + (n - 1) * latency)


def _param_counts(config: GPTConfig, layout: Layout, pp_rank: int) -> tuple[int, int]:
    dense = expert = 0
    for chunk in rank_chunks(config, layout, pp_rank):
        for p in chunk:
            if p.expert:
                expert += p.numel
            else:
                dense += p.numel
    return dense, expert


def _cached(cache: dict | None, key, compute):
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _fsdp_gathered_bytes(config: GPTConfig, layout: Layout) -> int:
    """FSDP2's unsharded parameters in flight: two transformer layers (one computing, one prefetched) and
    their unsharded gradients, in the compute dtype."""
    from megalite.plan.memory import layer_params

    layer = max(sum(p.numel for p in layer_params(config, i, layout)) for i in range(min(config.num_layers, 2)))
    return 2 * 2 * layer * DTYPE_BYTES[layout.precision]


def estimate(config: GPTConfig, layout: Layout, hw: Hardware, seq_length: int, global_batch_size: int,
             cache: dict | None = None) -> Estimate:
    """Memory per GPU and step time of ``layout`` (assumed valid: see :func:`megalite.plan.search.check_layout`).

    ``cache``: a dict shared by the estimates of one model, holding what does not depend on the
    micro-batch size and recompute (the state bytes and parameter counts of each rank).
    """
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    est = Estimate(layout, m)
    base = (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.etp, layout.vpp, layout.schedule,
            layout.zero1, layout.fsdp, layout.precision, layout.first_stage_layers, layout.last_stage_layers,
            layout.grad_reduce_in_fp32, layout.bucket_size)
    shape = (layout.tp, layout.pp, layout.cp, layout.vpp, layout.schedule, layout.first_stage_layers,
             layout.last_stage_layers, layout.sequence_parallel, layout.micro_batch_size, layout.recompute,
             layout.precision)
    # Memory on the first and the last pipeline rank (the first holds the most micro-batches, the last the logits).
    for pp_rank in sorted({0, layout.pp - 1}):
        state = _cached(cache, ("state", base, pp_rank), lambda: rank_state_bytes(config, layout, pp_rank))
        act = _cached(cache, ("act", shape, pp_rank),
                      lambda: microbatch_activation_bytes(config, layout, seq_length, pp_rank))
        in_flight = microbatches_in_flight(layout, m, pp_rank)
        extra = 0
        if layout.recompute == "full":
            extra = _cached(cache, ("layer", shape), lambda: layer_activation_bytes(config, layout, seq_length, 0))
        gathered = 0
        if layout.fsdp:
            gathered = _cached(cache, ("gathered", base), lambda: _fsdp_gathered_bytes(config, layout))
        total = state.weights + state.grads + state.optimizer + int(act * in_flight) + extra + gathered
        if not est.memory or total > est.memory["total"]:
            est.memory = {"weights": state.weights, "grads": state.grads, "optimizer": state.optimizer,
                          "activations": int(act * in_flight), "activations_per_microbatch": act,
                          "microbatches_in_flight": in_flight, "recompute_buffer": extra,
                          "fsdp_gathered": gathered, "total": total, "pp_rank": pp_rank}

    e = DTYPE_BYTES[layout.precision]
    peak = hw.peak(layout.precision) * hw.efficiency
    tokens = global_batch_size * seq_length
    flops_per_token = _cached(cache, ("flops", seq_length), lambda: gpt_flops_per_token(config, seq_length))
    h, d = config.hidden_size, config.kv_channels
    attention_fwd_per_token = 4 * seq_length * config.num_attention_heads * d * config.num_layers
    extra = 0.0
    if layout.recompute == "full":
        extra = (flops_per_token - 6.0 * h * config.vocab_size) / 3
    elif layout.recompute == "selective":
        extra = attention_fwd_per_token
    compute = tokens * (flops_per_token + extra) / layout.world / peak
    schedule = schedule_name(layout)
    bubble = _bubble(schedule, layout.pp, m, layout.stage_map().chunks)
    pipeline = compute / (1 - bubble) - compute

    tp, cp, pp = layout.tp, layout.cp, layout.pp
    layers = config.num_layers / pp
    mb_tokens = layout.micro_batch_size * seq_length / cp
    tp_time = 0.0
    if tp > 1:
        collectives = 3 + (2 if layout.recompute == "full" else 0)
        tp_time = layers * m * collectives * _ring(mb_tokens * h * e, tp, hw.link(tp), 2)
    cp_time = 0.0
    if cp > 1:
        kv = 2 * mb_tokens * config.num_query_groups / tp * d * e
        ring = 3 * _ring(kv * cp, cp, hw.link(tp * cp), 1)
        attention = 3 * 4 * mb_tokens * seq_length * config.num_attention_heads / tp * d / 2 / peak
        cp_time = layers * m * max(0.0, ring - attention)
    ep_time = 0.0
    if config.moe is not None and layout.ep > 1:
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers)) / pp
        moe = config.moe
        reached = ranks_per_token(moe.num_experts, moe.topk, layout.ep, moe.group_topk)
        routed = mb_tokens * reached * h * e / (tp if layout.sequence_parallel else 1)
        ep_time = moe_layers * m * 4 * _ring(routed, layout.ep, hw.link(layout.expert_tp * layout.ep), 1)
    pp_time = 0.0
    if pp > 1:
        sent = mb_tokens * h * e / (tp if layout.sequence_parallel else 1)
        bandwidth, latency = hw.link(layout.world)
        pp_time = m * layout.stage_map().chunks * 2 * (sent / bandwidth + latency)
    dense, expert = _cached(cache, ("params", base), lambda: _param_counts(config, layout, 0))
    grad_bytes = 4 if layout.grad_reduce_in_fp32 else layout.param_bytes
    dp_span, edp = layout.dp * cp, layout.expert_dp
    dense_link, expert_link = hw.link(tp * dp_span), hw.link(layout.world // pp)
    last_backward = 2 * compute / m / 3
    if layout.fsdp:
        gathered = DTYPE_BYTES[layout.precision]
        comm = (_ring(dense * (2 * m * gathered + grad_bytes), dp_span, dense_link, 1)
                + _ring(expert * (2 * m * gathered + grad_bytes), edp, expert_link, 1))
        dp_time = max(0.0, comm - compute)
    elif layout.zero1:
        grads = _ring(dense * grad_bytes, dp_span, dense_link, 1) + _ring(expert * grad_bytes, edp, expert_link, 1)
        params = (_ring(dense * layout.param_bytes, dp_span, dense_link, 1)
                  + _ring(expert * layout.param_bytes, edp, expert_link, 1))
        dp_time = max(0.0, grads - last_backward) + params
    else:
        grads = _ring(dense * grad_bytes, dp_span, dense_link, 2) + _ring(expert * grad_bytes, edp, expert_link, 2)
        dp_time = max(0.0, grads - last_backward)
    state_bytes = est.memory["weights"] + est.memory["grads"] + est.memory["optimizer"]
    optimizer_time = 2 * state_bytes / hw.hbm_bandwidth
    est.time = {"compute": compute, "pipeline_bubble": pipeline, "tp": tp_time, "cp": cp_time, "ep": ep_time,
                "pp": pp_time, "dp": dp_time, "optimizer": optimizer_time}
    est.step_time_s = sum(est.time.values())
    est.tokens_per_s_per_gpu = tokens / est.step_time_s / layout.world
    est.mfu = est.tokens_per_s_per_gpu * flops_per_token / hw.peak(layout.precision)
    return est


def fits(est: Estimate, hw: Hardware) -> bool:
    return est.memory_total <= hw.hbm_bytes * (1 - RESERVED_FRACTION)
