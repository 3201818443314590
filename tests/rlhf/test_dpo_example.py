"""examples/dpo.py through pretrain(): the first step's DPO loss is log 2 (the reference is the starting policy),
tp=2 follows the one-rank run with its on-the-fly reference, and reward accuracy is logged."""

import json
import math

import pytest

from megalite.testing import run_distributed
from tests.data.sft_fixtures import chat_tokenizer
from tests.inference.chat_fixtures import trl_template
from tests.training.helpers import read_metrics

WORDS = ["one", "two", "three", "four", "five", "six"]


def _argv(tmp_path, workdir, *extra):
    lines = [json.dumps({"prompt": [{"role": "system", "content": "be brief."},
                                    {"role": "user", "content": f"{a}?"}],
                         "chosen": f"{a}.", "rejected": f"{b}!"})
             for a in WORDS for b in WORDS if a != b]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    tokenizer = chat_tokenizer(tmp_path, "qwen2_5", trl_template("qwen2_5_training")).path
    return ["--pref-data", str(data), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
            "--split", "100,0,0", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0", "--train-iters", "3",
            "--log-interval", "1", "--eval-interval", "0", "--make-vocab-size-divisible-by", "8", "--beta", "0.5",
            "--metrics-file", str(workdir / "metrics.jsonl"), *extra]


def _dpo_on_rank(argv):
    from examples.dpo import main

    main(argv)


@pytest.mark.slow
def test_tp2_follows_one_rank(tmp_path):
    runs = {}
    for name, world, extra in (("one", 1, ()), ("tp2", 2, ("--tensor-model-parallel-size", "2"))):
        workdir = tmp_path / name
        workdir.mkdir()
        run_distributed(_dpo_on_rank, world, _argv(tmp_path, workdir, *extra), timeout=240)
        runs[name] = [r for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]
    one, tp2 = runs["one"], runs["tp2"]
    assert [r["iteration"] for r in one] == [1, 2, 3]
    assert one[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and one[0]["reward_margin"] == 0.0
    assert one[-1]["loss"] < one[0]["loss"] and one[-1]["reward_accuracy"] > 0.5
    for ref, mine in zip(one, tp2, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
        assert mine["reward_margin"] == pytest.approx(ref["reward_margin"], rel=1e-4, abs=1e-6)


def test_bad_pairs(tmp_path):
    from megalite.rlhf.preference_training import read_pairs

    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "hi", "chosen": "hello.", "rejected": "go away."}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "rejected": "hello."}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:3: the chosen completion equals the rejected one"):
        read_pairs(str(path))
    path.write_text(json.dumps({"prompt": "hi", "chosen": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: needs 'prompt', 'chosen' and 'rejected'"):
        read_pairs(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: not JSON"):
        read_pairs(str(path))
    with pytest.raises(ValueError, match="--pref-data: .*No such file"):
        read_pairs(str(tmp_path / "missing.jsonl"))
    path.write_text(json.dumps(good) + "\n")
    assert read_pairs(str(path)) == [([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}],
                                      [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "go away."}])]
