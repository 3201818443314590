"""Speculative decoding with the model's own multi-token prediction layers (EngineConfig(speculative="mtp"))."""

from __future__ import annotations

import pytest
import torch

from megalite.inference import EngineConfig, LLM, SamplingParams
from megalite.models import GPTModel
from tests.inference.common import VOCAB, tiny_model


@pytest.fixture(scope="module")
def trained():
    """A tiny model with two MTP depths trained briefly on x -> 3x + 1 (mod VOCAB): its drafts are accepted."""
    model = tiny_model(mtp_num_layers=2, init_method_std=0.05).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        tokens = [torch.randint(0, VOCAB, (8, 1), generator=g)]
        for _ in range(16):
            tokens.append((3 * tokens[-1] + 1) % VOCAB)
        tokens = torch.cat(tokens, 1)
        optimizer.zero_grad()
        model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        optimizer.step()
    return model.eval()


def _reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """The first ``k`` depths' greedy drafts after ``tokens``, every depth recomputed over the whole sequence."""
    n = len(tokens) - 1  # positions with a target hidden state
    with torch.no_grad():
        state = model(torch.tensor([tokens[:-1]]), return_hidden=True).transpose(0, 1)
        ahead, drafts = list(tokens), []
        for depth, layer in enumerate(model.mtp.layers[:k]):
            shifted = torch.tensor([ahead[depth + 1:depth + 1 + n]])
            embedded = model.embedding(shifted, torch.arange(depth + 1, depth + 1 + n)[None])
            state = layer(state, embedded, None if model.rotary is None else model.rotary(torch.arange(n)))
            drafts.append(int(model.output_logits(state[-1:]).argmax()))
            ahead.append(drafts[-1])
    return drafts


@pytest.mark.parametrize("kind", ["random", "trained", "learned-positions"])
@pytest.mark.parametrize("num_blocks, budget", [(64, 512), (8, 8)], ids=["roomy", "chunked-preempted"])
def test_mtp_drafts_equal_full_recompute_and_greedy_output_equals_plain_decoding(num_blocks, budget, kind, request):
    """Each proposal equals the depths run over the whole sequence (the drafter's paged caches and histories
    follow accepted and rejected drafts, chunked prefills, preemption and block copies), and greedy output
    equals decoding without speculation; drafts are rejected (random weights) or mostly accepted (trained)."""
    model = {"random": lambda: tiny_model(mtp_num_layers=2), "trained": lambda: request.getfixturevalue("trained"),
             "learned-positions": lambda: tiny_model("gpt2", mtp_num_layers=2)}[kind]()
    prompts = [[1, 4, 13], [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 12, 13]]
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = LLM.from_model(model).generate(prompts, params)
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=num_blocks,
                                                           max_num_batched_tokens=budget, speculative="mtp",
                                                           num_speculative_tokens=3))
    drafter, checked = llm.engine.drafter, []
    propose = drafter.propose

    def checking(seqs, ks):
        proposals = propose(seqs, ks)
        for seq, k, drafts in zip(seqs, ks, proposals):
            assert len(drafts) <= min(k, 2)
            if drafts:
                assert drafts == _reference_drafts(model, seq.tokens, len(drafts))
                checked.append(len(drafts))
        return proposals

    drafter.propose = checking
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert len(checked) >= 5 and max(checked) == 2
    stats = llm.engine.stats
    assert stats["draft_tokens"] == sum(checked)
    accepted = stats["tokens_from_decoding"] - stats["target_forwards_decoding"]
    assert accepted > stats["draft_tokens"] / 2 if kind == "trained" else accepted < stats["draft_tokens"] / 2, stats
    if budget < 64:
        assert llm.engine.scheduler.num_preemptions > 0


def test_mtp_speculation_needs_mtp_layers():
    with pytest.raises(ValueError, match="needs a model with multi-token prediction layers"):
        LLM.from_model(tiny_model(), engine_config=EngineConfig(speculative="mtp"))


def test_mtp_speculation_of_a_deepseek_style_model():
    """MLA with an MoE prediction depth: the depth caches only its latent, its drafts equal the full recompute,
    and greedy output equals plain decoding."""
    from megalite.moe import MoEConfig
    from tests.models.common import config

    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=16, score_function="sigmoid", enable_expert_bias=True,
                    activation="swiglu")
    model = GPTModel(config("mla", mtp_num_layers=1, init_method_std=0.5, max_position_embeddings=64, moe=moe,
                            moe_layer_freq=[0, 1])).eval()
    assert model.mtp.layers[0].transformer_layer.is_moe
    prompts, params = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=10, temperature=0)
    plain = LLM.from_model(model).generate(prompts, params)
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=64, speculative="mtp",
                                                           num_speculative_tokens=1))
    drafter, checked = llm.engine.drafter, []
    propose = drafter.propose

    def checking(seqs, ks):
        proposals = propose(seqs, ks)
        checked.extend(d == _reference_drafts(model, s.tokens, len(d)) for s, d in zip(seqs, proposals) if d)
        return proposals

    drafter.propose = checking
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert len(checked) >= 5 and all(checked)
    cfg = model.config
    assert drafter.pool.bytes_per_token() == (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * 4
