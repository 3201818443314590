"""The step's compute beyond its GEMMs: attention, memory-bound ops, per-op overhead, ranks sharing CPU cores."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.hardware import load_hardware
from megalite.models.config import GPTConfig
from megalite.models.gpt import GPTModel
from megalite.plan.compute import EMBEDDING_AND_LOSS_OPS, LAYER_OPS, ROPE_OPS, compute_time
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout

CONFIG = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
SEQ, BATCH = 64, 8


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(layers: int, **kwargs) -> tuple[int, int]:
    """Aten ops of a GPT's forward (to the per-token losses) and backward (from their sum), after a first step
    made the gradients (later micro-batches accumulate into them)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=100,
                               max_position_embeddings=16, **kwargs))
    ids, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    for _ in range(2):
        with _CountOps() as counter:
            losses = model(ids, labels)
            forward = counter.count
            losses.sum().backward()
    return forward, counter.count - forward


@pytest.mark.parametrize("kwargs, extra", [({}, {"forward": 0, "backward": 0}),
                                           ({"position_embedding_type": "rope"}, ROPE_OPS)])
def test_op_counts_are_the_ops_megalites_gpt_runs(kwargs, extra):
    one, two = _ops(1, **kwargs), _ops(2, **kwargs)
    for i, phase in enumerate(("forward", "backward")):
        assert two[i] - one[i] == LAYER_OPS[phase] + extra[phase]
        if not kwargs:  # RoPE's cos/sin tables, once per forward, are not priced: a few ops a micro-batch
            assert 2 * one[i] - two[i] == EMBEDDING_AND_LOSS_OPS[phase]


def _cpu(**changes):
    # the collectives' CPU growth with the compute between the calls: its own test
    return dataclasses.replace(load_hardware("cpu"), **{"attention_efficiency": 0.5, "op_overhead_s": 5e-6,
                                                        "cores": 2, "collective_cpu_per_compute": 0.0, **changes})


def test_each_kind_of_work_is_priced_at_its_own_rate():
    layout = Layout(micro_batch_size=2)
    base = compute_time(CONFIG, layout, _cpu(), SEQ, BATCH)
    assert all(base[kind] > 0 for kind in ("gemm", "attention", "memory_bound", "op_overhead"))
    m = BATCH // 2
    ops = CONFIG.num_layers * sum(LAYER_OPS.values()) + sum(EMBEDDING_AND_LOSS_OPS.values())
    assert base["op_overhead"] == pytest.approx(m * ops * 5e-6, rel=1e-12)
    # attention at twice its FLOP rate and half its per-score softmax cost
    faster = {"attention": compute_time(CONFIG, layout, _cpu(attention_efficiency=1.0,
                                                               attention_score_s=_cpu().attention_score_s / 2),
                                        SEQ, BATCH),
              # the memory-bound ops' passes at the memory's bandwidth, their exp/erf/tanh at the exponential rate
              "memory_bound": compute_time(CONFIG, layout, _cpu(hbm_bandwidth=2 * _cpu().hbm_bandwidth,
                                                                exp_rate=2 * _cpu().exp_rate), SEQ, BATCH)}
    for kind, changed in faster.items():
        assert changed[kind] == pytest.approx(base[kind] / 2, rel=1e-12)
        assert all(changed[other] == base[other] for other in base if other != kind)
    # The step is the sum of its parts: nothing priced twice, nothing dropped.
    est = estimate(CONFIG, layout, _cpu(), SEQ, BATCH)
    assert est.step_time_s == pytest.approx(sum(est.time.values()), rel=1e-12)
    assert est.time["gemm"] == base["gemm"] and est.time["memory_bound"] == base["memory_bound"]


