"""DPO, IPO, SimPO (and KTO) on packed rows: loss, rewards and gradients equal the papers' formulas on each
sequence run alone, TRL's DPOTrainer loss on the same log-probs, and tp=2 and pp=2 x cp=2 equal one rank."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology
from megalite.context_parallel import prepare_batch
from megalite.models import GPTModel
from megalite.rlhf.preference import (PreferenceConfig, completion_pair, pack_pair, pair_log_probs,
                                      preference_loss)
from megalite.testing import run_distributed
from tests.models.common import VOCAB, config, full_to_shard

SEQ = 32
PAIRS = [([5, 6, 7], [8, 9, 10, 11], [12, 13]), ([20, 21], [22, 23], [24, 25, 26, 27, 28]),
         ([30, 31, 32, 33, 34], [35], [36, 37, 38])]
CONFIGS = [PreferenceConfig("dpo", beta=0.5), PreferenceConfig("dpo", beta=0.3, label_smoothing=0.2),
           PreferenceConfig("ipo", beta=0.7), PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.4,
                                                                   label_smoothing=0.1)]


def _models(window_size=None):
    """Policy and reference: two seeds of the same tiny Llama-style GPT (optionally with a sliding window)."""
    return tuple(GPTModel(config("llama", max_position_embeddings=SEQ, seed=seed, window_size=window_size))
                 for seed in (0, 1))


def _batch(pairs=PAIRS, pack=pack_pair):
    samples = [pack(*completion_pair(p, c, r), SEQ, pad_id=0) for p, c, r in pairs]
    return [torch.stack(x) for x in zip(*samples)]


def _packed(model, ref_model, cfg, cp_group=None, pairs=PAIRS, pack=pack_pair):
    """megalite: one packed forward per model (this CP rank's tokens), per-sequence sums, the loss."""
    tokens, mask, docs = _batch(pairs, pack)
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    batch = prepare_batch(tokens, cp=cp, cp_rank=0 if cp == 1 else dist.get_rank(cp_group), assistant_mask=mask,
                          documents=docs)

    def sums(m):
        log_probs = -m(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                       document_ids=batch["document_ids"])
        return pair_log_probs(log_probs, batch["loss_mask"], batch["document_ids"], cp_group)

    chosen, rejected, n_chosen, n_rejected = sums(model)
    with torch.no_grad():
        ref_chosen, ref_rejected, _, _ = sums(ref_model)
    return preference_loss(chosen, rejected, ref_chosen, ref_rejected, cfg, n_chosen, n_rejected)


def _sequence_log_probs(model, prompt, completion):
    """Direct: the completion's summed log-prob and length, the sequence run alone (full softmax)."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids)[0, :-1].float()
    log_probs = F.log_softmax(logits[:, :VOCAB], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return log_probs[len(prompt) - 1:].sum(), len(completion)


def _paper_loss(model, ref_model, cfg):
    losses, rewards = [], []
    for prompt, chosen, rejected in PAIRS:
        (pw, nw), (pl, nl) = (_sequence_log_probs(model, prompt, c) for c in (chosen, rejected))
        with torch.no_grad():
            rw, rl = (_sequence_log_probs(ref_model, prompt, c)[0] for c in (chosen, rejected))
        b, eps = cfg.beta, cfg.label_smoothing
        if cfg.loss_type == "dpo":  # eq. 7, plus conservative label smoothing
            u = b * ((pw - rw) - (pl - rl))
            losses.append(-(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u))
            rewards.append((b * (pw - rw), b * (pl - rl)))
        elif cfg.loss_type == "ipo":  # eq. 17 on per-token log-ratios
            h = (pw - rw) / nw - (pl - rl) / nl
            losses.append((h - 1 / (2 * b)) ** 2)
            rewards.append((b * (pw - rw), b * (pl - rl)))
        else:  # SimPO eq. 6
            u = b / nw * pw - b / nl * pl - cfg.simpo_gamma
            losses.append(-(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u))
            rewards.append((b / nw * pw, b / nl * pl))
    return torch.stack(losses), torch.stack([r[0] for r in rewards]), torch.stack([r[1] for r in rewards])


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", CONFIGS, ids=["dpo", "cdpo", "ipo", "simpo"])
def test_packed_pairs_equal_the_papers_formulas(cfg):
    model, ref_model = _models()
    losses, chosen, rejected = _packed(model, ref_model, cfg)
    grads = _grads(model, losses.mean())
    want_losses, want_chosen, want_rejected = _paper_loss(model, ref_model, cfg)
    want_grads = _grads(model, want_losses.mean())
    # Summed log-probs are ~-20, where fp32's resolution is ~2e-6 (blockwise vs plain attention differ at that level).
    torch.testing.assert_close(losses.detach(), want_losses.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chosen, want_chosen.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, want_rejected.detach(), rtol=1e-5, atol=1e-5)
    assert losses.detach().abs().max() > 1e-3 and (chosen - rejected).abs().max() > 1e-3
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dpo", "ipo"])
def test_equals_trl_dpo_loss(loss_type):
    """TRL's DPOTrainer._compute_loss (sigmoid / ipo) on the same per-token log-probs and reference log-probs."""
    trl = pytest.importorskip("trl")
    model, ref_model = _models()
    cfg = PreferenceConfig(loss_type, beta=0.4)
    losses, _, _ = _packed(model, ref_model, cfg)

    # TRL's layout: rows [chosen..., rejected...] of prompt + completion, right-padded, with a completion mask.
    rows = [(p, c) for p, c, _ in PAIRS] + [(p, r) for p, _, r in PAIRS]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    completion = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        completion[i, len(p):len(p) + len(c)] = 1

    def per_token(m):
        out = torch.zeros(len(rows), width - 1)
        for i, (p, c) in enumerate(rows):
            seq = torch.tensor([p + c])
            out[i, :len(p) + len(c) - 1] = F.log_softmax(m(seq)[0, :-1, :VOCAB].float(), -1).gather(
                -1, seq[0, 1:, None])[:, 0]
        return out * completion[:, 1:]

    with torch.no_grad():
        policy, reference = per_token(model), per_token(ref_model).sum(1)
    half = len(PAIRS)
    outputs = SimpleNamespace(log_probs=policy, entropy=torch.zeros_like(policy),
                              mean_logits=torch.zeros_like(policy), is_top1=torch.zeros_like(policy, dtype=torch.bool))
    accelerator = SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    fake = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=accelerator, aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=["sigmoid" if loss_type == "dpo" else "ipo"], loss_weights=[1.0],
                           beta=cfg.beta, label_smoothing=0.0, use_weighting=False,
                           _metrics={"eval": defaultdict(list)}, _total_train_tokens=0)
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long(), "completion_mask": completion,
              "ref_chosen_logps": reference[:half], "ref_rejected_logps": reference[half:]}
    trl_loss = trl.DPOTrainer._compute_loss(fake, lambda **kwargs: outputs, inputs, False)
    assert math.isclose(losses.mean().item(), trl_loss.item(), rel_tol=1e-5)


