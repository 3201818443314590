"""The prediction ``pretrain_gpt.py`` prints for its own layout is the planner's estimate of that layout."""

from __future__ import annotations

import pytest

from megalite.hardware import load_hardware
from megalite.models import gpt_flops_per_token
from megalite.plan.estimate import estimate
from megalite.plan.layout import Layout
from megalite.plan.predict import predict_run
from megalite.training.arguments import validate_args
from megalite.training.flags import gpt_config, parse_args

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]


def test_prediction_is_the_estimate_of_the_flags_layout_and_measured_mfu_uses_its_peak():
    args = validate_args(parse_args(FLAGS + ["--tensor-model-parallel-size", "2"]), 4)
    prediction = predict_run(args, 4)
    cpu = load_hardware("cpu")
    assert prediction.hardware == cpu and prediction.reason is None
    expected = estimate(gpt_config(args), Layout(tp=2, dp=2, micro_batch_size=2), cpu, 16, 8)
    assert prediction.estimate.memory == expected.memory and prediction.estimate.step_time_s == expected.step_time_s
    assert f"MFU {expected.mfu:.1%}" in prediction.line()
    flops = gpt_flops_per_token(gpt_config(args), 16)
    mfu = 8 * 16 / 0.5 / 4 * flops / cpu.peak("fp32")
    line = prediction.measured_line(0.5, 8 * 16, 3 * 2 ** 30, "allocated")
    assert line.startswith("measured after warm-up (plan): step 0.5 s (")
    assert "memory 3.00 GiB allocated (" in line and f"MFU {mfu:.1%} ({expected.mfu:.1%})" in line


@pytest.mark.parametrize("extra, reason", [
    (["--lora-rank", "4"], "the planner does not model LoRA fine-tuning (frozen base weights)"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--q-lora-rank", "16", "--kv-lora-rank", "8",
      "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"],
     "the planner does not model multi-latent attention"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|tt|L"],
     "the planner does not model a split of given stage layer counts (--pipeline-model-parallel-layout, "
     "--account-for-embedding/loss-in-pipeline-split)"),
    (["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split", "--num-layers", "3"],
     "the planner does not model a split of given stage layer counts (--pipeline-model-parallel-layout, "
     "--account-for-embedding/loss-in-pipeline-split)"),
])
def test_a_run_the_planner_does_not_model_says_so(extra, reason):
    prediction = predict_run(parse_args(FLAGS + extra), 4)
    assert prediction.estimate is None
    assert prediction.line() == f"plan: no prediction for this run: {reason}"
