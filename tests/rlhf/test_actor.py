"""Vocab-parallel log-probs/entropy, the padded forward, and pipelined forward-only log-probs."""

import pytest
import torch
import torch.nn.functional as F

from megalite import topology
from megalite.models import GPTModel
from megalite.rlhf.actor import pipeline_log_probs, sequence_log_probs, token_log_probs
from megalite.rlhf.shared_groups import pack_micro_batches, with_packing
from megalite.testing import run_distributed
from megalite.topology import device
from tests.rlhf.common import config, padded_prompts

TEMPERATURE = 0.7


def _full_logits():
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(2, 5, 24, generator=g)
    tokens = torch.randint(0, 24, (2, 5), generator=g)
    weights = torch.randn(2, 2, 5, generator=g)
    return logits, tokens, weights


def _check_vocab_parallel(tp_group, rank, tp):
    logits, tokens, weights = _full_logits()
    full = logits.clone().requires_grad_(True)
    log_softmax = F.log_softmax(full / TEMPERATURE, dim=-1)
    ref_lp = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    (weights[0] * ref_lp + weights[1] * ref_ent).sum().backward()
    shard = logits.chunk(tp, dim=-1)[rank].clone().to(device()).requires_grad_(True)
    lp, ent = token_log_probs(shard, tokens.to(device()), TEMPERATURE, chunk_size=2, with_entropy=True,
                              tp_group=tp_group)
    (weights[0].to(device()) * lp + weights[1].to(device()) * ent).sum().backward()
    torch.testing.assert_close(lp.cpu(), ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.cpu(), ref_ent.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(shard.grad.cpu(), full.grad.chunk(tp, dim=-1)[rank], rtol=0, atol=1e-5)


def _vocab_parallel_rank():
    rank = torch.distributed.get_rank()
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    _check_vocab_parallel(pairs[rank // 2], rank % 2, 2)
    _check_vocab_parallel(torch.distributed.new_group([0, 1, 2, 3]), rank, 4)


def test_log_probs_and_entropy_tp1():
    _check_vocab_parallel(None, 0, 1)


def test_vocab_parallel_log_probs_and_entropy_match_full_vocab_tp2_and_tp4():
    run_distributed(_vocab_parallel_rank, 4, timeout=180)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_attention_mask_matches_model_and_unpadded_rows(kind):
    model = GPTModel(config(kind)).eval()
    ids, mask = padded_prompts()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=torch.ones_like(ids)), model(ids), rtol=0, atol=1e-5)
        padded = model(ids, attention_mask=mask)
        for row in range(ids.shape[0]):
            real = int(mask[row].sum())
            alone = model(ids[row:row + 1, -real:])
            torch.testing.assert_close(padded[row:row + 1, -real:], alone, rtol=0, atol=1e-5)


def test_bad_mask_shape_raises():
    model = GPTModel(config())
    ids, mask = padded_prompts()
    with pytest.raises(ValueError, match=r"\[3, 6\]"):
        model(ids, attention_mask=mask[:, 1:])


def _pipeline_rank():
    ids, mask = (t.to(device()) for t in padded_prompts(b=4))
    references = {}
    for kind in ("gpt2", "llama"):
        with torch.no_grad():
            references[kind] = sequence_log_probs(GPTModel(config(kind)).to(device()).eval(), ids, mask, TEMPERATURE,
                                                  with_entropy=True)
    topo = topology.initialize(pp=2)
    for kind, (ref_lp, ref_ent) in references.items():
        _check_pipeline(topo, config(kind), ids, mask, ref_lp, ref_ent)


def _check_pipeline(topo, cfg, ids, mask, ref_lp, ref_ent):
    first, last = topo.is_first_stage(), topo.is_last_stage()
    chunk = GPTModel(cfg, pre_process=first, post_process=last,
                     layer_range=(0, 1) if first else (1, 2)).to(device()).eval()
    micro_batches = [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2]} for i in (0, 2)]
    lp, ent = pipeline_log_probs(chunk, micro_batches, TEMPERATURE, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.cpu(), rtol=0, atol=1e-5)
    # Two samples of a prompt as one prefix-shared row (megalite.rlhf.shared_groups), packed alike on both stages.
    rows = torch.tensor([0, 0, 2, 2])
    pairs = [{"input_ids": ids[rows[i:i + 2]], "attention_mask": mask[rows[i:i + 2]]} for i in (0, 2)]
    lp, ent = pipeline_log_probs(chunk, with_packing(pairs, pack_micro_batches(pairs, 2, chunk)), TEMPERATURE,
                                 with_entropy=True)
    real = (mask[rows, :-1] * mask[rows, 1:]).cpu()
    torch.testing.assert_close(lp * real, ref_lp.cpu()[rows] * real, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent * real, ref_ent.cpu()[rows] * real, rtol=0, atol=1e-5)


def test_forward_only_pipeline_log_probs_equal_pp1_on_every_stage():
    run_distributed(_pipeline_rank, 2, timeout=180)
