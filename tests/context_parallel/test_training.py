"""pretrain() with context parallelism matches the single-rank run: losses and grad norms over 8 iterations."""

import pytest

from tests.training.helpers import train

ITERS = 8
CP2 = ["--context-parallel-size", "2"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    return train(tiny_data, tmp_path_factory.mktemp("ref"), 1, iters=ITERS)[1]


def _assert_matches(reference, got):
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    assert reference[-1]["loss"] < 0.95 * reference[0]["loss"], "the reference run did not learn"
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-4), ref["iteration"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["iteration"]


@pytest.mark.parametrize("world,flags", [
    (2, CP2),
    (2, CP2 + ["--cp-comm-type", "all_gather"]),
    (2, CP2 + ["--cp-comm-type", "a2a"]),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p"]),
], ids=["cp2-p2p", "cp2-all_gather", "cp2-a2a", "cp4-p2p"])
def test_context_parallel_matches_one_rank(tiny_data, tmp_path, reference, world, flags):
    _assert_matches(reference, train(tiny_data, tmp_path, world, *flags, iters=ITERS)[1])
