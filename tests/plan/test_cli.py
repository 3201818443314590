"""``python -m megalite.plan``: the ranked plan, its JSON shape, the as-given launch line, and bad input."""

from __future__ import annotations

import json
import os

import pytest

from megalite.cli import run_cli
from megalite.hardware import load_hardware
from megalite.models import gpt_flops_per_token
from megalite.plan.__main__ import main, preset_config
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout
from megalite.plan.memory import rank_chunks, rank_state_bytes

SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--vocab-size", "1000",
         "--seq-length", "512", "--global-batch-size", "32"]


def test_json_lists_ranked_layouts_in_the_issue_shape(capsys):
    assert main(SMALL + ["--num-gpus", "8", "--bf16", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 3
    speeds = [entry["tokens_per_s_per_gpu"] for entry in out["layouts"]]
    assert speeds == sorted(speeds, reverse=True)
    for entry in out["layouts"]:
        assert {"tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "recompute", "schedule", "memory",
                "step_time_s", "tokens_per_s_per_gpu", "mfu", "flags"} <= set(entry)
        assert {"weights", "grads", "optimizer", "activations"} <= set(entry["memory"])
        assert entry["tp"] * entry["pp"] * entry["cp"] * entry["dp"] == 8
        assert 0 < entry["mfu"] < 1
    assert out["as_given"]["tp"] == 1 and out["as_given"]["dp"] == 8
    assert any("not divisible" in item["reason"] for item in out["infeasible"])


def test_mfu_is_the_trainers_model_flops_formula():
    config = preset_config("llama3-8b")
    hw = load_hardware("h100")
    layout = Layout(tp=2, dp=4, precision="bf16", sequence_parallel=True, zero1=True)
    est = estimate(config, layout, hw, 8192, 64)
    expected = est.tokens_per_s_per_gpu * gpt_flops_per_token(config, 8192) / hw.peak("bf16")
    assert est.mfu == pytest.approx(expected, rel=1e-12)
    assert est.memory["weights"] == rank_state_bytes(config, layout).weights


def test_preset_llama3_8b_has_its_published_parameter_count():
    config = preset_config("llama3-8b")
    params = sum(p.numel for specs in rank_chunks(config, Layout(), 0) for p in specs)
    assert params == 8_030_261_248


@pytest.mark.parametrize("argv, message", [
    (SMALL + ["--num-gpus", "8", "--hardware", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
    (["--model", "llama3-405b", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size", "16"],
     "smallest shortfall: does not fit by"),
    (SMALL + ["--num-gpus", "6", "--tensor-model-parallel-size", "4"], "--num-gpus 6 is not divisible by tp*pp*cp"),
    (["--model", "llama3-9b", "--num-gpus", "8", "--global-batch-size", "8"], "unknown --model 'llama3-9b'"),
    (SMALL[:-2] + ["--num-gpus", "8"], "give --global-batch-size"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, message, capsys):
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_hugging_face_config_json_is_the_same_model_as_the_preset(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                  rope_theta=500000.0, tie_word_embeddings=False)
    path = tmp_path / "config.json"
    path.write_text(hf.to_json_string())
    from megalite.checkpoint.hf import hf_config_to_gpt

    config = hf_config_to_gpt(json.loads(path.read_text()))
    layout = Layout(tp=2, pp=2, dp=2, zero1=True, precision="bf16")
    for rank in (0, 1):
        assert (rank_state_bytes(config, layout, rank) == rank_state_bytes(preset_config("llama3-8b"), layout, rank))
    assert main(["--hf-config", str(path), "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size", "64",
                 "--json", "--top", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["tokens_per_s_per_gpu"] > 0


@pytest.mark.slow
def test_calibrate_writes_a_profile_the_planner_loads(tmp_path, capsys, monkeypatch):
    from megalite.plan import calibrate

    # the fewest rounds the collectives' statistic takes, and small buffers: this checks the profile, not its
    # precision
    monkeypatch.setattr(calibrate, "BUSY_ROUNDS", calibrate.BUSY_GROUPS)
    monkeypatch.setattr(calibrate, "COLLECTIVE_ELEMENTS", {1 << 10: 1, 1 << 12: 1, 1 << 14: 1})
    path = tmp_path / "here.json"
    assert main(["--calibrate", str(path)]) == 0
    hw = load_hardware(str(path))
    assert hw.peak("fp32") > 0 and hw.intra_node_bandwidth > 0 and hw.efficiency == 1.0
    assert hw.attention_efficiency > 0 and hw.op_overhead_s > 0 and hw.hbm_bandwidth > 0 and hw.exp_rate > 0
    assert hw.attention_score_s >= 0
    assert set(hw.collective_cpu) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert set(hw.collective_wait) == set(hw.collective_cpu)
    sizes = [0] + [4 * e for e in sorted(calibrate.COLLECTIVE_ELEMENTS)]
    for table in (*hw.collective_cpu.values(), *hw.collective_wait.values()):  # by bytes, never cheaper for more
        assert [nbytes for nbytes, _ in table] == sizes
        assert all(0 <= a[1] <= b[1] for a, b in zip(table, table[1:]))
    assert all(table[0][1] > 0 for table in hw.collective_cpu.values())
    assert hw.collective_wait_per_compute >= 0 and hw.collective_cpu_per_compute >= 0
    assert hw.collective_cpu_compute_s > 0
    assert hw.cores == hw.gpus_per_node == os.cpu_count()
    assert main(SMALL + ["--num-gpus", "2", "--hardware", str(path), "--json", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["layouts"][0]["step_time_s"] > 0


def test_median_of_means_pays_the_skewed_tail_and_ignores_a_burst():
    """Most collective calls wait little and a third wait a scheduler slice: the step pays their mean, which the
    median of the calls misses; a burst of load in one group must not move it as it moves a plain mean."""
    from megalite.plan.calibrate import median_of_means

    calls = [2e-3 if i % 3 == 0 else 0.0 for i in range(60)]  # mean 0.67 ms, median 0
    calls[7] = 0.1  # one call preempted for 100 ms
    assert median_of_means(calls, 5) == pytest.approx(2e-3 / 3)
    assert median_of_means([1.0, 2.0, 3.0, 4.0], 1) == 2.5
    with pytest.raises(ValueError, match="groups"):
        median_of_means([1.0, 2.0], 3)


def test_busy_costs_take_the_mean_wait_not_the_typical_block(monkeypatch):
    """A step pays the mean wait of its collectives: where one block in three waits 3 ms a call and the others do
    not, the call costs 1 ms of waiting (the median block pair, as ``--calibrate`` took before, priced it at
    nothing); calls after 3 ms more compute waiting 0.6 ms more grow 0.2 s per s of compute, so the wait at no
    compute is 0.8 ms.  Their CPU, 0.5 ms a call after 1 ms of compute and 0.8 ms after 4, grows 0.1 s per s of
    compute up to 4 ms, 0.4 ms at none; the buffers' CPU is each size's (a point below the one before it is noise,
    and raised to it), taken at no compute alike.  On a virtual clock: what each call and compute costs is exact."""
    import itertools
    import types

    import torch.distributed as dist

    from megalite.plan import calibrate

    clock = types.SimpleNamespace(wall=0.0, cpu=0.0)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock.wall,
                                                                 process_time=lambda: clock.cpu))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    calls = 2

    def waits_one_block_in_three(cpu: float, more: float = 0.0):
        count = itertools.count()  # the warm-up block is block 0, the rounds' blocks 1, 2, ...

        def op():
            clock.cpu += cpu
            clock.wall += cpu + more + (3e-3 if next(count) // calls % 3 == 1 else 0.0)
        return op

    def computes(seconds):
        def compute():
            clock.wall += seconds
            clock.cpu += seconds
        return compute

    short, long = computes(1e-3), computes(4e-3)
    kinds = {("alone", 0): (short, None, calls), ("alone", 1): (long, None, calls)}
    kinds |= {("op", 0): (short, waits_one_block_in_three(0.5e-3), calls),
              ("op", 1): (long, waits_one_block_in_three(0.8e-3, more=0.6e-3), calls)}
    buffers = dict(zip(sorted(calibrate.COLLECTIVE_ELEMENTS), (1.0e-3, 0.9e-3, 3e-3)))
    kinds |= {("op", "buffer", e): (short, waits_one_block_in_three(cpu), calls) for e, cpu in buffers.items()}
    costs, slope, cpu_slope, cpu_compute = calibrate._busy_costs(calibrate._busy_rounds(kinds, 15), ["op"],
                                                                 {"op": 1})
    cpu, wait = costs["op"]
    assert slope == pytest.approx(0.2) and cpu_slope == pytest.approx(0.1) and cpu_compute == pytest.approx(4e-3)
    sizes = [0] + [4 * e for e in sorted(calibrate.COLLECTIVE_ELEMENTS)]
    assert [nbytes for nbytes, _ in cpu] == [nbytes for nbytes, _ in wait] == sizes
    assert [c for _, c in cpu] == pytest.approx([0.4e-3, 0.9e-3, 0.9e-3, 2.9e-3])
    assert [w for _, w in wait] == pytest.approx([0.8e-3] * 4)
