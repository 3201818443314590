"""Advantage estimators, DAPO's reward pieces and token rewards against hand-written textbook formulas,
with masked tokens and groups, and their independence of the DP split."""

import math

import pytest
import torch

from megalite import topology
from megalite.rlhf.advantages import AdvantageConfig, compute_advantages
from megalite.rlhf.rewards import load_reward_fn, overlong_penalty, token_rewards, varied_groups
from megalite.testing import run_distributed


def _data(seed=0, b=8, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mask[1, 2:] = 0
    scores = torch.randint(0, 3, (b,), generator=g).float()
    log_probs = -torch.rand(b, t, generator=g) * 2
    ref = log_probs + 0.3 * torch.randn(b, t, generator=g)
    values = torch.randn(b, t, generator=g)
    return scores, mask, log_probs, ref, values


def _masked(row_mask):
    return [j for j in range(len(row_mask)) if row_mask[j]]


def _textbook_rewards(scores, mask, log_probs, ref, kl_coef):
    """r_t = -kl_coef * k1(t) on response tokens, plus the score on the last one."""
    rewards = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    for i in range(mask.shape[0]):
        idx = _masked(mask[i])
        for j in idx:
            rewards[i][j] = -kl_coef * float(log_probs[i, j] - ref[i, j])
        rewards[i][idx[-1]] += float(scores[i])
    return rewards


def _whiten(table, mask):
    flat = [table[i][j] for i in range(mask.shape[0]) for j in _masked(mask[i])]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(table[i][j] - mean) / std if mask[i, j] else 0.0 for j in range(mask.shape[1])]
            for i in range(mask.shape[0])]


def textbook(estimator, rewards, mask, values, n, gamma, lam, norm_by_std=True):
    """Per-token advantages as nested lists, written from the papers' definitions."""
    b, t = mask.shape
    if estimator in ("grpo", "rloo"):
        totals = [sum(rewards[i]) for i in range(b)]
        out = []
        for i in range(b):
            group = totals[i // n * n:i // n * n + n]
            mean = sum(group) / n
            if estimator == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
                a = (totals[i] - mean) / (std + 1e-6) if norm_by_std else totals[i] - mean
            else:
                a = totals[i] - (sum(group) - totals[i]) / (n - 1)
            out.append([a if mask[i, j] else 0.0 for j in range(t)])
        return out
    out = [[0.0] * t for _ in range(b)]
    for i in range(b):
        idx = _masked(mask[i])
        running = 0.0
        for k in reversed(range(len(idx))):
            j = idx[k]
            if estimator == "reinforce_plus_plus":
                running = rewards[i][j] + gamma * running
            else:
                nxt = float(values[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
                running = rewards[i][j] + gamma * nxt - float(values[i, j]) + gamma * lam * running
            out[i][j] = running
    return _whiten(out, mask)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus"])
def test_estimators_match_textbook(estimator):
    scores, mask, log_probs, ref, values = _data()
    config = AdvantageConfig(estimator, group_size=4, gamma=0.9, lam=0.8)
    rewards, kl = token_rewards(scores, mask, log_probs, ref, kl_coef=0.1, kl_estimator="k1")
    want_rewards = _textbook_rewards(scores, mask, log_probs, ref, 0.1)
    torch.testing.assert_close(rewards, torch.tensor(want_rewards), rtol=0, atol=1e-6)
    torch.testing.assert_close(kl, (log_probs - ref) * mask, rtol=0, atol=1e-6)
    adv, returns = compute_advantages(config, rewards, mask, values if estimator == "gae" else None)
    want = textbook(estimator, want_rewards, mask, values, 4, 0.9, 0.8)
    torch.testing.assert_close(adv, torch.tensor(want), rtol=0, atol=1e-5)
    assert (returns is None) == (estimator != "gae")


def test_grpo_without_std_and_equal_groups():
    scores, mask, *_ = _data(1)
    scores[:4] = 1.0
    rewards, _ = token_rewards(scores, mask)
    adv, _ = compute_advantages(AdvantageConfig("grpo", group_size=4, norm_by_std=False), rewards, mask)
    want = textbook("grpo", rewards.tolist(), mask, None, 4, 1.0, 1.0, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor(want), rtol=0, atol=1e-6)
    assert torch.equal(adv[:4], torch.zeros(4, mask.shape[1]))
    assert varied_groups(scores, 4).tolist() == [False, bool(len(set(scores[4:].tolist())) > 1)]
    assert varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2).tolist() == [False, True, False]


def test_overlong_penalty_is_dapo_piecewise():
    lengths = torch.arange(0, 14)
    got = overlong_penalty(lengths, max_length=10, buffer=4, factor=0.5)
    for length, value in zip(lengths.tolist(), got.tolist()):
        want = 0.0 if length <= 6 else (-0.5 * (length - 6) / 4 if length <= 10 else -0.5)
        assert abs(value - want) < 1e-6


def test_bad_estimator_inputs_raise():
    with pytest.raises(ValueError, match="'ppo2'"):
        AdvantageConfig("ppo2")
    for estimator in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=f"{estimator}.*at least 2 samples per prompt, got 1"):
            AdvantageConfig(estimator, group_size=1)
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages(AdvantageConfig("grpo", group_size=3), torch.zeros(4, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("no_colon")
    with pytest.raises(ValueError, match="cannot import reward module 'no_such_module_xyz'"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_reward_fn("math:nope")
    assert load_reward_fn("math:hypot")(3.0, 4.0) == 5.0
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.zeros(1), 4, 8)


def _dp_rank():
    """Two DP ranks each hold 4 rows (whole groups of 2): per-rank advantages equal the whole batch's."""
    topology.initialize()
    dp = topology.current().dp
    scores, mask, log_probs, ref, values = _data(2)
    rows = slice(4 * dp.rank, 4 * dp.rank + 4)
    for estimator in ("gae", "grpo", "rloo", "reinforce_plus_plus"):
        config = AdvantageConfig(estimator, group_size=2, gamma=0.95, lam=0.9)
        rewards, _ = token_rewards(scores[rows], mask[rows], log_probs[rows], ref[rows], 0.05, "k1")
        adv, _ = compute_advantages(config, rewards, mask[rows], values[rows])
        whole = _textbook_rewards(scores, mask, log_probs, ref, 0.05)
        want = torch.tensor(textbook(estimator, whole, mask, values, 2, 0.95, 0.9))[rows]
        torch.testing.assert_close(adv, want, rtol=0, atol=1e-5, msg=estimator)


def test_estimators_independent_of_dp():
    run_distributed(_dp_rank, 2, timeout=120)
