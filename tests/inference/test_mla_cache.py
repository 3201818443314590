"""The engine's MLA latent cache: its size per token, absorbed attention equal to the plain forward, greedy output
at tp=1 and tp=2."""

from __future__ import annotations

import pytest
import torch

from megalite import topology
from megalite.inference import EngineConfig, SamplingParams
from megalite.inference.engine import LLMEngine
from megalite.inference.paged_cache import StepPlan
from megalite.models import GPTModel
from megalite.moe import MoEConfig
from megalite.testing import run_distributed
from tests.inference.common import recompute_greedy
from tests.models.common import config


def _model(**overrides) -> GPTModel:
    """The tiny MLA model of the model tests (q latent 16, kv latent 12, rope 4, YaRN), weights drawn at std 0.3."""
    return GPTModel(config("mla", max_position_embeddings=64, init_method_std=0.3, seed=5, **overrides)).eval()


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_pool_holds_latent_plus_rope_key_per_token_and_layer(dtype, size):
    model = _model(num_layers=3).to(dtype)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=8))
    cfg = model.config
    assert engine.pool.bytes_per_token() == (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * cfg.num_layers * size
    assert not engine.pool.values


def test_absorbed_attention_equals_the_unabsorbed_forward():
    """Logits of every packed row over three steps (a 12-token prefill chunk beside a 3-token prompt, a second
    10-token chunk beside a 2-token extension, then decodes) equal the plain forward's to 1e-5."""
    model = _model()
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=16))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 100, (23,), generator=g).tolist(), torch.randint(0, 100, (6,), generator=g).tolist()
    tables = [[3, 0, 5, 1, 7, 2], [4, 6]]
    with torch.no_grad():
        full = {name: model(torch.tensor([ids]))[0] for name, ids in (("a", a), ("b", b))}
    steps = [((0, 12), (0, 3)), ((12, 10), (3, 2)), ((22, 1), (5, 1))]
    for (start_a, len_a), (start_b, len_b) in steps:
        plan = StepPlan(token_ids=a[start_a:start_a + len_a] + b[start_b:start_b + len_b],
                        positions=list(range(start_a, start_a + len_a)) + list(range(start_b, start_b + len_b)),
                        starts=[start_a, start_b], lengths=[len_a, len_b], block_tables=tables,
                        sample_rows=list(range(len_a + len_b)))
        logits = engine.execute(plan)
        expected = torch.cat([full["a"][start_a:start_a + len_a], full["b"][start_b:start_b + len_b]])
        torch.testing.assert_close(logits, expected[:, :model.config.vocab_size], rtol=1e-5, atol=1e-5)


def test_engine_greedy_equals_the_models_own_greedy_decode():
    model = _model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (1, 5, 11, 17)]
    budgets = [9, 4, 12, 6]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16))
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in budgets])
    assert [o.outputs[0].token_ids for o in outputs] == [recompute_greedy(model, p, n)
                                                           for p, n in zip(prompts, budgets)]
    assert engine.allocator.num_used() == 0


def test_mla_draft_model_and_forked_samples_follow_the_latent_blocks():
    """An MLA model as its own draft model (its own latent pool) gets every draft accepted; n=2 forks share
    prompt blocks and copy them on write in both pools; output equals the recompute decode."""
    model, k = _model(), 3
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [12, 13, 14]]
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64, speculative="draft",
                                           num_speculative_tokens=k), draft_model=model)
    outputs = engine.generate(prompts, SamplingParams(n=2, max_tokens=1 + 3 * (k + 1), temperature=0))
    assert engine.drafter.pool.bytes_per_token() == engine.pool.bytes_per_token()
    assert engine.stats["tokens_from_decoding"] == engine.stats["target_forwards_decoding"] * (k + 1)
    expected = [recompute_greedy(model, p, 1 + 3 * (k + 1)) for p in prompts]
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]


def test_engine_greedy_equals_transformers_deepseek_v3_generate(tmp_path):
    pytest.importorskip("transformers")
    from megalite.checkpoint import load_model
    from megalite.checkpoint.hf import convert_hf_to_megalite
    from tests.checkpoint.test_hf_deepseek import _tiny

    hf = _tiny()
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "megalite"))
    model = load_model(str(tmp_path / "megalite")).eval()
    g = torch.Generator().manual_seed(2)
    prompts, budgets = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 13)], [8, 5]
    expected = []
    for prompt, n in zip(prompts, budgets):
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32))
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in budgets])
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _greedy_with_logprobs(engine, prompts, budgets):
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=0) for n in budgets]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine.generate(prompts, params)]


def _tp2_ranks(prompts, budgets, overrides):
    """On both ranks: the tp=1 engine and the model's own forward, then the same weights at tp=2 (each rank holds the
    full latent pool and half the heads' W_UK/W_UV); returns the largest log-prob gap of tp=2 to either."""
    from megalite.rlhf.actor import sequence_log_probs

    engine_config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    single = _model(**overrides)
    single_engine = LLMEngine(single, engine_config)
    reference = _greedy_with_logprobs(single_engine, prompts, budgets)
    assert [t for t, _ in reference] == [recompute_greedy(single, p, n) for p, n in zip(prompts, budgets)]
    own = []
    for prompt, (tokens, _) in zip(prompts, reference):
        with torch.no_grad():
            log_probs, _ = sequence_log_probs(single, torch.tensor([prompt + tokens]))
        own.append(log_probs[0, len(prompt) - 1:].tolist())
    topology.initialize(tp=2)
    engine = LLMEngine(_model(**overrides), engine_config)
    assert engine.pool.bytes_per_token() == single_engine.pool.bytes_per_token()
    got = _greedy_with_logprobs(engine, prompts, budgets)
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert engine.allocator.num_used() == 0
    return max(abs(a - b) for (_, logprobs), (_, ref), mine in zip(got, reference, own)
               for a, r, m in zip(logprobs, ref, mine) for b in (r, m))


@pytest.mark.slow
def test_mla_engine_at_tp2_equals_tp1_and_the_models_own_decode():
    """A DeepSeek-style model (MLA, a dense first layer, then sigmoid group-limited routing with a shared expert):
    greedy tokens at tp=2 equal the tp=1 engine's and the model's recompute decode over prefill chunks (17- and
    11-token prompts cut at 16 tokens a step, long and short chunks) and decodes, steps of odd token counts
    included; log-probs within 1e-5 of both."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (17, 4, 11)]
    moe = dict(moe=MoEConfig(num_experts=4, ffn_hidden_size=16, topk=2, activation="swiglu", score_function="sigmoid",
                             enable_expert_bias=True, routed_scaling_factor=2.5, num_groups=2, group_topk=1,
                             shared_expert_intermediate_size=16, init_method_std=0.3), moe_layer_freq=[0, 1])
    worst = run_distributed(_tp2_ranks, 2, prompts, [6, 9, 5], moe, timeout=120)
    assert max(worst) <= 1e-5, worst
