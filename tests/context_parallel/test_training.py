"""pretrain() with context parallelism matches the single-rank run: losses and grad norms over 8 iterations."""

import pytest

from tests.context_parallel.conftest import BYTE_EOD
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
    (2, CP2 + ["--cp-comm-type", "all_gather", "--recompute-granularity", "selective"]),
    (2, CP2 + ["--cp-comm-type", "a2a"]),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p"]),
    (4, CP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (4, CP2 + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full"]),
    (4, CP2 + ["--use-distributed-optimizer"]),
], ids=["cp2-p2p", "cp2-all_gather-recompute", "cp2-a2a", "cp4-p2p", "tp2cp2-sp", "cp2pp2-recompute", "cp2dp2-zero1"])
def test_context_parallel_matches_one_rank(tiny_data, tmp_path, reference, world, flags):
    _assert_matches(reference, train(tiny_data, tmp_path, world, *flags, iters=ITERS)[1])


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


def test_context_parallel_moe_matches_one_rank(tiny_data, tmp_path):
    """cp2 x ep2 (dp2, expert-DP 2) with router aux and z losses on: their statistics are summed over CP."""
    reference = train(tiny_data, tmp_path / "ref", 1, *MOE, iters=ITERS)[1]
    got = train(tiny_data, tmp_path / "cp", 4, *MOE, *CP2, "--expert-model-parallel-size", "2", iters=ITERS)[1]
    _assert_matches(reference, got)
    for record in got:
        # One whole micro-batch (both CP halves) per layer and DP rank: 2 layers x dp 2 x (2 x 16 tokens) x top-2.
        assert sum(record[f"moe_tokens_expert_{e}"] for e in range(4)) == 2 * 2 * 2 * 16 * 2, record["iteration"]


def test_checkpoint_saved_at_cp2_loads_at_cp1(tiny_data, tmp_path, reference):
    """cp shards no weights: a cp2 run with ZeRO-1 (optimizer sharded over dp x cp) resumes at cp1 exactly."""
    save = str(tmp_path / "ckpt")
    stopped_at, first = train(tiny_data, tmp_path / "first", 2, *CP2, "--use-distributed-optimizer", "--save", save,
                              iters=ITERS, sigterm_in_iteration=ITERS // 2)
    assert stopped_at == ITERS // 2
    _, second = train(tiny_data, tmp_path / "second", 1, "--load", save, iters=ITERS)
    assert [r["iteration"] for r in first + second] == list(range(1, ITERS + 1))
    for ref, mine in zip(reference, first + second):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-4), ref["iteration"]
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), ref["iteration"]
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12), ref["iteration"]


PACKED = ["--vocab-size", str(BYTE_EOD + 1), "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
          "--position-embedding-type", "rope"]


def test_packed_sequences_at_cp2_match_cp1(packed_data, tmp_path):
    """Packed samples (reset positions, document masks, no loss on eod) train identically at cp1 and cp2.

    Each CP rank holds a different number of loss tokens, so this also checks the loss normalization.
    """
    reference = train(packed_data, tmp_path / "ref", 1, *PACKED, iters=ITERS)[1]
    got = train(packed_data, tmp_path / "cp2", 2, *PACKED, *CP2, iters=ITERS)[1]
    _assert_matches(reference, got)


def test_context_parallel_with_interleaved_pipeline_matches_one_rank(tiny_data, tmp_path):
    """cp2 x pp2 with two virtual chunks per stage (4 layers, so every virtual stage holds one)."""
    layers = ["--num-layers", "4"]
    reference = train(tiny_data, tmp_path / "ref", 1, *layers, iters=ITERS)[1]
    got = train(tiny_data, tmp_path / "cp", 4, *layers, *CP2, "--pipeline-model-parallel-size", "2",
                "--virtual-pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a", iters=ITERS)[1]
    _assert_matches(reference, got)