@pytest.mark.parametrize("activation, per_element", [("gelu", 1 + 2), ("swiglu", 1 + 1)])
def test_activation_and_loss_functions_run_at_the_exp_rate_on_a_cpu(activation, per_element):
    """GELU's erf (forward; its distribution and density backward), SwiGLU's sigmoid (each way) and the loss's
    exponentials (each way) are priced at the calibrated exponential rate, beyond the read and write their memory
    passes count; without one (the GPU profiles) nothing is added to those passes."""
    config = dataclasses.replace(CONFIG, activation=activation)
    layout = Layout(micro_batch_size=2)
    at = {rate: compute_time(config, layout, _cpu(exp_rate=rate), SEQ, BATCH) for rate in (1e9, 5e8, None)}
    m, tokens = BATCH // 2, 2 * SEQ
    functions = m * (config.num_layers * per_element * tokens * config.ffn_hidden_size + 2 * tokens * config.vocab_size)
    assert at[5e8]["memory_bound"] - at[1e9]["memory_bound"] == pytest.approx(functions / 1e9, rel=1e-9)
    # each beyond the read and write of a memory pass, which the elements' passes already count
    beyond = 1 / 1e9 - 2 * 4 / _cpu().hbm_bandwidth
    assert at[1e9]["memory_bound"] - at[None]["memory_bound"] == pytest.approx(functions * beyond, rel=1e-9)


def test_more_ranks_than_cores_take_all_ranks_work_over_the_cores():
    layout = Layout(dp=8, micro_batch_size=1)
    def busy(est):
        return sum(est.time[k] for k in ("gemm", "attention", "memory_bound", "op_overhead", "collective_cpu",
                                         "optimizer"))

    shared = estimate(CONFIG, layout, _cpu(), SEQ, BATCH)
    assert shared.time["oversubscription"] > 0
    assert shared.step_time_s == pytest.approx(8 * busy(shared) / 2, rel=1e-12)
    own = estimate(CONFIG, layout, _cpu(cores=None), SEQ, BATCH)
    assert own.time["oversubscription"] == 0 and own.step_time_s < shared.step_time_s
    two = estimate(CONFIG, Layout(dp=2, micro_batch_size=4), _cpu(), SEQ, BATCH)
    assert two.time["oversubscription"] == 0


def test_collectives_hide_behind_compute_only_where_a_core_is_free():
    from megalite.plan.traffic import collective_bytes

    layout = Layout(dp=2, micro_batch_size=2)
    # the link's terms (a calibrated collective_wait replaces them where every core computes: the test below)
    link = {"intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0, "collective_wait": None}
    busy = estimate(CONFIG, layout, _cpu(**link), SEQ, BATCH)  # two ranks on two cores: no core to spare
    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)["dp"]
    assert busy.time["dp"] == pytest.approx(2 * (1 / 2) * sent / _cpu().intra_node_bandwidth, rel=1e-12)
    spare = estimate(CONFIG, layout, _cpu(cores=4, **link), SEQ, BATCH)  # the all-reduce overlaps the last backward
    assert spare.time["dp"] < busy.time["dp"]


COSTS = {"all_reduce": [1e-4, 1e-9], "all_gather": [2e-4, 2e-9], "reduce_scatter": [3e-4, 3e-9],
         "send_recv": [4e-5, 4e-10]}


TP_SP_CALLS = 4 * (2 * 4 * 2 + 2 + 2 + 2)
"""A tp2 + SP step's TP calls (4 micro-batches): each layer's 4 all-gathers and 4 reduce-scatters, the embedding's
reduction and its gradient's gather, the output layer's gather and its gradient's reduction, the loss's maximum and
sums (as the step counted them: tests/plan/test_traffic.py::test_tensor_parallel_calls_are_the_calls_a_step_makes)."""

PRICED = [  # (layout, {op: (bytes, calls)} of its collectives from collective_bytes' counts per axis)
    (Layout(dp=2, micro_batch_size=2), lambda sent: {"all_reduce": (sent["dp"], 1)}),
    (Layout(tp=2, sequence_parallel=True, micro_batch_size=2),
     lambda sent: {op: (sent["tp"] / 2, TP_SP_CALLS / 2) for op in ("all_gather", "reduce_scatter")}),
    # the ring's sends, each matched by a receive of as much: twice the (two ranks' mean) cost
    (Layout(cp=2, micro_batch_size=2),
     lambda sent: {"send_recv": (2 * sent["cp"], 2 * 4 * 2 * (1 * 2 + 2)), "all_reduce": (sent["dp"], 1)}),
]


