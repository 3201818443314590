"""pretrain() of a tiny MoE GPT under expert-parallel layouts matches the single-rank run.

4 experts, top-2, an MoE MLP in both layers, with aux and z losses on, so the
router-loss scale (1/num_microbatches, which differs between layouts) is part of
the comparison.  tp2ep2 has dp=2 but expert-DP=1: expert gradients must still be
averaged over the two data-parallel replicas (they were once left 2x too large,
which Adam hid except through clipping: a 3e-4 drift by iteration 7).

Routing in this run is not degenerate: with every fix in place the layouts agree
to ~1e-7 over 20 iterations, so no token changes experts because of reduction
order, and 1e-4 is a tolerance that still catches a wrong gradient scale.
"""

import pytest

from tests.training.helpers import train

ITERS = 12
EXPERTS, TOPK, LAYERS, MICRO, SEQ = 4, 2, 2, 2, 16
MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    return train(tiny_data, tmp_path_factory.mktemp("moe_ref"), 1, *MOE, iters=ITERS)[1]


@pytest.mark.parametrize("flags, dp", [
    (["--expert-model-parallel-size", "2"], 4),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 2),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--sequence-parallel"], 2),
], ids=["ep2dp2", "tp2ep2", "tp2ep2-sp"])
def test_moe_layouts_match_one_rank(tiny_data, tmp_path, reference, flags, dp):
    _, got = train(tiny_data, tmp_path, 4, *MOE, *flags, iters=ITERS)
    assert [r["iteration"] for r in got] == list(range(1, ITERS + 1))
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"], "the reference run did not learn"
    for ref, mine in zip(reference, got):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
    for records, ranks in ((reference, 1), (got, dp)):
        _check_moe_stats(records, ranks)


def _check_moe_stats(records, dp):
    """Every logged iteration carries router stats; token counts are one micro-batch per layer and DP rank."""
    for record in records:
        counts = [record[f"moe_tokens_expert_{e}"] for e in range(EXPERTS)]
        assert sum(counts) == LAYERS * dp * MICRO * SEQ * TOPK, record["iteration"]
        assert record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0
        assert record["moe_load_imbalance"] >= 1.0
