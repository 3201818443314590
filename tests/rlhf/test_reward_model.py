"""Reward model: Bradley-Terry math against the formula, and a model trained at TP2 by
examples/train_reward_model.py scores held-out pairs the same when loaded at TP1 and drives
the RL trainer's --reward-model (on every rank, and on a scoring server); bad inputs are clear errors."""

import importlib.util
import json
import math
import os

import pytest
import torch

from megalite import topology
from megalite.data.tokenizer import ByteTokenizer
from megalite.rlhf import CriticModel
from megalite.checkpoint import load_sharded
from megalite.checkpoint.reader import CheckpointReader
from megalite.rlhf.reward_model import (RewardModelScorer, bradley_terry_loss, last_token_scores, read_preferences,
                                        write_arithmetic_preferences)
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args
from megalite.testing import run_distributed

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _module(name="train_reward_model"):
    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bradley_terry_and_last_token_scores_match_formulas():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert last_token_scores(values, mask).tolist() == [2.0, 8.0, 12.0]
    chosen, rejected = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    loss, metrics = bradley_terry_loss(chosen, rejected, normalizer=6.0)
    want = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 6.0
    assert abs(float(loss) - want) < 1e-6 and metrics["accuracy"] == pytest.approx(1 / 3)


def _train_tp2(save, metrics):
    argv = ["--tensor-model-parallel-size", "2", "--hidden-size", "32", "--num-layers", "1", "--train-iters", "4",
            "--synthetic-pairs", "64", "--held-out-pairs", "8", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--save", save, "--metrics-file", metrics]
    module = _module()
    assert module.main(argv) == 0
    args = module.parse_args(argv)
    config = CheckpointReader(save).config
    model = CriticModel(config)
    load_sharded(save, [model])
    held_out = read_preferences(os.path.join(save, "preferences.jsonl"))[-8:]
    scores = module.held_out_scores(model, held_out, args, torch.device("cpu"))
    rl = ["--tensor-model-parallel-size", "2", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "1",
          "--train-iters", "1", "--micro-batch-size", "4", "--pretrain-global-batch-size", "4", "--ppo-epochs", "1",
          "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--advantage-estimator", "grpo",
          "--reward-model", save, "--tensorboard-dir", ""]
    assert RLTrainer(parse_args(rl)).train() == 0
    assert RLTrainer(parse_args(rl + ["--use-scoring-server", "--scoring-server-rank", "1"])).train() == 0
    return scores


@pytest.mark.slow
def test_reward_model_trained_at_tp2_scores_the_same_at_tp1(tmp_path):
    save, metrics = str(tmp_path / "rm"), str(tmp_path / "metrics.jsonl")
    scores = run_distributed(_train_tp2, 2, save, metrics, timeout=180)[0]
    records = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in records] == [0, 4] and all(0 <= r["heldout_accuracy"] <= 1 for r in records)
    tokenizer = ByteTokenizer()
    scorer = RewardModelScorer(save, tokenizer.tokenize, tokenizer.eod, tokenizer.vocab_size)
    held_out = read_preferences(os.path.join(save, "preferences.jsonl"))[-8:]
    tp1 = torch.tensor([scorer(p["prompt"], r) for p in held_out for r in (p["chosen"], p["rejected"])])
    torch.testing.assert_close(tp1, scores, rtol=0, atol=1e-5)
    assert not topology.is_initialized()
    with pytest.raises(ValueError, match="vocabulary of 259 tokens, the policy's tokenizer 100"):
        RewardModelScorer(save, tokenizer.tokenize, tokenizer.eod, 100)


def test_preference_file_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    write_arithmetic_preferences(str(path), 3)
    assert len(read_preferences(str(path))) == 3
    path.write_text('{"prompt": "1+1=", "chosen": "2"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: record lacks string field\(s\) \['rejected'\]"):
        read_preferences(str(path))
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="p.jsonl:1: not JSON"):
        read_preferences(str(path))
