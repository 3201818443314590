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
from megalite.rlhf import shared_groups
from megalite.rlhf.shared_groups import forward_rows, pack_micro_batches, pack_rows, row_group, with_packing
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


def _read(mask):
    """The columns whose output a log-prob reads: real tokens but each row's last (its output predicts the token
    after the row, so packing leaves that token out)."""
    return mask.bool() & torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1).bool()


def test_group_row_layout():
    """Group 0: the prompt once, each branch from the first response token; group 1: the trunk runs through the
    shared response token 3, and the shortest sample, its only response token left out, has no branch.  Each
    row's last real token is left out, every token shared by a group is packed once, and the two short groups
    share one packed row as documents 0 and 1 (their own positions and branches)."""
    batch = _rollout()
    packed = pack_rows(batch["input_ids"], batch["attention_mask"], GROUP)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 4, 9, 5, 8, 2, 3, 3, 3, 3]]
    assert (packed.document_ids % (1 << 32)).tolist() == [[0] * 8 + [1] * 6]
    branch = (packed.document_ids >> 32).tolist()
    assert branch == [[0, 0, 0, 1, 1, 2, 3, 3, 0, 0, 1, 1, 2, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 0, 1, 2, 3, 2, 3]]
    # Every read token of a row reads the packed position holding the same token.
    flat = packed.tokens.reshape(-1)[packed.index]
    read = _read(batch["attention_mask"])
    assert torch.equal(flat[read], batch["input_ids"][read])
    # Each read packed position once (the trunk's last token serves every row of its group), each column its own.
    assert packed.outputs.tolist() == sorted(set(packed.index.flatten().tolist()))
    assert torch.equal(packed.outputs[packed.rows], packed.index)
    # Rows of one token each: nothing to pack but a row of padding, whose output every column takes.
    single = pack_rows(torch.tensor([[0, 5], [0, 6]]), torch.tensor([[0, 1], [0, 1]]), 2)
    assert single.tokens.tolist() == [[0]] and single.index.tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize("bad", [[1, 0, 1, 1], [0, 0, 0, 0]], ids=["gap", "empty"])
