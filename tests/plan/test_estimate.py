"""The step time's communication is :mod:`megalite.plan.traffic`'s bytes over each group's link (one definition)."""

from __future__ import annotations

import dataclasses

import pytest

from megalite.hardware import load_hardware
from megalite.models.config import GPTConfig
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout
from megalite.plan.traffic import collective_bytes

CONFIG = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=512,
                   max_position_embeddings=256, ffn_hidden_size=150)  # 150 rows: FSDP2 pads them to 152
SEQ, BATCH = 256, 16
BANDWIDTH = 1e6  # slow enough that no collective hides behind compute


def _hardware():
    return dataclasses.replace(load_hardware("h100"), gpus_per_node=64, intra_node_bandwidth=BANDWIDTH,
                               intra_node_latency_s=0.0, inter_node_bandwidth=BANDWIDTH, inter_node_latency_s=0.0)


@pytest.mark.parametrize("comm_type", ["all_gather", "a2a"])
def test_context_parallel_time_is_its_collectives_bytes(comm_type):
    layout = Layout(cp=4, dp=2, cp_comm_type=comm_type, precision="bf16", micro_batch_size=2)
    est = estimate(CONFIG, layout, _hardware(), SEQ, BATCH)
    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)["cp"]
    assert sent > 0 and est.time["cp"] == pytest.approx(3 / 4 * sent / BANDWIDTH, rel=1e-12)


def test_fsdp2_time_is_its_gathers_and_reduce_scatters_past_the_compute():
    layout = Layout(dp=4, fsdp=True, precision="bf16", grad_reduce_in_fp32=False, micro_batch_size=1)
    est = estimate(CONFIG, layout, _hardware(), SEQ, BATCH)
    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)["dp"]
    compute = sum(est.time[kind] for kind in ("gemm", "attention", "memory_bound", "op_overhead"))
    assert est.time["dp"] == pytest.approx(3 / 4 * sent / BANDWIDTH - compute, rel=1e-12)
    # Each micro-batch gathers every unit twice: fewer, larger micro-batches move fewer bytes.
    fewer = estimate(CONFIG, layout.with_(micro_batch_size=4), _hardware(), SEQ, BATCH)
    assert fewer.time["dp"] < est.time["dp"]


def test_calibration_fit_recovers_the_gemm_curve():
    from megalite.plan.calibrate import fit_gemm_curve

    rows = (16, 64, 256, 1024)
    peak, half = fit_gemm_curve(rows, [3e10 * r / (r + 40.0) for r in rows])
    assert peak == pytest.approx(3e10, rel=1e-9) and half == pytest.approx(40.0, rel=1e-9)


def test_smaller_micro_batches_are_predicted_slower_where_the_gemm_curve_says():
    """GPT 1.3B on one H200: megalite measured 53,649 tokens/s at micro-batch 8 and 59,553 at 16
    (benchmarks/README.md); the profile's curve is fitted to them."""
    config = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50303,
                       max_position_embeddings=2048)
    hw = load_hardware("h200")
    speed = {mbs: estimate(config, Layout(precision="bf16", micro_batch_size=mbs), hw, 2048, 32).tokens_per_s_per_gpu
             for mbs in (8, 16)}
    assert speed[16] / speed[8] == pytest.approx(59553 / 53649, rel=0.01)
    for mbs, measured in ((8, 53649), (16, 59553)):
        assert speed[mbs] == pytest.approx(measured, rel=0.02)


def test_fsdp2_kept_after_forward_gathers_once_per_micro_batch_and_holds_the_whole_model():
    from megalite.plan.memory import layer_params, rank_chunks

    layout = Layout(dp=4, fsdp=True, precision="bf16", grad_reduce_in_fp32=False, micro_batch_size=1)
    kept = layout.with_(reshard_after_forward=False)
    assert "--no-reshard-after-forward" in kept.flags()
    resharded, held = (estimate(CONFIG, x, _hardware(), SEQ, BATCH) for x in (layout, kept))
    m = BATCH // 4
    sent = {x: collective_bytes(CONFIG, x, SEQ, BATCH)["dp"] for x in (layout, kept)}
    gathered = (sent[layout] - sent[kept]) / (m * 2)  # one gather less per micro-batch, in bf16
    assert gathered == sum(-(-p.shape[0] // 4) * 4 * (p.numel // p.shape[0]) for p in rank_chunks(CONFIG, layout, 0)[0])
    layer = sum(p.numel for p in layer_params(CONFIG, 0, layout))
    everything = sum(p.numel for p in rank_chunks(CONFIG, layout, 0)[0])
    assert held.memory["fsdp_gathered"] == (everything + 2 * layer) * 2
    assert resharded.memory["fsdp_gathered"] == 4 * layer * 2
