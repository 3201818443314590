"""pretrain() under TP x DP layouts matches the single-rank run iteration by iteration."""

import pytest

from tests.training.helpers import train


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    return train(tiny_data, tmp_path_factory.mktemp("ref"), 1)[1]


@pytest.mark.parametrize("flags", [
    [],
    ["--sequence-parallel"],
    ["--use-distributed-optimizer"],
], ids=["tp2dp2", "tp2dp2-sp", "tp2dp2-distopt"])
def test_tp2_dp2_matches_one_rank(tiny_data, tmp_path, reference, flags):
    _, got = train(tiny_data, tmp_path, 4, "--tensor-model-parallel-size", "2", *flags)
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"], "the reference run did not learn"
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["lr"] == ref["lr"]
