"""Batch-invariant mode: the rollout engine's log-probs equal the actor's bit for bit (batch sizes 1, 7, 32; tp=1
and tp=2), the mode computes the same function as the plain forward, and the RL trainer logs a zero gap."""

import json

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.rlhf.actor import invariant_vocab, pipeline_log_probs, token_log_probs
from megalite.rlhf.generation import RolloutEngine, SamplingConfig
from megalite.rlhf.trainer import RLTrainer
from megalite.rlhf.trainer_config import parse_args
from megalite.testing import run_distributed
from tests.rlhf.common import VOCAB, config

WIDTH, NEW, TEMPERATURE = 8, 5, 0.8
SAMPLING = SamplingConfig(max_new_tokens=NEW, temperature=TEMPERATURE)


def _prompts(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` left-padded prompts of 1..WIDTH tokens."""
    g = torch.Generator().manual_seed(b)
    lengths = torch.randint(1, WIDTH + 1, (b,), generator=g)
    mask = (torch.arange(WIDTH)[None] >= WIDTH - lengths[:, None]).long()
    return torch.randint(1, VOCAB, (b, WIDTH), generator=g) * mask, mask


def _gaps(model, sizes=(1, 7, 32)) -> list[tuple[float, float]]:
    """Per batch size: the largest |engine - actor| log-prob over sampled tokens, for the actor's forward-only
    log-probs (micro-batches of 5, another split than the engine's) and its training forward (with grad)."""
    engine, gaps = RolloutEngine(model), []
    for b in sizes:
        ids, mask = _prompts(b)
        out = engine.generate(ids, mask, SAMPLING, torch.Generator().manual_seed(b))
        keep = out.response_mask.bool()
        micro = [{"input_ids": out.tokens[i:i + 5], "attention_mask": out.attention_mask[i:i + 5]}
                 for i in range(0, b, 5)]
        scored, _ = pipeline_log_probs(model, micro, TEMPERATURE)
        model.train()
        logits = model(out.tokens, attention_mask=out.attention_mask)
        trained, _ = token_log_probs(logits[:, :-1], out.tokens[:, 1:], TEMPERATURE, tp_group=model.tp_group,
                                     invariant_vocab=invariant_vocab(model))
        model.eval()
        assert trained.requires_grad and keep.sum() > b
        gaps.append(tuple(float((lp[:, WIDTH - 1:][keep] - out.log_probs[keep]).abs().max())
                          for lp in (scored, trained.detach())))
    return gaps


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen"])
def test_engine_log_probs_equal_actor_bit_for_bit(kind):
    """The plain forward misses by float rounding (the test's power); the batch-invariant one by nothing."""
    torch.manual_seed(0)
    assert _gaps(GPTModel(config(kind, batch_invariant=True))) == [(0.0, 0.0)] * 3
    assert max(max(g) for g in _gaps(GPTModel(config(kind)))) > 0.0


def test_batch_invariant_mode_computes_the_plain_function():
    ids, mask = _prompts(7)
    plain, invariant = (GPTModel(config("llama", batch_invariant=flag)) for flag in (False, True))
    invariant.load_state_dict(plain.state_dict())
    torch.testing.assert_close(invariant(ids, attention_mask=mask), plain(ids, attention_mask=mask),
                               rtol=0, atol=1e-5)


def test_batch_invariant_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="batch_invariant covers dense models"):
        GPTModel(config("llama", batch_invariant=True, window_size=4))
    with pytest.raises(ValueError, match="batch_invariant covers dense models"):
        GPTModel(config("mla", batch_invariant=True))


def _tp_rank(kinds):
    topo = topology.initialize(tp=2)
    torch.manual_seed(0)
    return [_gaps(GPTModel(config(kind, batch_invariant=True), tp_group=topo.tp.group)) for kind in kinds]


@pytest.mark.slow
def test_engine_log_probs_equal_actor_bit_for_bit_at_tp2():
    """The engine's TP workers, the vocabulary gathered for the actor's log-probs, the ordered all-reduce."""
    for gaps in run_distributed(_tp_rank, 2, ["llama"], timeout=180):
        assert gaps == [[(0.0, 0.0)] * 3]


def _train(argvs):
    return [RLTrainer(parse_args(argv)).train() for argv in argvs]


@pytest.mark.slow
def test_trainer_logs_a_zero_gap_in_batch_invariant_mode(tmp_path):
    """--recompute-old-log-probs logs the trainer's old log-probs against the engine's each iteration: exactly 0
    (TIS weights exactly 1) with --batch-invariant, a float-rounding gap without it."""
    base = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "2",
            "--train-iters", "2", "--micro-batch-size", "3", "--global-batch-size", "6", "--pretrain-global-batch-size",
            "6", "--ppo-epochs", "1", "--tensorboard-dir", "", "--recompute-old-log-probs"]
    paths = [tmp_path / "invariant.jsonl", tmp_path / "plain.jsonl"]
    argvs = [base + ["--batch-invariant", "--metrics-file", str(paths[0])], base + ["--metrics-file", str(paths[1])]]
    assert run_distributed(_train, 1, argvs, timeout=180) == [[0, 0]]
    invariant, plain = ([json.loads(line) for line in path.read_text().splitlines()] for path in paths)
    assert [(r["log_prob_gap"], r["log_prob_gap_max"], r["is_weight_mean"]) for r in invariant] == [(0.0, 0.0, 1.0)] * 2
    assert all(0.0 < r["log_prob_gap_max"] < 1e-4 for r in plain)