def _tp_rank_fn(cfg, want_losses, want_grads):
    topo = topology.initialize(tp=2)  # x dp=2 on four ranks: each DP replica checks the same pairs
    model, ref_model = _models()
    gpt_cfg = model.config
    losses, _, _ = _packed(model, ref_model, cfg)
    grads = _grads(model, losses.mean())
    params = dict(model.named_parameters())
    error = max((grads[n] - full_to_shard(n, g, params[n], gpt_cfg, topo.tp.rank, 2)).abs().max().item()
                for n, g in want_grads.items())
    dist.barrier()
    return (losses.detach() - want_losses).abs().max().item(), error


def test_bad_input():
    with pytest.raises(ValueError, match="the chosen completion equals the rejected one"):
        pack_pair(*completion_pair([1, 2], [3, 4], [3, 4]), SEQ, 0)
    with pytest.raises(ValueError, match="a preference pair needs 13 tokens .* more than --seq-length \\+ 1 = 9"):
        pack_pair(*completion_pair([1, 2, 3, 4, 5], [6], [7, 8]), 8, 0)
    with pytest.raises(ValueError, match="loss type .orpo. is not one of dpo, ipo, simpo, kto"):
        PreferenceConfig("orpo")
    with pytest.raises(ValueError, match="dpo needs the reference model's log-probs"):
        preference_loss(torch.zeros(1), torch.zeros(1), None, None, PreferenceConfig())