@pytest.mark.parametrize("layout, priced", PRICED)
def test_collectives_cpu_is_charged_as_compute_where_every_core_computes(layout, priced):
    from megalite.plan.traffic import collective_bytes

    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)
    # two ranks: a call costs its per-call CPU, the buffer its bytes at the per-byte CPU
    expected = sum(COSTS[op][0] * calls + COSTS[op][1] * nbytes for op, (nbytes, calls) in priced(sent).items())
    busy = estimate(CONFIG, layout, _cpu(collective_cpu=COSTS), SEQ, BATCH)
    assert busy.time["collective_cpu"] == pytest.approx(expected, rel=1e-12) and expected > 0
    without = estimate(CONFIG, layout, _cpu(collective_cpu=None), SEQ, BATCH)
    assert without.time["collective_cpu"] == 0
    assert busy.step_time_s == pytest.approx(without.step_time_s + expected, rel=1e-12)
    # a spare core runs the collectives beside the compute
    assert estimate(CONFIG, layout, _cpu(collective_cpu=COSTS, cores=4), SEQ, BATCH).time["collective_cpu"] == 0


# by bytes per call: steeper per byte at the small sizes than at the large ones, as gloo's calls measured
TABLES = {op: [[0, c], [16 << 10, c + 64e-6], [256 << 10, c + 400e-6], [1 << 20, c + 1e-3]]
          for op, c in (("all_reduce", 1e-4), ("all_gather", 2e-4), ("reduce_scatter", 3e-4), ("send_recv", 4e-5))}


