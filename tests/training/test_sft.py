"""examples/sft.py's providers through pretrain(): tp=2 x cp=2 with sequence parallelism follows the one-rank
run iteration by iteration, the held-out split's loss is logged, and bad data fails before training."""

import json

import pytest

from megalite.testing import run_distributed
from tests.data.sft_fixtures import chat_tokenizer
from tests.inference.chat_fixtures import trl_template
from tests.training.helpers import read_metrics

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _data(tmp_path):
    """40 short conversations (some multi-turn) as jsonl, and a tokenizer directory with Qwen's training template."""
    lines = []
    for i in range(40):
        a, b = WORDS[i % 9], WORDS[(i * 4) % 9]
        system = {"role": "system", "content": "be brief."}
        messages = [system, {"role": "user", "content": f"{a} and {b}?"}, {"role": "assistant", "content": f"{b} {a}."}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": f"{a}."}]
        record = {"messages": messages}
        if i % 5 == 0:
            record = {"prompt": [system, {"role": "user", "content": f"{a}?"}], "completion": f"{a}!"}
        lines.append(json.dumps(record))
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tokenizer = chat_tokenizer(tmp_path, "qwen2_5", trl_template("qwen2_5_training"))
    return str(path), tokenizer.path


def _argv(data, tokenizer, workdir, *extra):
    return ["--sft-data", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
            "--split", "80,20,0", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "5e-3", "--train-iters", "4", "--eval-interval", "2",
            "--eval-iters", "1", "--log-interval", "1", "--make-vocab-size-divisible-by", "8",
            "--metrics-file", str(workdir / "metrics.jsonl"), *extra]


def _sft_on_rank(argv):
    from examples.sft import main

    main(argv)


@pytest.mark.slow
def test_tp2_cp2_follows_one_rank_and_evaluates(tmp_path):
    data, tokenizer = _data(tmp_path)
    runs = {}
    for name, world, extra in (("one", 1, ()), ("tp2cp2", 4, ("--tensor-model-parallel-size", "2",
                                                              "--context-parallel-size", "2", "--sequence-parallel"))):
        workdir = tmp_path / name
        workdir.mkdir()
        results = run_distributed(_sft_on_rank, world, _argv(data, tokenizer, workdir, *extra), timeout=240)
        assert results == [None] * world
        runs[name] = read_metrics(workdir / "metrics.jsonl")
    train = {name: [r for r in records if "loss" in r] for name, records in runs.items()}
    assert [r["iteration"] for r in train["one"]] == list(range(1, 5))
    assert train["one"][-1]["loss"] < train["one"][0]["loss"]
    for ref, mine in zip(train["one"], train["tp2cp2"], strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), ref["iteration"]
    evals = {name: [r for r in records if "valid_loss" in r] for name, records in runs.items()}
    assert [r["iteration"] for r in evals["one"]] == [2, 4]
    for ref, mine in zip(evals["one"], evals["tp2cp2"], strict=True):
        assert mine["valid_loss"] == pytest.approx(ref["valid_loss"], rel=1e-4)


def test_bad_data_fails_before_training(tmp_path):
    """Checked by prepare_sft_data on every rank before any collective (run_cli turns it into exit status 2)."""
    from megalite.training.flags import parse_args
    from megalite.training.sft import add_sft_flags, prepare_sft_data

    data, tokenizer = _data(tmp_path)
    args = parse_args(_argv(data, tokenizer, tmp_path), add_sft_flags)
    prepare_sft_data(args)
    assert args.vocab_size == 52
    with open(data, "a") as handle:
        handle.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:41: the conversation has no assistant turn"):
        prepare_sft_data(args)
    args.tokenizer_type = "GPT2BPETokenizer"
    with pytest.raises(ValueError, match="SFT renders chat templates: use --tokenizer-type HuggingFaceTokenizer"):
        prepare_sft_data(args)
