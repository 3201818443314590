"""The step's compute beyond its GEMMs: attention, memory-bound ops, per-op overhead, ranks sharing CPU cores."""

from __future__ import annotations

import dataclasses

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
    return dataclasses.replace(load_hardware("cpu"), **{"attention_efficiency": 0.5, "op_overhead_s": 5e-6,
                                                        "cores": 2, **changes})


def test_each_kind_of_work_is_priced_at_its_own_rate():
    layout = Layout(micro_batch_size=2)
    base = compute_time(CONFIG, layout, _cpu(), SEQ, BATCH)
    assert all(base[kind] > 0 for kind in ("gemm", "attention", "memory_bound", "op_overhead"))
    m = BATCH // 2
    ops = CONFIG.num_layers * sum(LAYER_OPS.values()) + sum(EMBEDDING_AND_LOSS_OPS.values())
    assert base["op_overhead"] == pytest.approx(m * ops * 5e-6, rel=1e-12)
    faster = {"attention": compute_time(CONFIG, layout, _cpu(attention_efficiency=1.0), SEQ, BATCH),
              "memory_bound": compute_time(CONFIG, layout, _cpu(hbm_bandwidth=2 * _cpu().hbm_bandwidth), SEQ, BATCH)}
    for kind, changed in faster.items():
        assert changed[kind] == pytest.approx(base[kind] / 2, rel=1e-12)
        assert all(changed[other] == base[other] for other in base if other != kind)
    # The step is the sum of its parts: nothing priced twice, nothing dropped.
    est = estimate(CONFIG, layout, _cpu(), SEQ, BATCH)
    assert est.step_time_s == pytest.approx(sum(est.time.values()), rel=1e-12)
    assert est.time["gemm"] == base["gemm"] and est.time["memory_bound"] == base["memory_bound"]


def test_more_ranks_than_cores_take_all_ranks_work_over_the_cores():
    layout = Layout(dp=8, micro_batch_size=1)
    def busy(est):
        return sum(est.time[k] for k in ("gemm", "attention", "memory_bound", "op_overhead", "optimizer"))

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
    link = {"intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0}
    busy = estimate(CONFIG, layout, _cpu(**link), SEQ, BATCH)  # two ranks on two cores: no core to spare
    sent = collective_bytes(CONFIG, layout, SEQ, BATCH)["dp"]
    assert busy.time["dp"] == pytest.approx(2 * (1 / 2) * sent / _cpu().intra_node_bandwidth, rel=1e-12)
    spare = estimate(CONFIG, layout, _cpu(cores=4, **link), SEQ, BATCH)  # the all-reduce overlaps the last backward
    assert spare.time["dp"] < busy.time["dp"]
