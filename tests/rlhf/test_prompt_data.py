"""``--prompt-data``: the RL trainer draws its prompts from a jsonl of ``prompt``/``answer`` records (the shipped
math task's), scores responses against the answers, warms up by SFT on the completions, and evaluates greedily on
the held-out records (before RL too); a bad file or combination is one ValueError from ``validate``, before any
collective."""

import json
import random

import pytest
import torch

from megalite.cli import run_cli

from megalite.rlhf.arithmetic import TOKENIZER
from megalite.rlhf.math_task import math_problems, write_math_task
from megalite.rlhf.prompt_data import PromptData
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.testing import run_distributed

TINY = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "2",
        "--train-iters", "2", "--micro-batch-size", "4", "--pretrain-global-batch-size", "4", "--ppo-epochs", "1",
        "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo",
        "--max-new-tokens", "110", "--held-out-prompts", "3", "--tensorboard-dir", ""]


@pytest.fixture
def task(tmp_path):
    path = tmp_path / "math.jsonl"
    write_math_task(str(path), 12, seed=0)
    return path


def test_split_draw_reward_and_sft_warmup_batch(task):
    pytest.importorskip("math_verify")  # answer_reward checks with it (the verify extra, in the test extra)
    records = math_problems(12, seed=0)
    data = PromptData(str(task), held_out=3)
    assert data.train == records[:9] and data.held_out == records[9:]
    assert data.width == max(len(r["prompt"]) for r in records)  # byte tokens: one per ASCII character
    assert data.eval_prompts(0, 2) == [records[9]["prompt"], records[11]["prompt"]]
    assert data.eval_prompts(1, 2) == [records[10]["prompt"]]
    drawn = data.draw(random.Random(0), 50)
    assert set(drawn) <= {r["prompt"] for r in data.train} and len(set(drawn)) > 1  # never a held-out prompt
    first = records[0]
    assert data.reward(first["prompt"], f"so \\boxed{{{first['answer']}}}") == 1.0
    assert data.reward(first["prompt"], "\\boxed{-1}") == 0.0
    batch = data.warmup_batch(random.Random(1), 3)
    for ids, mask, loss in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        text = TOKENIZER.detokenize(ids[mask.bool()].tolist())
        [record] = [r for r in data.train if text.startswith(r["prompt"])]
        assert text == record["prompt"] + record["completion"]
        predicted = ids[1:][loss.bool()].tolist()  # the loss covers exactly the completion and end-of-document
        assert predicted == TOKENIZER.tokenize(record["completion"]) + [TOKENIZER.eod]


def _run(argv):
    return RLTrainer(parse_args(argv)).train()


@pytest.mark.slow
def test_grpo_on_the_math_task_logs_held_out_accuracy_before_and_during_rl(task, tmp_path):
    pytest.importorskip("math_verify")
    metrics = tmp_path / "metrics.jsonl"
    argv = TINY + ["--prompt-data", str(task), "--eval-interval", "2", "--metrics-file", str(metrics)]
    assert run_distributed(_run, 1, argv, timeout=180, backend="gloo") == [0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in records if "valid_reward" in r]
    assert [r["iteration"] for r in valid] == [0, 2]  # after the SFT warm-up, and after two GRPO updates
    assert all(0.0 <= r["valid_reward"] <= 1.0 and r["valid_response_length"] > 0 for r in valid)
    trained = [r for r in records if "valid_reward" not in r]
    assert [r["iteration"] for r in trained] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["policy_loss"])) and r["response_length"] > 0 for r in trained)


@pytest.mark.parametrize("extra, message", [
    (["--prompt-data", "{dir}/missing.jsonl"], "missing.jsonl"),
    (["--prompt-data", "{dir}/bad.jsonl"], "bad.jsonl:2: the record needs a non-empty string 'answer'"),
    (["--prompt-data", "{task}", "--held-out-prompts", "12"], r"--held-out-prompts 12 must be in \[0, 12\)"),
    (["--prompt-data", "{task}", "--held-out-prompts", "1", "--eval-interval", "1"],
     "at least one held-out prompt per data-parallel rank: --held-out-prompts 1 < 2"),
    (["--prompt-data", "{task}", "--reward-fn", "megalite.rlhf.verifiers:math_reward"], "drop --reward-fn"),
    (["--prompt-data", "{task}", "--use-scoring-server"], "--prompt-data scores with the records' answers"),
    (["--prompt-data", "{dir}/no_completion.jsonl"], "some training records have no string 'completion'"),
    (["--prompt-data", "{task}", "--max-new-tokens", "20"], "more than --max-new-tokens 20"),
])
def test_bad_prompt_data_is_one_error_before_any_collective(task, tmp_path, extra, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    (tmp_path / "no_completion.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)})
                                                          + "\n" for i in range(8)))
    argv = TINY + ["--global-batch-size", "4"] + [a.format(dir=tmp_path, task=task) for a in extra]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        validate(parse_args(argv), 2)
    assert run_cli(lambda: RLTrainer(parse_args(argv), world_size=2).train()) == 2  # the CLI's bad-input exit
    validate(parse_args(TINY + ["--global-batch-size", "4", "--prompt-data", str(tmp_path / "no_completion.jsonl"),
                                "--load", "ckpt"]), 2)  # a loaded actor needs no completions to warm up on
