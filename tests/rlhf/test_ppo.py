"""PPO math against hand-written per-element references, and invariance to how a batch is split."""

import math

import pytest
import torch

from megalite import topology
from megalite.rlhf.advantages import compute_gae
from megalite.rlhf.ppo import (PPOConfig, aggregate, global_normalizer, kl_penalty, policy_loss, rollout_is_weights,
                               value_loss, whiten)
from megalite.testing import run_distributed


def _data(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.4 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return logp, old, adv, mask


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_elementwise_reference(estimator):
    logp, ref, _, _ = _data()
    ref[0, 0] = logp[0, 0] + 30.0
    got = kl_penalty(logp, ref, estimator, clamp=5.0)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            d = min(max(float(logp[i, j] - ref[i, j]), -5.0), 5.0)
            want = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]
            assert abs(float(got[i, j]) - min(max(want, -5.0), 5.0)) < 1e-5


def _reference_policy_loss(logp, old, adv, mask, eps_lo, eps_hi, dual, mode, weights=None):
    per_seq, seq_sums, total, count = [], [], 0.0, 0
    for i in range(logp.shape[0]):
        seq_sum, seq_n = 0.0, 0
        for j in range(logp.shape[1]):
            if mask[i, j] == 0:
                continue
            r = math.exp(float(logp[i, j] - old[i, j]))
            a = float(adv[i, j])
            loss = max(-a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi))
            if a < 0:
                loss = min(loss, -a * dual)
            if weights is not None:
                loss *= float(weights[i, j])
            seq_sum, seq_n = seq_sum + loss, seq_n + 1
        per_seq.append(seq_sum / seq_n)
        seq_sums.append(seq_sum)
        total, count = total + seq_sum, count + seq_n
    if mode == "token-mean":
        return total / count
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / len(seq_sums)
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_matches_reference(mode):
    logp, old, adv, mask = _data(1)
    config = PPOConfig(clip_eps=0.2, clip_eps_high=0.28, dual_clip=3.0, loss_aggregation=mode)
    norm = float(mask.sum()) if mode == "token-mean" else float(mask.shape[0])
    loss, metrics = policy_loss(logp, old, adv, mask, config, norm)
    assert abs(float(loss) - _reference_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, mode)) < 1e-5
    assert 0.0 < metrics["clip_fraction"] < 1.0
    rollout = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    weights = rollout_is_weights(old, rollout, mask, cap=1.5)
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            expected = min(math.exp(float(old[i, j] - rollout[i, j])), 1.5) if mask[i, j] else 1.0
            assert abs(float(weights[i, j]) - expected) < 1e-6
    loss, _ = policy_loss(logp, old, adv, mask, config, norm, weights)
    assert abs(float(loss) - _reference_policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, mode, weights)) < 1e-5


def _reference_is_weight(old, rollout, mask, cap, mode, level, i, j):
    """TIS/MIS by the formula, one element at a time (verl's rollout_is_mode / rollout_is_level)."""
    if not mask[i, j]:
        return 1.0
    if level == "token":
        w = math.exp(float(old[i, j]) - float(rollout[i, j]))
    else:
        w = math.exp(sum(float(old[i, k]) - float(rollout[i, k]) for k in range(old.shape[1]) if mask[i, k]))
    if mode == "truncate":
        return min(w, cap)
    return w if 1.0 / cap <= w <= cap else 0.0


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_match_the_formula(mode, level):
    """TIS truncates w = pi_old / pi_behaviour at C; MIS keeps w in [1/C, C] and zeroes the rest; at the sequence
    level w is the product of the response's token ratios.  Both bounds are crossed by some entries."""
    _, old, _, mask = _data(3)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(6))
    cap = 1.3
    weights = rollout_is_weights(old, rollout, mask, cap, mode, level)
    expected = torch.tensor([[_reference_is_weight(old, rollout, mask, cap, mode, level, i, j)
                              for j in range(old.shape[1])] for i in range(old.shape[0])])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)
    kept = weights[mask.bool()]
    if mode == "truncate":
        assert (kept == cap).any() and (kept < 1.0).any()
    else:
        assert (kept == 0).any() and ((kept > 0) & (kept != 1.0)).any()
    huge = rollout_is_weights(old, old - 200.0, mask, cap, mode, level)  # finite whatever the gap
    assert torch.isfinite(huge).all()