def test_rows_that_are_not_one_run_of_tokens_are_refused(bad):
    """A row whose real tokens have a gap, or that has none, is one clear error naming it."""
    ids = torch.arange(12).view(3, 4)
    mask = torch.tensor([[0, 1, 1, 1], bad, [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="row 1's real tokens must be one contiguous run"):
        pack_rows(ids, mask, GROUP)


def test_a_packing_of_other_rows_is_refused():
    """A packing handed to micro-batches of other rows (another cut of the batch) is a clear error, not a forward
    of the wrong tokens."""
    batch = _rollout()
    model = GPTModel(config("gpt2"))
    halves = [{k: batch[k][i:i + 3] for k in ("input_ids", "attention_mask")} for i in (0, 3)]
    packing = pack_micro_batches(halves, GROUP, model)
    assert [mb["packed"] for mb in with_packing(halves, packing)] == list(packing)
    with pytest.raises(ValueError, match="does not fit micro-batches"):
        with_packing([{k: batch[k] for k in ("input_ids", "attention_mask")}], packing)


def _predicted(batch):
    """Columns predicting a real token from a real token (prompt and response): every log-prob that means
    something."""
    mask = batch["attention_mask"]
    return (mask[:, :-1] * mask[:, 1:]).float()


def _update(model, batch, group):
    """The actor objective's loss, metrics and gradients, and forward-only log-probs, on ``group``-shared rows."""
    objective = PPOActorObjective(PPO, temperature=0.7)
    normalizer = float(batch["response_mask"].sum())
    model.zero_grad()
    [packed] = with_packing([batch], pack_micro_batches([batch], group, model))
    loss, metrics = objective.loss(objective.forward(model, packed), batch, normalizer, model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    halves = [{k: batch[k][i:i + 3] for k in ("input_ids", "attention_mask")} for i in (0, 3)]
    log_probs, _ = pipeline_log_probs(model, with_packing(halves, pack_micro_batches(halves, group, model)), 0.7)
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
    takes position 0 (it counted on past the learned position table before), and every output a log-prob reads
    still equals the unshared rows'."""
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 5, 6, 7, 8, 9], [1, 2, 6, 7, 8, 9, 1]] * 3  # groups of 14 tokens
    ids = torch.zeros(9, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    packed = pack_rows(ids, mask, GROUP)
    assert packed.tokens.shape == (2, 28) and int(packed.position_ids.max()) < ids.shape[1]  # two groups, then one
    assert (packed.position_ids[1, 14:] == 0).all() and (packed.document_ids[1, 14:] == 1).all()  # its padding
    model = GPTModel(config("gpt2", max_position_embeddings=8))
    with torch.no_grad():
        want, out = model(ids, attention_mask=mask), forward_rows(model, ids, mask, packed)
    # the output layer ran on the packed positions the rows read, not on every packed position
    assert out.logits.shape[0] == packed.outputs.numel() < packed.tokens.numel()
    got = out.expand()
    read = _read(mask)
    torch.testing.assert_close(got[read], want[read], rtol=1e-5, atol=1e-5)


def test_models_without_document_attention_run_unshared():
    """Batch-invariant attention takes no documents: its rows are not packed, so its forwards stay on the padded
    rows, bit for bit."""
    batch = _rollout()
    model = GPTModel(config("llama", batch_invariant=True))
    [mb] = with_packing([batch], pack_micro_batches([batch], GROUP, model))
    assert "packed" not in mb and pack_micro_batches([batch], GROUP, GPTModel(config("llama"))) is not None
    with torch.no_grad():
        assert torch.equal(forward_rows(model, mb["input_ids"], mb["attention_mask"], mb.get("packed")),
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


def test_an_iteration_packs_its_rows_once(monkeypatch):
    """Each iteration packs each of its two micro-batches once, though its rows run four forwards with them (the
    reference's, the recomputed old log-probs' and two PPO epochs)."""
    from megalite.rlhf.trainer import RLTrainer
    from megalite.rlhf.trainer_config import parse_args

    calls, pack = [], shared_groups.pack_rows

    def counted(input_ids, *rest, **options):
        calls.append(tuple(input_ids.shape))
        return pack(input_ids, *rest, **options)
    monkeypatch.setattr(shared_groups, "pack_rows", counted)
    argv = ["--tensor-model-parallel-size", "1", "--hidden-size", "32", "--num-layers", "1", "--pretrain-iters", "1",
            "--train-iters", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "2",
            "--pretrain-global-batch-size", "2", "--advantage-estimator", "grpo", "--ppo-epochs", "2",
            "--recompute-old-log-probs", "--tensorboard-dir", ""]
    assert RLTrainer(parse_args(argv)).train() == 0
    assert calls == [(2, calls[0][1])] * 4


def test_distillation_on_shared_rows_equals_unshared():
    """The distillation term reads the student's logits of every column (expanded from the packed forward's
    rows): with a top-k teacher, the loss, its ``distill_kl`` and the gradients equal the unshared rows'."""
    torch.manual_seed(0)
    model = GPTModel(config("gpt2"))
    batch = _rollout()
    g = torch.Generator().manual_seed(5)
    b, s = batch["input_ids"].shape
    batch["teacher_log_probs"] = torch.randn(b, s, 4, generator=g).log_softmax(-1)
    batch["teacher_indices"] = torch.randint(0, 16, (b, s, 4), generator=g)
    objective = PPOActorObjective(PPO, temperature=0.7, distill_coef=0.2)
    results = []
    for group in (None, GROUP):
        model.zero_grad()
        [mb] = with_packing([batch], pack_micro_batches([batch], group, model))
        loss, metrics = objective.loss(objective.forward(model, mb), batch, float(batch["response_mask"].sum()), model)
        loss.backward()
        results.append((loss.detach(), metrics["distill_kl"], {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want_kl, want_grads), (loss, kl, grads) = results
    assert want_kl > 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
