"""examples/rlhf_ppo.py runs end to end (tiny and short) on TP2 and writes one metrics record and TensorBoard
scalar per iteration."""

import importlib.util
import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.testing import run_distributed

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "rlhf_ppo.py")


def _run(argv):
    spec = importlib.util.spec_from_file_location("rlhf_ppo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_example_runs_and_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["--tp", "2", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "3", "--ppo-iters", "2",
            "--rollout-batch-size", "8", "--micro-batch-size", "4", "--pretrain-batch-size", "8", "--ppo-epochs", "1",
            "--use-centralized-critic", "--critic-prefetch-depth", "1", "--metrics-file", str(metrics),
            "--tensorboard-dir", str(tmp_path / "tb")]
    assert run_distributed(_run, 2, argv, timeout=180) == [0, 0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert {"reward", "kl", "policy_loss"} <= set(record) and 0.0 <= record["reward"] <= 1.0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/reward")]
    assert logged == [(r["iteration"], pytest.approx(r["reward"])) for r in records]