def _pp_cp_rank_fn(cfg, ref_sums, want_loss, want_grads):
    from megalite.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
    from megalite.pipeline import broadcast_from_last_stage, forward_backward, split_layers
    from megalite.rlhf.preference import preference_forward_step

    topo = topology.initialize(pp=2, cp=2)
    gpt_cfg = config("llama", max_position_embeddings=SEQ, seed=0)
    layers = split_layers(gpt_cfg.num_layers, 2)[topo.pp.rank][0]
    model = DistributedDataParallel(GPTModel(gpt_cfg, pre_process=topo.pp.rank == 0, post_process=topo.pp.rank == 1,
                                             layer_range=layers), DDPConfig(), topo.dp_cp.group)
    tokens, mask, docs = _batch()
    batch = prepare_batch(tokens, cp=2, cp_rank=topo.cp.rank, assistant_mask=mask, documents=docs)
    batch["ref_chosen"], batch["ref_rejected"] = ref_sums
    metrics = forward_backward(preference_forward_step(cfg, topo.cp.group), iter([batch]), model, 1,
                               tensor_shape=(SEQ // 2, len(PAIRS), gpt_cfg.hidden_size),
                               finalize_grads_func=finalize_model_grads)
    loss = broadcast_from_last_stage([m["lm_loss"].item() for m in metrics])[0]
    tied = {"output_layer.weight": "embedding.word_embeddings.weight"}  # the last stage's copy of the embedding
    error = max((p.main_grad - want_grads[tied.get(n, n)]).abs().max().item()
                for n, p in model.module.named_parameters())
    return abs(loss - want_loss), error


def _layouts_rank_fn(tp_case, pp_case):
    return _tp_rank_fn(*tp_case), _pp_cp_rank_fn(*pp_case)


@pytest.mark.slow
def test_tp2_and_pp2_cp2_equal_one_rank():
    """One 4-rank launch: cDPO at tp=2 (packed forward, vocab-parallel log-probs) and DPO through the pipeline
    forward step at pp=2 x cp=2 with the reference log-probs computed once up front, each against one rank."""
    model, ref_model = _models()
    tp_losses, _, _ = _packed(model, ref_model, CONFIGS[1])
    tp_case = (CONFIGS[1], tp_losses.detach(), _grads(model, tp_losses.mean()))
    tokens, mask, docs = _batch()
    batch = prepare_batch(tokens, assistant_mask=mask, documents=docs)
    with torch.no_grad():  # up front: the reference's sums, stored with the pairs
        log_probs = -ref_model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                               document_ids=batch["document_ids"])
        ref_sums = pair_log_probs(log_probs, batch["loss_mask"], batch["document_ids"])[:2]
    losses, _, _ = _packed(model, ref_model, CONFIGS[0])
    pp_case = (CONFIGS[0], ref_sums, losses.mean().item(), _grads(model, losses.mean()))
    for tp_errors, pp_errors in run_distributed(_layouts_rank_fn, 4, tp_case, pp_case, timeout=120):
        assert max(tp_errors) < 1e-5, tp_errors
        assert max(pp_errors) < 1e-6, pp_errors


def test_kto_equals_the_papers_formula():
    """KTO on packed rows (the completion, then a mismatched completion for the KL estimate): loss, rewards, z0 and
    grads against eq. 8 with each sequence run alone."""
    from megalite.rlhf.preference import kto_loss

    model, ref_model = _models()
    beta, weights = 0.6, (1.0, 1.5)
    desirable = torch.tensor([True, False, True])
    mismatched = [(p, PAIRS[(i + 1) % 3][1]) for i, (p, _, _) in enumerate(PAIRS)]
    rows = [pack_pair((p + c, [0] * len(p) + [1] * len(c)), completion_pair(p, [], k)[1], SEQ, 0)
            for (p, c, _), (_, k) in zip(PAIRS, mismatched)]
    tokens, mask, docs = (torch.stack(x) for x in zip(*rows))
    batch = prepare_batch(tokens, assistant_mask=mask, documents=docs)

    def sums(m):
        return pair_log_probs(-m(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                                 document_ids=batch["document_ids"]), batch["loss_mask"], batch["document_ids"])[:2]

    policy, policy_kl = sums(model)
    with torch.no_grad():
        reference, reference_kl = sums(ref_model)
    losses, rewards, z0 = kto_loss(policy, reference, policy_kl, reference_kl, desirable, beta, *weights)
    grads = _grads(model, losses.mean())

    want, want_rewards, kls = [], [], []
    for (p, c, _), (_, k) in zip(PAIRS, mismatched):
        with torch.no_grad():
            kls.append(_sequence_log_probs(model, p, k)[0] - _sequence_log_probs(ref_model, p, k)[0])
    want_z0 = torch.stack(kls).mean().clamp(min=0)
    for i, (p, c, _) in enumerate(PAIRS):
        with torch.no_grad():
            ref = _sequence_log_probs(ref_model, p, c)[0]
        r = _sequence_log_probs(model, p, c)[0] - ref
        value = torch.sigmoid(beta * (r - want_z0)) if desirable[i] else torch.sigmoid(beta * (want_z0 - r))
        weight = weights[0] if desirable[i] else weights[1]
        want.append(weight - weight * value)
        want_rewards.append(beta * r.detach())
    want = torch.stack(want)
    want_grads = _grads(model, want.mean())
    assert want_z0 > 0  # the reference point is not clamped away
    torch.testing.assert_close(z0, want_z0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses.detach(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rewards, torch.stack(want_rewards), rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
