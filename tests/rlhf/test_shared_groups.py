"""Prefix-shared GRPO groups (a prompt's samples as one row, the prompt once): the reference log-probs, the
actor's loss, its metrics and every gradient of an update equal the unshared rows' (fp32), on one rank for a
learned-position and a RoPE/GQA model, and at tp=2 against one rank."""

import pytest
import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.rlhf.actor import pipeline_log_probs
from megalite.rlhf.objectives import PPOActorObjective
from megalite.rlhf.ppo import PPOConfig, kl_penalty
from megalite.rlhf.shared_groups import forward_rows, pack_rows, packed_rows, row_group
from megalite.testing import run_distributed
from tests.models.common import full_to_shard
from tests.rlhf.common import config

P, N, GROUP = 5, 3, 3
# Two groups of three samples.  Group 0: the samples' first response tokens differ (the trunk is the prompt but its
# last token); group 1: all three start with 3 and two are equal, so the trunk runs into the responses.
ROWS = [([1, 2, 3], [4, 5, 6]), ([1, 2, 3], [4, 7]), ([1, 2, 3], [9, 5, 6]),
        ([8, 2], [3, 3, 3]), ([8, 2], [3, 3, 3]), ([8, 2], [3])]
PPO = PPOConfig(use_kl_loss=True, kl_coef=0.3, kl_estimator="k3", entropy_coef=0.01, clip_eps=0.1)


def _rollout():
    """A rollout batch: prompts left-padded to P, responses right-padded to N (pad id 0), and the update's inputs."""
    ids = torch.zeros(len(ROWS), P + N, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(ROWS):
        ids[i, P - len(prompt):P + len(response)] = torch.tensor(prompt + response)
        mask[i, P - len(prompt):P + len(response)] = 1
    response_mask = mask[:, 1:].clone().float()
    response_mask[:, :P - 1] = 0
    g = torch.Generator().manual_seed(3)
    shape = (len(ROWS), P + N - 1)
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask,
            "old_log_probs": -torch.rand(shape, generator=g) - 3.0, "advantages": torch.randn(shape, generator=g),
            "ref_log_probs": -torch.rand(shape, generator=g) - 3.0, "is_weights": torch.rand(shape, generator=g) + 0.5}


def test_group_row_layout():
    """Group 0: the prompt's first two tokens once, each branch from the prompt's last token; group 1: the trunk
    runs through the shared response token 3, the shortest sample's branch is its last token alone."""
    batch = _rollout()
    packed = pack_rows(batch["input_ids"], batch["attention_mask"], GROUP)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 3, 4, 7, 3, 9, 5, 6],
                                      [8, 2, 3, 3, 3, 3, 3, 3, 3, 0, 0, 0, 0]]
    branch = (packed.document_ids >> 32).tolist()
    assert branch == [[0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3], [0, 0, 1, 1, 1, 2, 2, 2, 3, 0, 0, 0, 0]]
    assert (packed.document_ids[1, 9:] == 1).all()  # the padding is a document of its own
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4, 2, 3, 4, 5],
                                            [0, 1, 2, 3, 4, 2, 3, 4, 2, 0, 0, 0, 0]]
    # Every real token of a row reads the packed position holding the same token.
    flat = packed.tokens.reshape(-1)[packed.index]
    real = batch["attention_mask"].bool()
    assert torch.equal(flat[real], batch["input_ids"][real])


def test_the_last_packing_is_reused_only_for_the_same_rows():
    """The update's forward reuses the reference's packing of the same rows (one packing an iteration); rows
    changed in place, another group size or another dtype pack anew, each equal to pack_rows'."""
    batch = _rollout()
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    first = packed_rows(ids, mask, GROUP)
    assert packed_rows(ids.clone(), mask.clone(), GROUP) is first
    ids[0, -1] = 9  # in place: the kept copy no longer matches
    changed = packed_rows(ids, mask, GROUP)
    assert changed is not first
    assert torch.equal(changed.tokens, pack_rows(ids, mask, GROUP).tokens)
    two = packed_rows(ids, mask, 2)
    assert two is not changed
    assert packed_rows(ids, mask.bool(), 2) is not two
    for group, packed in ((2, two), (GROUP, packed_rows(ids, mask, GROUP))):
        expected = pack_rows(ids, mask, group)
        for name in ("tokens", "position_ids", "document_ids", "index"):
            assert torch.equal(getattr(packed, name), getattr(expected, name))


def _predicted(batch):
    """Columns predicting a real token from a real token (prompt and response): every log-prob that means
    something."""
    mask = batch["attention_mask"]
    return (mask[:, :-1] * mask[:, 1:]).float()


