"""examples/dpo.py through pretrain(): the first step's DPO loss is log 2 (the reference is the starting policy),
tp=2 follows the one-rank run with its on-the-fly reference, and reward accuracy is logged; with --pref-loss kto on
unpaired data the first loss is each weight / 2 and falls, and a paired file or a micro-batch of one is bad input."""

import json
import math

import pytest

from megalite.testing import run_distributed
from tests.data.sft_fixtures import chat_tokenizer
from tests.inference.chat_fixtures import trl_template
from tests.training.helpers import read_metrics

WORDS = ["one", "two", "three", "four", "five", "six"]


def _pairs():
    return [{"prompt": [{"role": "system", "content": "be brief."}, {"role": "user", "content": f"{a}?"}],
             "chosen": f"{a}.", "rejected": f"{b}!"} for a in WORDS for b in WORDS if a != b]


def _unpaired():
    """TRL's unpaired form: echoing the word desirable, another word with "!" not, alternating."""
    def prompt(word):
        return [{"role": "system", "content": "be brief."}, {"role": "user", "content": f"{word}?"}]

    return [record for i, a in enumerate(WORDS)
            for record in ({"prompt": prompt(a), "completion": f"{a}.", "label": True},
                           {"prompt": prompt(WORDS[i - 1]), "completion": f"{a}!", "label": False})]


def _argv(tmp_path, workdir, *extra, records=None):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records or _pairs()) + "\n")
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


@pytest.mark.slow
def test_kto_trains(tmp_path):
    unpaired = _unpaired()
    assert {r["label"] for r in unpaired} == {True, False}
    argv = _argv(tmp_path, tmp_path, "--pref-loss", "kto", "--kto-undesirable-weight", "1.5", "--train-iters", "6",
                 records=unpaired)
    run_distributed(_dpo_on_rank, 1, argv, timeout=240)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    # Step 1: the policy is the reference, so every log-ratio and z0 are 0 and each loss is its weight / 2.
    share = sum(r["label"] for r in unpaired[:4]) / 4
    assert rows[0]["kl"] == 0.0 and rows[0]["rewards_desirable"] == 0.0
    assert rows[0]["loss"] == pytest.approx(0.5 * share + 0.75 * (1 - share), rel=1e-6)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["rewards_desirable"] > rows[-1]["rewards_undesirable"]


def test_kto_bad_input(tmp_path):
    """Checked in prepare_data, before the tokenizer and any collective: run_cli makes these exit 2."""
    from types import SimpleNamespace

    from megalite.rlhf.preference_training import PreferenceTraining

    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(_pairs()[0]) + "\n")
    args = SimpleNamespace(lora_rank=None, offload_reference=False, pref_loss="kto", pref_data=str(data),
                           micro_batch_size=2)
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: a paired record \(chosen and rejected\): --pref-loss kto"):
        PreferenceTraining().prepare_data(args)
    data.write_text(json.dumps(_unpaired()[0]) + "\n")
    args.micro_batch_size = 1
    with pytest.raises(ValueError, match="--pref-loss kto estimates .* use --micro-batch-size 2 or more"):
        PreferenceTraining().prepare_data(args)
    args.pref_loss = "dpo"
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: an unpaired \(KTO\) record: use --pref-loss kto"):
        PreferenceTraining().prepare_data(args)


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
