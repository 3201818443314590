"""pretrain() under TP x DP (and TP x PP) layouts matches the single-rank run iteration by iteration."""

import os

import pytest

from tests.training.helpers import train


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    return train(tiny_data, tmp_path_factory.mktemp("ref"), 1)[1]


@pytest.mark.parametrize("flags", [
    [],
    ["--sequence-parallel"],
    ["--use-distributed-optimizer"],
    ["--pipeline-model-parallel-size", "2", "--sequence-parallel", "--timeline-dir", "timeline"],
], ids=["tp2dp2", "tp2dp2-sp", "tp2dp2-distopt", "tp2pp2-sp"])
def test_four_rank_layouts_match_one_rank(tiny_data, tmp_path, reference, flags):
    flags = [str(tmp_path / f) if f == "timeline" else f for f in flags]
    _, got = train(tiny_data, tmp_path, 4, "--tensor-model-parallel-size", "2", *flags)
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"], "the reference run did not learn"
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["lr"] == ref["lr"]
    if "--timeline-dir" in flags:
        _check_timelines(tmp_path / "timeline")


def _check_timelines(directory):
    """One timeline per rank; each pipeline stage ran 4 forwards and 4 backwards per iteration."""
    from megalite.pipeline import PipelineRecorder

    files = sorted(os.listdir(directory))
    assert files == [f"rank_{r:05d}.json" for r in range(4)]
    for rank, name in enumerate(files):
        recorder = PipelineRecorder.load(directory / name)
        kinds = [kind for kind, _, _ in recorder.order()]
        assert recorder.stage == rank // 2
        assert kinds.count("F") == kinds.count("B") == 20 * 4


def test_pipeline_with_distributed_optimizer_matches_one_rank(tiny_data, tmp_path, reference):
    """pp=2 x dp=2 with ZeRO-1: the tied embedding's shards must line up across the two stages."""
    _, got = train(tiny_data, tmp_path, 4, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer")
    assert [r["iteration"] for r in got] == list(range(1, 21))
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["iteration"]


def test_zero_bubble_schedules_with_distributed_optimizer_match_one_rank(tiny_data, tmp_path):
    """--pipeline-schedule zero-bubble-h1 and zbv (two chunks per rank in a V, so an untied output layer)
    x dp=2 x ZeRO-1: weight gradients arrive in deferred W passes, after the bucket hooks of the B passes."""
    untied = ["--untie-embeddings-and-output-weights", "--num-layers", "4"]
    reference = train(tiny_data, tmp_path / "ref", 1, *untied, iters=8)[1]
    for schedule in ("zero-bubble-h1", "zbv"):
        _, got = train(tiny_data, tmp_path / schedule, 4, *untied, "--pipeline-model-parallel-size", "2",
                       "--pipeline-schedule", schedule, "--use-distributed-optimizer", iters=8)
        assert [r["iteration"] for r in got] == list(range(1, 9))
        for ref, mine in zip(reference, got):
            assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), (schedule, ref["iteration"])
            assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (schedule, ref["iteration"])
