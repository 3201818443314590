"""Memory per GPU and step time of one layout: the planner's whole model of a training step.

Memory: the exact weights / gradients / optimizer bytes (:mod:`megalite.plan.memory`) plus one
micro-batch's activations (:mod:`megalite.plan.activations`) times the micro-batches in flight, plus
one recomputed layer under full recompute; the larger of the first and last pipeline rank.

Time: the compute of :func:`~megalite.plan.compute.compute_time` (GEMMs at the GEMM-efficiency curve, attention,
memory-bound ops, per-op overhead), stretched by the schedule's bubble
(:func:`~megalite.pipeline.timeline.analytic_bubble`), plus the communication left exposed: the bytes
:func:`~megalite.plan.traffic.collective_bytes` counts per axis (the one count of them), over the link each
group spans (NVLink within a node, else the network) as ring collectives, less what overlaps compute (see
:func:`_exposed_communication`: none where every CPU core computes), the CPU the collectives take from the cores
that compute (``collective_cpu``: gloo's copies, reductions and socket work, where every CPU core computes; the
time they wait beyond it, ``collective_wait``, in place of the link's terms there), and the
optimizer step at HBM bandwidth; where ranks share CPU cores, at least
all ranks' compute and optimizer work over the cores (:func:`~megalite.plan.compute.oversubscribed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.hardware import Hardware, collective_runs
from megalite.models.config import GPTConfig, gpt_flops_per_token
from megalite.plan.compute import compute_time, overlaps_communication, oversubscribed
from megalite.pipeline.timeline import analytic_bubble
from megalite.plan.activations import (keeps_dropout_masks, layer_activation_bytes, microbatch_activation_bytes,
                                       microbatches_in_flight)
from megalite.plan.layout import DTYPE_BYTES, Layout
from megalite.plan.memory import rank_chunks, rank_state_bytes
from megalite.plan.traffic import collective_bytes

TP_HIDDEN_SHARE = 0.25
"""Share of a layer's TP communication that overlaps compute: one of its four collectives (per direction)."""

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