def _by_size(points, nbytes):
    """A call's seconds from ``points``, straight lines between them and the last one's slope beyond."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if nbytes <= xs[-1]:
        return float(np.interp(nbytes, xs, ys))
    return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (nbytes - xs[-1])


@pytest.mark.parametrize("layout, priced", PRICED)
def test_collectives_cpu_is_priced_by_each_calls_bytes_from_the_calibrated_table(layout, priced):
    """Each call costs the table's seconds at its share of the axis's bytes (two ranks: its whole cost per call);
    a profile written before the table, ``[per call, per byte]``, prices the straight line as before."""
    from megalite.plan.traffic import collective_bytes

    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)
    expected = sum(calls * _by_size(TABLES[op], nbytes / calls) for op, (nbytes, calls) in priced(sent).items())
    table = estimate(CONFIG, layout, _cpu(collective_cpu=TABLES), SEQ, BATCH)
    assert table.time["collective_cpu"] == pytest.approx(expected, rel=1e-12) and expected > 0
    straight = {op: [[0, c], [1, c + b]] for op, (c, b) in COSTS.items()}
    assert estimate(CONFIG, layout, _cpu(collective_cpu=straight), SEQ, BATCH).time["collective_cpu"] == \
        pytest.approx(estimate(CONFIG, layout, _cpu(collective_cpu=COSTS), SEQ, BATCH).time["collective_cpu"],
                      rel=1e-12)


def test_collective_table_extends_its_last_slope_and_rings_scale_the_bytes():
    hw = _cpu(collective_cpu=TABLES)
    c = TABLES["all_reduce"][0][1]
    # 2 MiB, beyond the last point: its slope (1 MiB - 256 KiB cost 600 us)
    beyond = c + 1e-3 + 600e-6 * (1 << 20) / (768 << 10)
    assert hw.collective_cpu_s("all_reduce", 3 * (2 << 20), 3, 2) == pytest.approx(3 * beyond, rel=1e-12)
    # four ranks: a ring of three steps per call, 2 x 3/4 of the two ranks' bytes, at the same bytes per call
    middle = 64e-6 + (400e-6 - 64e-6) * (64 << 10) / (240 << 10)
    assert hw.collective_cpu_s("all_reduce", 2 * (80 << 10), 2, 4) == pytest.approx(2 * (3 * c + 1.5 * middle),
                                                                                   rel=1e-12)
    # a send: twice the half exchange the table holds, whatever the ranks
    assert hw.collective_cpu_s("send_recv", 16 << 10, 1, 4) == pytest.approx(2 * (4e-5 + 64e-6), rel=1e-12)


@pytest.mark.parametrize("layout, runs", [
    (Layout(dp=2, micro_batch_size=2), 1),
    (Layout(tp=2, sequence_parallel=True, micro_batch_size=2), TP_SP_CALLS),
    (Layout(cp=2, micro_batch_size=2), 4 * 2 * (1 * 2 + 2) + 1),
])
def test_collectives_cpu_grows_with_the_compute_between_the_calls_up_to_the_calibrated(layout, runs):
    """Each call that runs spends ``collective_cpu_per_compute`` of the compute since the rank's previous call
    (an equal share of the step's) beyond its table, but no more than after ``collective_cpu_compute_s`` of it."""
    fraction = 0.07
    compute = sum(compute_time(CONFIG, layout, _cpu(), SEQ, BATCH).values())
    segment = compute / runs

    def cpu(**changes):
        return estimate(CONFIG, layout, _cpu(collective_cpu=COSTS, **changes), SEQ, BATCH).time["collective_cpu"]

    base = cpu()
    for limit, seconds in ((1.0, segment), (segment / 3, segment / 3)):
        grown = cpu(collective_cpu_per_compute=fraction, collective_cpu_compute_s=limit)
        assert grown - base == pytest.approx(fraction * runs * seconds, rel=1e-9) and grown > base
    # one rank runs no collective; a spare core, or no calibrated CPU, prices none
    alone = Layout(micro_batch_size=2)
    assert estimate(CONFIG, alone, _cpu(collective_cpu=COSTS, collective_cpu_per_compute=fraction,
                                        collective_cpu_compute_s=1.0, cores=1), SEQ, BATCH).time["collective_cpu"] == 0
    for changes in ({"cores": 4}, {"collective_cpu": None}):
        priced = estimate(CONFIG, layout, _cpu(**{"collective_cpu": COSTS, "collective_cpu_per_compute": fraction,
                                                  "collective_cpu_compute_s": 1.0, **changes}), SEQ, BATCH)
        assert priced.time["collective_cpu"] == 0


def test_a_profile_without_the_tables_loads_and_prices_as_before(tmp_path):
    """The profiles written before the by-size tables and the CPU's growth (and the GPU ones, which have neither)
    load; their collectives cost the straight line and nothing grows with the compute."""
    import json

    from megalite.hardware import save_hardware

    old = {k: v for k, v in vars(_cpu(collective_cpu=COSTS)).items()
           if k not in ("collective_cpu_per_compute", "collective_cpu_compute_s")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**old, "device_names": []}))
    hw = load_hardware(str(path))
    assert hw.collective_cpu_per_compute == hw.collective_cpu_compute_s == 0
    layout = Layout(tp=2, sequence_parallel=True, micro_batch_size=2)
    assert estimate(CONFIG, layout, hw, SEQ, BATCH).time == estimate(CONFIG, layout, _cpu(collective_cpu=COSTS),
                                                                     SEQ, BATCH).time
    save_hardware(_cpu(collective_cpu=TABLES), str(path))  # and a table survives the round trip
    assert load_hardware(str(path)).collective_cpu == TABLES


WAITS = {"all_reduce": [5e-4, 5e-9], "all_gather": [6e-4, 6e-9], "reduce_scatter": [7e-4, 7e-9],
         "send_recv": [8e-5, 8e-10]}
COMMUNICATION = ("tp", "cp", "ep", "pp", "dp")


