"""Greedy engine output equals transformers' generate and a full-recompute decode, under every engine variant.

Random-weight GPT-2 and Llama (GQA) models are built with transformers and
converted; 16 prompts of different lengths with different ``max_new_tokens``
run in flight together.  The same tokens must come out with a paged or a
contiguous (one block per sequence) cache, with prefix sharing on or off, with
a KV pool so small that sequences get preempted, and with speculative decoding
(n-gram lookup and a draft model).
"""

import pytest
import torch

from megalite.checkpoint import load_model
from megalite.checkpoint.hf import convert_hf_to_megalite
from megalite.inference import LLM, EngineConfig, SamplingParams
from tests.inference.common import recompute_greedy

transformers = pytest.importorskip("transformers")
VOCAB, CONTEXT = 64, 64


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=CONTEXT, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model.eval()


def _workload():
    """16 prompts, lengths 1..30, with a shared 12-token system prefix on half of them, and their max_new_tokens."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    prompts, budgets = [], []
    for i in range(16):
        length = int(torch.randint(1, 19, (), generator=g))
        tail = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        prompts.append(system + tail if i % 2 else tail)
        budgets.append(int(torch.randint(2, 17, (), generator=g)))
    return prompts, budgets


def _hf_greedy(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


VARIANTS = {
    "paged": EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=40),
    "contiguous": EngineConfig(block_size=CONTEXT, num_blocks=16, max_num_batched_tokens=64,
                               enable_prefix_caching=False),
    "no_prefix_cache": EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False),
    "preempting": EngineConfig(block_size=4, num_blocks=12, max_num_batched_tokens=16),
    "ngram": EngineConfig(block_size=4, num_blocks=256, speculative="ngram", num_speculative_tokens=3),
    "draft": EngineConfig(block_size=8, num_blocks=128, speculative="draft", num_speculative_tokens=2),
}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_matches_transformers_and_recompute_under_every_variant(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    prompts, budgets = _workload()
    expected = [_hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    model = load_model(str(tmp_path / "ckpt"))
    assert expected == [recompute_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    draft = _draft(kind)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in budgets]
    for name, engine_config in VARIANTS.items():
        llm = LLM(str(tmp_path / "ckpt"), engine_config=engine_config, draft_model=draft)
        outputs = llm.generate(prompts, params)
        got = [o.outputs[0].token_ids for o in outputs]
        assert got == expected, name
        assert all(o.outputs[0].finish_reason == "length" for o in outputs), name
        engine = llm.engine
        assert engine.allocator.num_used() == 0 and not engine.requests, name
        if name == "preempting":
            assert engine.scheduler.num_preemptions > 0
        if name == "paged":
            assert engine.prefix_cache.hit_tokens > 0
        if name in ("ngram", "draft"):
            assert engine.stats["tokens_from_decoding"] > engine.stats["target_forwards_decoding"] > 0, name


def _draft(kind):
    """A smaller random megalite GPT with the target's vocabulary, as a draft model."""
    from megalite.models import GPTConfig, GPTModel

    extra = {}
    if kind == "llama":
        extra = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                     add_bias_linear=False, ffn_hidden_size=32)
    return GPTModel(GPTConfig(vocab_size=VOCAB, num_layers=1, hidden_size=16, num_attention_heads=2,
                              max_position_embeddings=CONTEXT, seed=5, **extra)).eval()
