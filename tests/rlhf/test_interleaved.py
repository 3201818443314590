"""RLHF forward paths under an interleaved pipeline (pp=2 x vpp=2) equal the unpipelined model."""

import torch

from megalite import topology
from megalite.models import GPTModel
from megalite.pipeline import build_chunks
from megalite.rlhf.actor import pipeline_log_probs, sequence_log_probs
from megalite.rlhf.critic import CriticModel, pipeline_values
from megalite.rlhf.generation import SamplingConfig, generate
from megalite.testing import run_distributed
from megalite.topology import device
from tests.rlhf.common import config, padded_prompts

PP, VPP, LAYERS, TEMPERATURE = 2, 2, 4, 0.7
SAMPLINGS = (SamplingConfig(max_new_tokens=5, eos_id=5, greedy=True),
             SamplingConfig(max_new_tokens=5, eos_id=5, temperature=0.8, top_k=20, top_p=0.9))


def _chunks(cls, cfg, pp_group):
    """This rank's two chunks (virtual stages rank and PP + rank), from the one chunk builder."""
    return [chunk.to(device()).eval()
            for chunk in build_chunks(lambda **where: cls(cfg, **where), LAYERS, pp_group, vpp=VPP)]


def _generate(model, sampling):
    ids, mask = (t.to(device()) for t in padded_prompts())
    return generate(model, ids, mask, sampling, torch.Generator(device()).manual_seed(11))


def _rank():
    cfg = config(num_layers=LAYERS)
    ids, mask = (t.to(device()) for t in padded_prompts(b=6))
    # Three micro-batches: not a multiple of pp, which forward-only interleaving accepts.
    micro_batches = [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2]} for i in (0, 2, 4)]
    with torch.no_grad():
        actor, critic = GPTModel(cfg).to(device()).eval(), CriticModel(cfg).to(device()).eval()
        ref_lp, ref_ent = sequence_log_probs(actor, ids, mask, TEMPERATURE, with_entropy=True)
        ref_values = critic(ids, mask)
    ref_generated = [_generate(actor, s) for s in SAMPLINGS]

    pp_group = topology.initialize(pp=PP, vpp=VPP).pp.group
    actor_chunks, critic_chunks = _chunks(GPTModel, cfg, pp_group), _chunks(CriticModel, cfg, pp_group)
    lp, ent = pipeline_log_probs(actor_chunks, micro_batches, TEMPERATURE, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(pipeline_values(critic_chunks, micro_batches), ref_values.cpu(), rtol=0, atol=1e-5)
    for sampling, want in zip(SAMPLINGS, ref_generated):
        got = _generate(actor_chunks, sampling)
        assert torch.equal(got.tokens, want.tokens), (sampling, got.tokens, want.tokens)
        torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)


def test_log_probs_values_and_generation_at_pp2_vpp2_equal_pp1():
    run_distributed(_rank, PP, timeout=180)