@pytest.mark.parametrize("layout, priced", PRICED)
def test_collectives_waits_replace_the_link_terms_where_every_core_computes(layout, priced):
    from megalite.plan.traffic import collective_bytes

    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)
    expected = sum(WAITS[op][0] * calls + WAITS[op][1] * nbytes for op, (nbytes, calls) in priced(sent).items())
    # the wait's growth with the compute between the calls: the test below
    busy = estimate(CONFIG, layout, _cpu(collective_cpu=COSTS, collective_wait=WAITS, collective_wait_per_compute=0.0),
                    SEQ, BATCH)
    assert sum(busy.time[axis] for axis in COMMUNICATION) == pytest.approx(expected, rel=1e-12) and expected > 0
    link = estimate(CONFIG, layout, _cpu(collective_cpu=COSTS, collective_wait=None), SEQ, BATCH)
    assert busy.time["collective_cpu"] == link.time["collective_cpu"] > 0
    assert busy.step_time_s == pytest.approx(sum(busy.time.values()), rel=1e-12)
    assert busy.step_time_s - link.step_time_s == pytest.approx(
        expected - sum(link.time[axis] for axis in COMMUNICATION), rel=1e-9)
    # with a core to spare the link terms price the collectives (hidden behind compute where they can be)
    with_waits, without = (estimate(CONFIG, layout, _cpu(collective_wait=waits, cores=4), SEQ, BATCH)
                           for waits in (WAITS, None))
    assert with_waits.time == without.time


@pytest.mark.parametrize("layout, calls", [
    (Layout(dp=2, micro_batch_size=2), {"dp": 1}),
    (Layout(tp=2, sequence_parallel=True, micro_batch_size=2), {"tp": TP_SP_CALLS}),
    # the ring's sends (micro-batches x layers x (one forward and one backward step + the cp sends)) and the
    # gradients' all-reduce
    (Layout(cp=2, micro_batch_size=2), {"cp": 4 * 2 * (1 * 2 + 2), "dp": 1}),
])
def test_collectives_wait_in_proportion_to_the_compute_between_the_calls(layout, calls):
    fraction = 0.05
    at = {f: estimate(CONFIG, layout, _cpu(collective_wait=WAITS, collective_wait_per_compute=f), SEQ, BATCH)
          for f in (0.0, fraction)}
    compute = sum(compute_time(CONFIG, layout, _cpu(), SEQ, BATCH).values())
    # each call follows an equal share of the step's compute, and waits the fraction of it
    for axis in COMMUNICATION:
        share = calls.get(axis, 0) / sum(calls.values())
        assert at[fraction].time[axis] - at[0.0].time[axis] == pytest.approx(fraction * compute * share, rel=1e-9)
    assert at[fraction].step_time_s - at[0.0].step_time_s == pytest.approx(fraction * compute, rel=1e-9)
    # no collective, no wait (one rank on one busy core); a core to spare, the link's terms
    alone = {f: estimate(CONFIG, Layout(micro_batch_size=2),
                         _cpu(collective_wait=WAITS, collective_wait_per_compute=f, cores=1), SEQ, BATCH)
             for f in (0.0, fraction)}
    assert alone[fraction].time == alone[0.0].time
    spare = {f: estimate(CONFIG, layout, _cpu(collective_wait=WAITS, collective_wait_per_compute=f, cores=4), SEQ,
                         BATCH) for f in (0.0, fraction)}
    assert spare[fraction].time == spare[0.0].time


def test_blockwise_exponentials_run_at_the_exp_rate():
    layout = Layout(cp=2, micro_batch_size=2)
    hw = _cpu()
    at = {rate: compute_time(CONFIG, layout, _cpu(exp_rate=rate), SEQ, BATCH) for rate in (1e9, 5e8)}
    heads, m = CONFIG.num_attention_heads, BATCH // 2
    scores = 2 * heads * SEQ / 2 * SEQ * 5 / 8  # 5 of the 8 chunk pairs of a [seq / 2, seq] score matrix
    exps = m * CONFIG.num_layers * (2 + 1) * scores  # log-sum-exp and probabilities forward, probabilities backward
    tokens = 2 * SEQ / 2  # and GELU's erf (1 forward, 2 backward) and the loss's exponentials (1 and 1)
    exps += m * (CONFIG.num_layers * (1 + 2) * tokens * CONFIG.ffn_hidden_size + 2 * tokens * CONFIG.vocab_size)
    assert at[5e8]["memory_bound"] - at[1e9]["memory_bound"] == pytest.approx(exps / 1e9, rel=1e-9)
    assert all(at[5e8][kind] == at[1e9][kind] for kind in ("gemm", "attention", "op_overhead"))
    # without a calibrated rate (the GPU profiles) an exponential is a read and a write at the memory's bandwidth
    gpu_like = compute_time(CONFIG, layout, _cpu(exp_rate=hw.hbm_bandwidth / 8), SEQ, BATCH)
    assert compute_time(CONFIG, layout, _cpu(exp_rate=None), SEQ, BATCH) == pytest.approx(gpu_like, rel=1e-12)