def _update(model, batch, group):
    """The actor objective's loss, metrics and gradients, and forward-only log-probs, on ``group``-shared rows."""
    objective = PPOActorObjective(PPO, temperature=0.7, group=group)
    normalizer = float(batch["response_mask"].sum())
    model.zero_grad()
    loss, metrics = objective.loss(objective.forward(model, batch), batch, normalizer, model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    log_probs, _ = pipeline_log_probs(model, [{k: batch[k][i:i + 3] for k in ("input_ids", "attention_mask")}
                                              for i in (0, 3)], 0.7, group=group)
    return loss.detach(), metrics, grads, log_probs


@pytest.mark.parametrize("kind,overrides", [("gpt2", {}), ("llama", {}), ("llama", {"window_size": 2})],
                         ids=["gpt2", "llama", "llama-window2"])
def test_shared_groups_equal_unshared(kind, overrides):
    """Loss, KL and entropy terms, clip fraction, every gradient and the per-token log-probs (hence KL and
    importance ratios) of shared rows equal the unshared rows' in fp32; with a sliding window too (it measures
    distance along each sequence, so a branch does not reach across its siblings)."""
    torch.manual_seed(0)
    model = GPTModel(config(kind, **overrides))
    batch = _rollout()
    want = _update(model, batch, None)
    got = _update(model, batch, GROUP)
    mask = batch["response_mask"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert set(got[1]) == set(want[1]) >= {"policy_loss", "kl_loss", "entropy", "clip_fraction"}
    for key, value in want[1].items():
        torch.testing.assert_close(got[1][key], value, rtol=1e-5, atol=1e-5, msg=key)
    for name, grad in want[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-5, msg=name)
    real = _predicted(batch)
    torch.testing.assert_close(got[3] * real, want[3] * real, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl_penalty(got[3], batch["ref_log_probs"], "k3") * mask,
                               kl_penalty(want[3], batch["ref_log_probs"], "k3") * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((got[3] - batch["old_log_probs"]).exp() * mask,
                               (want[3] - batch["old_log_probs"]).exp() * mask, rtol=1e-5, atol=1e-5)


def test_a_packed_row_longer_than_the_position_table():
    """A group of distinct samples packs to more tokens than a row's width; the padding of a shorter packed row
    takes position 0 (it counted on past the learned position table before), and every output still equals the
    unshared rows'."""
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 5, 6, 7, 8, 9], [1, 2, 6, 7, 8, 9, 1]] + [[8, 2, 3]] * 3
    ids = torch.zeros(6, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    packed = pack_rows(ids, mask, GROUP)
    assert packed.tokens.shape[1] > ids.shape[1] and int(packed.position_ids.max()) < ids.shape[1]
    model = GPTModel(config("gpt2", max_position_embeddings=8))
    with torch.no_grad():
        want, got = model(ids, attention_mask=mask), forward_rows(model, ids, mask, GROUP)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_models_without_document_attention_run_unshared():
    """Batch-invariant attention takes no documents: its forwards stay on the padded rows, bit for bit."""
    batch = _rollout()
    model = GPTModel(config("llama", batch_invariant=True))
    with torch.no_grad():
        assert torch.equal(forward_rows(model, batch["input_ids"], batch["attention_mask"], GROUP),
                           model(batch["input_ids"], attention_mask=batch["attention_mask"]))


def test_the_trainer_shares_a_prompts_samples_unless_told_not_to():
    from megalite.rlhf.trainer_config import parse_args

    assert row_group(parse_args(["--n-samples-per-prompt", "4"])) == 4
    assert row_group(parse_args(["--n-samples-per-prompt", "4", "--no-shared-prompt-rows"])) is None


def _tp2_rank(want):
    topo = topology.initialize(tp=2)
    torch.manual_seed(0)
    model = GPTModel(config("llama"), tp_group=topo.tp.group)  # the weights depend on the config's seed alone
    params, full = dict(model.named_parameters()), GPTModel(config("llama"))
    loss, metrics, grads, log_probs = _update(model, _rollout(), GROUP)
    errors = [(loss - want[0]).abs().item()]
    errors += [abs(float(metrics[k]) - float(v)) for k, v in want[1].items()]
    errors += [(grads[n] - full_to_shard(n, g, params[n], full.config, topo.tp.rank, 2)).abs().max().item()
               for n, g in want[2].items()]
    real = _predicted(_rollout())
    errors.append(((log_probs - want[3]) * real).abs().max().item())
    return max(errors)


@pytest.mark.slow
def test_tp2_shared_equals_one_rank_unshared():
    """Shared rows at tp=2 (vocab-parallel log-probs and entropy, heads split over the ranks) against the unshared
    rows on one rank."""
    torch.manual_seed(0)
    want = _update(GPTModel(config("llama")), _rollout(), None)
    for error in run_distributed(_tp2_rank, 2, want, timeout=120):
        assert error < 1e-5, error