def test_value_loss_matches_reference():
    v, old, ret, mask = _data(2)
    config = PPOConfig(value_clip=0.3)
    got = value_loss(v, old, ret, mask, config, float(mask.sum()))
    total = 0.0
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            if mask[i, j]:
                c = float(old[i, j]) + min(max(float(v[i, j] - old[i, j]), -0.3), 0.3)
                total += 0.5 * max((float(v[i, j] - ret[i, j])) ** 2, (c - float(ret[i, j])) ** 2)
    assert abs(float(got) - total / float(mask.sum())) < 1e-5


def test_gae_matches_textbook_recursion_over_masked_tokens():
    rewards, values, _, mask = _data(3)
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    for i in range(rewards.shape[0]):
        idx = [j for j in range(rewards.shape[1]) if mask[i, j]]
        gae, want = 0.0, {}
        for n in reversed(range(len(idx))):
            nxt = float(values[i, idx[n + 1]]) if n + 1 < len(idx) else 0.0
            delta = float(rewards[i, idx[n]]) + gamma * nxt - float(values[i, idx[n]])
            gae = delta + gamma * lam * gae
            want[idx[n]] = gae
        for j in range(rewards.shape[1]):
            a = want.get(j, 0.0)
            assert abs(float(adv[i, j]) - a) < 1e-5
            assert abs(float(ret[i, j]) - (a + float(values[i, j]) if j in want else 0.0)) < 1e-5


def test_bad_config_raises():
    with pytest.raises(ValueError, match="dual_clip"):
        PPOConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="k9"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "token-mean", 0.0)
    with pytest.raises(ValueError, match="seq-mean"):
        PPOConfig(loss_aggregation="seq-mean")
    with pytest.raises(ValueError, match="rollout_is_cap"):
        PPOConfig(rollout_is_cap=0.5)
    with pytest.raises(ValueError, match="rollout_is_mode"):
        PPOConfig(rollout_is_mode="clip")


def _split_rank():
    """Each of 2 DP ranks takes half the batch in 2 micro-batches; the summed loss and grad equal the whole."""
    topology.initialize()
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        _check_split(mode, topology.current().dp)


def _check_split(mode, dp):
    logp, old, adv, mask = _data(4, b=8)
    config = PPOConfig(loss_aggregation=mode)
    whole_logp = logp.clone().requires_grad_(True)
    whole, _ = policy_loss(whole_logp, old, adv, mask, config,
                           float(mask.sum()) if mode == "token-mean" else 8.0)
    whole.backward()
    rows = slice(4 * dp.rank, 4 * dp.rank + 4)
    mine = logp[rows].clone().requires_grad_(True)
    norm = global_normalizer(mask[rows], mode)
    total = 0.0
    for mb in (slice(0, 1), slice(1, 4)):
        loss, _ = policy_loss(mine[mb], old[rows][mb], adv[rows][mb], mask[rows][mb], config, norm)
        loss.backward()
        total += float(loss)
    parts = torch.tensor([total])
    torch.distributed.all_reduce(parts)
    assert abs(float(parts) - float(whole)) < 1e-6
    assert torch.allclose(mine.grad, whole_logp.grad[rows], atol=1e-7, rtol=0)
    whitened = whiten(adv[rows], mask[rows])
    m = mask.bool()
    ref = (adv - adv[m].mean()) / adv[m].std()
    assert torch.allclose(whitened, (ref * mask)[rows], atol=1e-5)


def test_loss_and_whitening_independent_of_micro_batches_and_dp():
    run_distributed(_split_rank, 2, timeout=120)