@pytest.mark.parametrize("seq, cp", [(256, 2), (2048, 4)])
def test_blockwise_op_counts_are_the_ops_the_ring_runs(seq, cp):
    """The blockwise attention's ops on every CP rank (its calls over each ring step's key block and the merges
    between steps, forward; its calls backward), counted, against :func:`blockwise_tiles` priced at the op
    constants; and its tile pairs, which differ between ranks (cp 2: rank 1's chunks 1 and 2 are adjacent, one
    tile)."""
    from megalite.context_parallel.blockwise import DEFAULT_TILE, Tokens, attention_backward, attention_forward, merge
    from megalite.context_parallel.sequence_split import chunk_indices
    from megalite.plan.compute import (BLOCKWISE_CALL_OPS, BLOCKWISE_MASK_OPS, BLOCKWISE_PAIR_OPS,
                                       blockwise_forward_extra_ops, blockwise_tiles)

    tokens = [Tokens(chunk_indices(seq, cp, rank), None, DEFAULT_TILE) for rank in range(cp)]
    q, k, v = (torch.randn(1, 1, seq // cp, 2) for _ in range(3))
    work = blockwise_tiles(seq, cp, "p2p")
    for rank in range(cp):
        counted = {}
        with _CountOps() as counter:
            out = lse = None
            for step in range(cp):
                out, lse = merge(out, lse, *attention_forward(q, k, v, tokens[rank], tokens[(rank - step) % cp], 1.0))
        counted["forward"] = counter.count
        with _CountOps() as counter:
            for step in range(cp):
                attention_backward(out, q, k, v, out, lse, tokens[rank], tokens[(rank - step) % cp], 1.0)
        counted["backward"] = counter.count
        w = work[rank]
        priced = {phase: w["pairs"] * BLOCKWISE_PAIR_OPS[phase] + w["masked"] * BLOCKWISE_MASK_OPS[phase]
                  + w["calls"] * BLOCKWISE_CALL_OPS[phase] for phase in ("forward", "backward")}
        priced["forward"] += blockwise_forward_extra_ops(w)
        for phase in ("forward", "backward"):
            assert priced[phase] == pytest.approx(counted[phase], rel=0.03)
    if cp == 2:
        assert [(w["pairs"], w["masked"], w["scores"]) for w in work] == [(4, 2, 3 * 64 * 64 + 64 * 128),
                                                                          (2, 1, 128 * 128 + 128 * 64)]


@pytest.mark.parametrize("recompute, passes", [(None, 3), ("selective", 4)])
def test_fused_attention_pays_its_softmax_per_score_beyond_its_flops(recompute, passes):
    """Each token's query meets ``seq`` keys per head and layer; a score costs ``attention_score_s`` over the forward
    and backward (a third of it again where the forward is recomputed), whatever the head dimension."""
    layout = Layout(micro_batch_size=2, recompute=recompute)
    without, with_scores = (compute_time(CONFIG, layout, _cpu(attention_score_s=cost), SEQ, BATCH)
                            for cost in (0, 2e-9))
    scores = BATCH * SEQ * SEQ * CONFIG.num_attention_heads * CONFIG.num_layers
    assert with_scores["attention"] - without["attention"] == pytest.approx(passes / 3 * scores * 2e-9, rel=1e-12)
    assert all(with_scores[kind] == without[kind] for kind in without if kind != "attention")
