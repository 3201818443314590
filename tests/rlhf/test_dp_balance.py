"""Token-balanced batching for RL updates: the partition bounds the ranks' token spread, token-budget micro-batches
keep every real token within their budget, and the balanced assignment's (and the token-budget micro-batches')
loss and gradients equal the unbalanced one's (the same global mean)."""

import random

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.dp_balance import balance_batches, balanced_partitions, token_micro_batches
from megalite.rlhf.objectives import PPOActorObjective
from megalite.rlhf.ppo import PPOConfig
from megalite.rlhf.rollout_batch import Rollout
from megalite.rlhf.trainer_config import parse_args, validate
from megalite.rlhf.trainer_models import build
from megalite.rlhf.update import rl_update
from megalite.testing import run_distributed
from tests.rlhf.common import VOCAB, config


def _spread(lengths, partitions):
    loads = [sum(lengths[i] for i in part) for part in partitions]
    return max(loads) - min(loads), loads


@pytest.mark.parametrize("parts", [2, 4])
def test_partitions_have_equal_rows_and_a_token_spread_below_the_longest_row(parts):
    rng = random.Random(parts)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(parts * rng.randint(1, 8))]
        partitions = balanced_partitions(lengths, parts)
        assert sorted(i for p in partitions for i in p) == list(range(len(lengths)))
        assert all(len(p) == len(lengths) // parts for p in partitions)
        assert _spread(lengths, partitions)[0] <= max(lengths)
    # rank-contiguous rows of very different lengths (what each rank generated): from 36 vs 4 tokens to 20 vs 20
    lengths = [10, 9, 9, 8, 1, 1, 1, 1]
    assert _spread(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]])[1] == [36, 4]
    assert _spread(lengths, balanced_partitions(lengths, 2))[1] == [20, 20]
    with pytest.raises(ValueError, match="5 rows cannot be split into 2 equal parts"):
        balanced_partitions([1] * 5, 2)


def test_token_micro_batches_respect_the_budget_and_keep_every_real_token():
    batch = _rows(1, b=6)
    batch["attention_mask"][3, 5:] = 0
    batch["response_mask"][3, 4:] = 0
    batch["attention_mask"][4, 2:] = 0
    batch["response_mask"][4, 1:] = 0
    batch["advantages"] *= batch["response_mask"]
    micro_batches = token_micro_batches(batch, 25)
    # rows end at columns 12, 11, 10, 5, 2, 10: packed longest first as (12, 11), (10, 10), (5, 2)
    assert [tuple(mb["input_ids"].shape) for mb in micro_batches] == [(2, 12), (2, 10), (2, 5)]
    assert all(mb["input_ids"].numel() <= 25 and mb["old_log_probs"].shape[1] == mb["input_ids"].shape[1] - 1
               for mb in micro_batches)
    for key in ("attention_mask", "response_mask", "advantages"):
        assert float(sum(mb[key].sum() for mb in micro_batches)) == pytest.approx(float(batch[key].sum()), rel=1e-6)
    assert len(token_micro_batches(batch, 1)) == 6  # a row longer than the budget goes alone
    with pytest.raises(ValueError, match="token-budget micro-batches need the batch's attention_mask"):
        token_micro_batches({"input_ids": batch["input_ids"]}, 25)


def _rows(rank: int, b: int = 4, s: int = 12):
    """This rank's rows: rank 0's short, rank 1's long (right-padded), with PPO inputs."""
    g = torch.Generator().manual_seed(10 + rank)
    lengths = [3 + i % 2 for i in range(b)] if rank == 0 else [s - i % 3 for i in range(b)]
    attention = torch.tensor([[1] * n + [0] * (s - n) for n in lengths])
    ids = torch.randint(1, VOCAB, (b, s), generator=g) * attention
    response = attention[:, 1:].float().clone()
    response[:, 0] = 0
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response,
            "old_log_probs": -torch.rand(b, s - 1, generator=g) * response,
            "advantages": torch.randn(b, s - 1, generator=g) * response}