def _collective(bytes_: float, n: int, link: tuple[float, float], passes: int, calls: float = 0) -> float:
    """A ring collective of ``bytes_`` (its whole buffer, as :mod:`~megalite.plan.traffic` counts it) over
    ``n`` ranks: ``passes`` (2 for an all-reduce, 1 for an all-gather, reduce-scatter or all-to-all) x
    (n-1)/n of the buffer over the link, plus a latency per ring step of each of ``calls`` collectives."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return passes * ((n - 1) / n * bytes_ / bandwidth + calls * (n - 1) * latency)


def _cached(cache: dict | None, key, compute):
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def _fsdp_gathered_bytes(config: GPTConfig, layout: Layout, pp_rank: int) -> int:
    """FSDP2's unsharded parameters in flight: two transformer layers (one computing, one prefetched), or
    all of the rank's when they are kept from forward to backward, and two layers' unsharded gradients, in
    the compute dtype."""
    from megalite.plan.memory import layer_params

    layer = max(sum(p.numel for p in layer_params(config, i, layout)) for i in range(min(config.num_layers, 2)))
    held = 2 * layer if layout.reshard_after_forward else \
        sum(p.numel for chunk in rank_chunks(config, layout, pp_rank) for p in chunk)
    return (held + 2 * layer) * DTYPE_BYTES[layout.precision]


def tensor_parallel_calls(config: GPTConfig, layout: Layout, microbatches: int) -> float:
    """Tensor-parallel collectives a rank calls for ``microbatches`` micro-batches: each layer's four (a column
    layer's input gather or its gradient's reduction and a row layer's output reduction, each way; under sequence
    parallelism an all-gather and a reduce-scatter for each), again for a full recompute's forward, and beyond the
    layers the vocabulary-parallel embedding's reduction (and under SP its gradient's gather), the output layer's
    input gradient (and under SP its input's gather) and the loss's maximum and sums.  With a pipeline the
    embedding's are the first stage's and the rest the last's, whose count (the larger) this is, with the stages'
    mean layers.  The step's few calls that do not repeat per micro-batch (the gradient norm's sums) are left out."""
    sp = layout.sequence_parallel and layout.tp > 1
    forwards = 2 if layout.recompute == "full" else 1
    ends = (1 + sp) * (1 + (layout.pp == 1)) + 2
    return microbatches * (config.num_layers / layout.pp * (4 + 2 * (forwards - 1)) * (1 + sp) + ends)


def _exposed_communication(config: GPTConfig, layout: Layout, hw: Hardware, seq_length: int,
                           global_batch_size: int, compute: float, attention: float,
                           cache: dict | None) -> tuple[dict, float]:
    """Seconds of each axis's communication left exposed, and the CPU seconds a rank spends in the collectives
    where they run on the cores that compute (:meth:`~megalite.hardware.Hardware.collective_cpu_s`; 0 elsewhere),
    from :func:`~megalite.plan.traffic.collective_bytes` (the larger of the first and last pipeline rank, per
    axis) over the link its group spans.  ``compute`` and
    ``attention`` are the step's compute and attention seconds on a rank; nothing overlaps where every CPU core
    computes (:func:`~megalite.plan.compute.overlaps_communication`).

    Overlap: one of a layer's four TP collectives (a column layer's input-gradient reduction) hides behind
    its weight-gradient GEMM; the p2p CP ring behind the attention it feeds (the all-gather and a2a
    variants wait); DP gradient reduction behind the last micro-batch's backward (ZeRO-1's parameter
    all-gather follows the step), FSDP2's gathers and reduce-scatters behind the whole step's compute.
    EP and expert-TP all-to-alls (counted together as ``ep``) and PP sends are exposed.  Latency is counted per TP, CP, EP and PP collective.

    The CPU seconds: TP's all-reduces (all-gathers and reduce-scatters under sequence parallelism), the CP ring's
    sends (the all-gather variant's all-gathers; the all-to-alls' as sends), EP's all-to-alls as sends and expert
    TP's as all-gathers, PP's sends, the tied embedding's all-reduce, and DP's all-reduce (ZeRO-1: its gradients'
    reduce-scatter and its parameters' all-gather; FSDP2: each unit's gathers per micro-batch and its gradients'
    reduce-scatter, their bytes split as gathered in the compute dtype and reduced in fp32).  Where every core
    computes and the profile measured ``collective_wait`` (what those calls wait beyond their CPU, between ranks
    that compute: the partner's lag, the link), each axis's exposed seconds are its calls' waits in place of the
    link's latency and transfer terms, plus ``collective_wait_per_compute`` times the compute between its calls (the
    step's compute over all its calls that run, each taken to follow an equal share of it); each call's CPU grows
    likewise, by ``collective_cpu_per_compute`` times that compute up to ``collective_cpu_compute_s``.
    """
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    tp, cp, pp, ep, world = layout.tp, layout.cp, layout.pp, layout.ep, layout.world
    volume: dict = {}
    for pp_rank in sorted({0, pp - 1}):
        sent = collective_bytes(config, layout, seq_length, global_batch_size, pp_rank, cache=cache)
        volume = {axis: max(volume.get(axis, 0), nbytes) for axis, nbytes in sent.items()}
    layers = config.num_layers / pp
    sp = layout.sequence_parallel and tp > 1
    forwards = 2 if layout.recompute == "full" else 1
    out = {}
    cores_busy = not overlaps_communication(hw, world)
    # each axis's collectives as (op, bytes, calls, ranks), for the CPU and the waits they cost on busy cores
    calls: dict = {}
    tp_calls = tensor_parallel_calls(config, layout, m)
    hidden_share = TP_HIDDEN_SHARE
    step_compute = compute
    if cores_busy:
        compute = attention = hidden_share = 0.0
    out["tp"] = (1 - hidden_share) * _collective(volume["tp"], tp, hw.link(tp), 1 if sp else 2, tp_calls)
    if sp:
        calls["tp"] = [(op, volume["tp"] / 2, tp_calls / 2, tp) for op in ("all_gather", "reduce_scatter")]
    else:
        calls["tp"] = [("all_reduce", volume["tp"], tp_calls, tp)]
    cp_link = hw.link(tp * cp)
    if layout.cp_comm_type == "p2p":
        # Point-to-point sends: the whole payload crosses the link once.
        sends = m * layers * ((cp - 1) * (forwards + 1) + cp)
        ring = 0.0 if cp == 1 else volume["cp"] / cp_link[0] + sends * cp_link[1]
        out["cp"] = max(0.0, ring - attention)
        calls["cp"] = [("send_recv", volume["cp"], sends, cp)]
    else:
        n_calls = m * layers * (forwards + 1) * (2 if layout.cp_comm_type == "all_gather" else 4)
        out["cp"] = _collective(volume["cp"], cp, cp_link, 1, n_calls)
        op = "all_gather" if layout.cp_comm_type == "all_gather" else "send_recv"
        calls["cp"] = [(op, volume["cp"], n_calls, cp)]
    moe_layers = 0 if config.moe is None else sum(map(config.is_moe_layer, range(config.num_layers))) / pp
    # per MoE layer and micro-batch: the counts, then rows, expert ids and gates out and rows back, forward; rows
    # both ways and the gates' gradient in the backward
    out["ep"] = _collective(volume["ep"], ep, hw.link(layout.expert_tp * ep), 1, m * moe_layers * 8)
    calls["ep"] = [("send_recv", volume["ep"], m * moe_layers * 8, ep)]
    # expert TP, per MoE layer and micro-batch: the row count, rows, expert ids and gates gathered and the outputs
    # reduce-scattered forward; rows, gates and outputs the other way in the backward
    if moe_layers:
        etp = layout.expert_tp
        out["ep"] += _collective(volume["expert_tp"], etp, hw.link(etp), 1, m * moe_layers * 8)
        calls["ep"].append(("all_gather", volume["expert_tp"], m * moe_layers * 8, etp))
    link = hw.link(world)
    out["pp"] = volume["pp"] / link[0] + m * layout.stage_map().chunks * 2 * link[1] if pp > 1 else 0.0
    out["pp"] += _collective(volume["embedding"], 2, link, 2)
    calls["pp"] = [("send_recv", volume["pp"], m * layout.stage_map().chunks * 2, pp),
                   ("all_reduce", volume["embedding"], 1, 2)]
    last_backward = 2 * compute / m / 3
    dp = 0.0
    calls["dp"] = []
    for axis, n, span in (("dp", layout.dp * cp, tp * layout.dp * cp), ("expert_dp", layout.expert_dp, world // pp)):
        if layout.fsdp:
            dp += max(0.0, _collective(volume[axis], n, hw.link(span), 1) - compute)
            gathers = m * (1 + layout.reshard_after_forward)
            share = gathers * layout.param_bytes / (gathers * layout.param_bytes + 4)
            units = layers + 1
            calls["dp"] += [("all_gather", volume[axis] * share, units * gathers, n),
                            ("reduce_scatter", volume[axis] * (1 - share), units, n)]
        elif layout.zero1:
            grad_bytes = 4 if layout.grad_reduce_in_fp32 else layout.param_bytes
            share = grad_bytes / (grad_bytes + layout.param_bytes)
            grads = _collective(volume[axis] * share, n, hw.link(span), 1)
            dp += max(0.0, grads - last_backward) + _collective(volume[axis] * (1 - share), n, hw.link(span), 1)
            calls["dp"] += [("reduce_scatter", volume[axis] * share, 1, n),
                            ("all_gather", volume[axis] * (1 - share), 1, n)]
        else:
            dp += max(0.0, _collective(volume[axis], n, hw.link(span), 2) - last_backward)
            calls["dp"].append(("all_reduce", volume[axis], 1, n))
    out["dp"] = dp
    if not cores_busy:
        return out, 0.0
    # the calls that run, each taken to follow an equal share of the rank's compute
    runs = {axis: sum(count for _, nbytes, count, n in axis_calls if collective_runs(nbytes, n))
            for axis, axis_calls in calls.items()}
    segment = step_compute / max(sum(runs.values()), 1)
    if hw.collective_wait is not None:
        # measured where every core computes: the waits replace the link's terms (its latency and transfer), and
        # each call that runs waits in proportion to the rank's compute since its previous call
        out = {axis: sum(hw.collective_wait_s(*c) for c in axis_calls)
               + runs[axis] * segment * hw.collective_wait_per_compute for axis, axis_calls in calls.items()}
    cpu = sum(hw.collective_cpu_s(*c) for axis_calls in calls.values() for c in axis_calls)
    if hw.collective_cpu is not None:  # and each spends CPU in proportion to that compute, up to the measured
        cpu += sum(runs.values()) * min(segment, hw.collective_cpu_compute_s) * hw.collective_cpu_per_compute
    return out, cpu


def estimate(config: GPTConfig, layout: Layout, hw: Hardware, seq_length: int, global_batch_size: int,
             cache: dict | None = None, ops: str | None = None) -> Estimate:
    """Memory per GPU and step time of ``layout`` (assumed valid: see :func:`megalite.plan.search.check_layout`).

    ``cache``: a dict shared by the estimates of one model, holding what does not depend on the
    micro-batch size and recompute (the state bytes and parameter counts of each rank).  ``ops``: whose
    memory-bound ops run (:func:`~megalite.plan.compute.compute_time`).
    """
    m = global_batch_size // (layout.micro_batch_size * layout.dp)
    est = Estimate(layout, m)
    base = (layout.tp, layout.pp, layout.dp, layout.cp, layout.ep, layout.etp, layout.vpp, layout.schedule,
            layout.zero1, layout.fsdp, layout.precision, layout.first_stage_layers, layout.last_stage_layers,
            layout.grad_reduce_in_fp32, layout.bucket_size)
    masks = keeps_dropout_masks(hw, ops)
    shape = (layout.tp, layout.pp, layout.cp, layout.vpp, layout.schedule, layout.first_stage_layers,
             layout.last_stage_layers, layout.sequence_parallel, layout.micro_batch_size, layout.recompute,
             layout.precision, masks)
    # Memory on the first and the last pipeline rank (the first holds the most micro-batches, the last the logits).
    for pp_rank in sorted({0, layout.pp - 1}):
        state = _cached(cache, ("state", base, pp_rank), lambda: rank_state_bytes(config, layout, pp_rank))
        act = _cached(cache, ("act", shape, pp_rank),
                      lambda: microbatch_activation_bytes(config, layout, seq_length, pp_rank, masks))
        in_flight = microbatches_in_flight(layout, m, pp_rank)
        extra = 0
        if layout.recompute == "full":
            extra = _cached(cache, ("layer", shape),
                            lambda: layer_activation_bytes(config, layout, seq_length, 0, dropout_masks=masks))
        gathered = 0
        if layout.fsdp:
            gathered = _cached(cache, ("gathered", base, layout.reshard_after_forward, pp_rank),
                               lambda: _fsdp_gathered_bytes(config, layout, pp_rank))
        total = state.weights + state.grads + state.optimizer + int(act * in_flight) + extra + gathered
        if not est.memory or total > est.memory["total"]:
            est.memory = {"weights": state.weights, "grads": state.grads, "optimizer": state.optimizer,
                          "activations": int(act * in_flight), "activations_per_microbatch": act,
                          "microbatches_in_flight": in_flight, "recompute_buffer": extra,
                          "fsdp_gathered": gathered, "total": total, "pp_rank": pp_rank}

    tokens = global_batch_size * seq_length
    flops_per_token = _cached(cache, ("flops", seq_length), lambda: gpt_flops_per_token(config, seq_length))
    work = compute_time(config, layout, hw, seq_length, global_batch_size, ops)
    compute = sum(work.values())
    schedule = schedule_name(layout)
    bubble = _bubble(schedule, layout.pp, m, layout.stage_map().chunks)
    pipeline = compute / (1 - bubble) - compute

    comm, collective_cpu = _exposed_communication(config, layout, hw, seq_length, global_batch_size, compute,
                                                  work["attention"], cache)
    state_bytes = est.memory["weights"] + est.memory["grads"] + est.memory["optimizer"]
    optimizer_time = 2 * state_bytes / hw.hbm_bandwidth
    est.time = {**work, "pipeline_bubble": pipeline, **comm, "collective_cpu": collective_cpu,
                "optimizer": optimizer_time}
    step = compute + pipeline + sum(comm.values()) + collective_cpu + optimizer_time
    est.time["oversubscription"] = oversubscribed(hw, layout.world, compute + collective_cpu + optimizer_time, step)
    est.step_time_s = step + est.time["oversubscription"]
    est.tokens_per_s_per_gpu = tokens / est.step_time_s / layout.world
    est.mfu = est.tokens_per_s_per_gpu * flops_per_token / hw.peak(layout.precision)
    return est


def fits(est: Estimate, hw: Hardware) -> bool:
    return est.memory_total <= hw.hbm_bytes * (1 - RESERVED_FRACTION)