def _grads_and_loss():
    topo = topology.initialize(tp=1, pp=1)
    results = []
    for balance, budget in ((False, None), (True, None), (True, 20)):
        torch.manual_seed(0)
        chunk, optimizer = build(GPTModel, config(max_position_embeddings=16), topo, 1e-3, "cpu")
        backend = TrainingBackend(chunk, optimizer, PPOActorObjective(PPOConfig()), 2, topo, micro_batch_tokens=budget)
        batch = _rows(topo.dp.rank)
        tokens = None
        if balance:
            [batch], tokens = balance_batches([batch], batch["attention_mask"], topo.dp.group)
        loss = backend.forward_backward(batch)["policy_loss"]
        grads = torch.cat([p.main_grad.flatten().clone() for p in chunk.module.parameters()])
        results.append((loss, grads, int(batch["attention_mask"].sum()), tokens))
    return results


def test_balanced_rows_give_the_unbalanced_loss_and_gradients():
    """2 DP ranks, rank 0's rows short and rank 1's long: balancing moves rows so both train about the same
    tokens, and the loss and every gradient equal the unbalanced assignment's, also with micro-batches cut by a
    token budget (a different number of micro-batches per rank)."""
    ranks = run_distributed(_grads_and_loss, 2, timeout=120)
    for (loss, grads, _, _), (b_loss, b_grads, b_tokens, spread), (t_loss, t_grads, _, _) in ranks:
        assert loss == pytest.approx(b_loss, rel=1e-6, abs=1e-7) and loss == pytest.approx(t_loss, rel=1e-6, abs=1e-7)
        torch.testing.assert_close(b_grads, grads, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(t_grads, grads, rtol=1e-5, atol=1e-7)  # token-budget micro-batches
        assert float(grads.abs().max()) > 0
        assert b_tokens in spread and max(spread) - min(spread) <= 12  # at most the longest row apart
    assert ranks[1][0][2] - ranks[0][0][2] > 24  # the unbalanced ranks were far apart


def _update(argv):
    args = parse_args(argv)
    validate(args, 2)
    topo = topology.initialize(tp=1, pp=1)
    rows = _rows(topo.dp.rank)
    rollout = Rollout(rows["input_ids"], rows["attention_mask"], rows["response_mask"], rows["old_log_probs"], 2,
                      rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]) + topo.dp.rank, ref_log_probs=rows["old_log_probs"],
                      metadata={"kept_fraction": 1.0, "generate_s": 0.0, "log_probs_s": 0.0})
    torch.manual_seed(0)
    chunk, optimizer = build(GPTModel, config(max_position_embeddings=16), topo, 1e-3, "cpu")
    actor = TrainingBackend(chunk, optimizer, PPOActorObjective(args.ppo), args.micro_batch_size, topo)
    return rl_update(rollout, args, topo, actor, None, "cpu", 0)


def test_rl_update_balances_on_request_with_the_same_loss():
    argv = ["--tensor-model-parallel-size", "1", "--global-batch-size", "4", "--n-samples-per-prompt", "2",
            "--micro-batch-size", "2", "--advantage-estimator", "grpo", "--ppo-epochs", "1"]
    plain = run_distributed(_update, 2, argv, timeout=120)
    balanced = run_distributed(_update, 2, argv + ["--balance-dp-tokens"], timeout=120)
    for a, b in zip(plain, balanced):
        assert "dp_tokens_max_over_min" not in a and b["dp_tokens_max_over_min"] < 1.2
        assert b["policy_loss"] == pytest.approx(a["policy_loss"], rel=1e-6, abs=1e-7)
        assert b["reward"] == a["reward"] and b["kl"] == pytest.approx(a["kl"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("extra", [["--micro-batch-tokens", "0"],
                                   ["--micro-batch-tokens", "64", "--pipeline-model-parallel-size", "2"]])
def test_micro_batch_tokens_bad_input(extra):
    with pytest.raises(ValueError, match="--micro-batch-tokens .* needs a positive budget and "
                                         "--pipeline-model-parallel-size 1"):
        validate(parse_args(["--tensor-model-parallel-size", "1", "--global-batch-size", "4",
                             "--n-samples-per-prompt", "2", "--micro-batch-size", "2"] + extra), 2)
