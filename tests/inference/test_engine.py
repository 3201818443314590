"""Engine mechanics: bad input, prefix sharing and copy-on-write, LRU eviction, aborts, no leaked blocks."""

import pytest
import torch

from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.block_allocator import BlockAllocator
from megalite.inference.prefix_cache import PrefixCache
from tests.inference.common import VOCAB, logprob_model, tiny_model


def test_bad_input_is_one_clear_error():
    llm = LLM.from_model(tiny_model(max_position_embeddings=32), engine_config=EngineConfig(block_size=4, num_blocks=4))
    ok = SamplingParams(max_tokens=2)
    cases = [
        (lambda: llm.generate([[1] * 31], ok), r"31 tokens \+ max_tokens=2 = 33 exceeds the model's context of 32"),
        (lambda: SamplingParams(n=0), "n must be a positive integer, got 0"),
        (lambda: SamplingParams(temperature=-0.5), r"temperature must be 0 \(greedy\) or a number >= 0.01, got -0.5"),
        (lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (lambda: llm.generate([[1, VOCAB]], ok), rf"\[1, {VOCAB}\], outside the vocabulary \[0, {VOCAB - 1}\]"),
        (lambda: llm.generate([[-1, 2]], ok), r"\[-1, 2\], outside the vocabulary"),
        (lambda: llm.generate([[1] * 20], ok), "KV pool of 4 blocks x 4 tokens cannot hold even one request of 22"),
        (lambda: llm.generate([[]], ok), "non-empty list of token ids"),
        (lambda: LLM.from_model(tiny_model(), engine_config=EngineConfig(num_blocks=0)), "num_blocks must be a posi"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert llm.engine.allocator.num_used() == 0 and not llm.engine.requests


def test_n_samples_and_shared_prefixes_reuse_prompt_blocks():
    """16 prompts x n=8 prefill each prompt once (<= 1/8 + 5% of the unshared prefill), same outputs without cache.

    With the cache, the system prefix's two full blocks are computed once, whether the prompts fill several
    steps or fit in one (then the others wait a step for the first one's blocks instead of recomputing them)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    prompts = [system + torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 8, (16,), generator=g)]
    params = [SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=i) for i in range(16)]
    results = {}
    for caching, budget in ((True, 64), (True, 512), (False, 64)):
        llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=512,
                                                               max_num_batched_tokens=budget,
                                                               enable_prefix_caching=caching))
        results[caching, budget] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        engine = llm.engine
        unshared = 8 * sum(len(p) for p in prompts)
        assert engine.scheduler.prefill_tokens <= (1 / 8 + 0.05) * unshared
        assert engine.allocator.num_used() == 0
        if caching:
            assert engine.scheduler.prefill_tokens == sum(len(p) for p in prompts) - 8 * (len(prompts) - 1)
            assert engine.prefix_cache.hit_rate() > 0
    assert results[True, 64] == results[True, 512] == results[False, 64]
    assert all(len(set(map(tuple, samples))) > 1 for samples in results[True, 64])


def test_lru_eviction_drops_unreferenced_leaves_first():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator, block_size=2)
    a = [allocator.allocate() for _ in range(2)]
    cache.insert([1, 2, 3, 4], a, 2)
    b = [allocator.allocate()]
    cache.insert([5, 6], b, 1)
    for block in a + b:
        allocator.release(block)
    assert allocator.num_used() == 0 and allocator.num_free() == 4
    assert cache.match([5, 6, 7], 1) == b
    allocator.release(b[0])
    fresh = allocator.allocate()
    assert fresh not in a + b
    # The [1, 2] -> [3, 4] path is least recently used: its leaf goes before its parent, then [5, 6].
    assert [allocator.allocate() for _ in range(3)] == [a[1], a[0], b[0]]
    assert allocator.allocate() is None
    assert cache.match([1, 2, 3, 4, 5], 2) == []


def test_abort_and_many_requests_leave_the_pool_as_it_was():
    engine_config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8)
    llm = LLM.from_model(tiny_model(), engine_config=engine_config)
    engine = llm.engine
    request = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(n=3, max_tokens=20))
    for _ in range(4):
        engine.step()
    assert engine.allocator.num_used() > 0
    engine.abort(request.request_id)
    assert engine.allocator.num_used() == 0 and not engine.has_unfinished() and not engine.requests
    for i in range(50):
        engine.add_request([i % VOCAB, 3], SamplingParams(max_tokens=3, stop_token_ids=[5]))
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used() == 0 and not engine.requests
    free = engine.allocator.num_free()
    assert free == engine.allocator.num_blocks


class _Letters:
    """A toy tokenizer: lowercase letters are ids 1..26."""

    def tokenize(self, text):
        return [ord(c) - 96 for c in text]

    def detokenize(self, ids):
        return "".join(chr(96 + i) if 1 <= i <= 26 else "?" for i in ids)


def test_string_prompts_with_a_tokenizer():
    model = tiny_model()
    llm = LLM.from_model(model, tokenizer=_Letters())
    params = SamplingParams(max_tokens=4, temperature=0)
    by_text = llm.generate(["abc", "hello"], params)
    by_ids = LLM.from_model(model).generate([[1, 2, 3], [8, 5, 12, 12, 15]], params)
    assert [o.prompt_token_ids for o in by_text] == [[1, 2, 3], [8, 5, 12, 12, 15]]
    for text, ids in zip(by_text, by_ids):
        assert text.outputs[0].token_ids == ids.outputs[0].token_ids
        assert text.outputs[0].text == _Letters().detokenize(ids.outputs[0].token_ids)
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        LLM.from_model(model).generate("abc", params)


def test_draft_model_equal_to_the_target_gets_every_draft_accepted():
    """With the target as its own draft model, each verify forward emits all k drafts plus one token.

    Also with n=2 samples (forked blocks copied on write), a shared prefix and pools so small that sequences
    are preempted (the drafter must forget them), one with prompts chunked so that their last token comes with
    drafts before the fork (the draft pool must follow the copies): the batched drafter's paged cache follows
    every block move.
    """
    model = tiny_model()
    k = 3
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=64, speculative="draft",
                                                           num_speculative_tokens=k), draft_model=model)
    out = llm.generate([[1, 2, 3], [5, 6, 7, 8, 9]], SamplingParams(max_tokens=1 + 4 * (k + 1), temperature=0))
    stats = llm.engine.stats
    assert stats["target_forwards_decoding"] == 2 * 4
    assert stats["tokens_from_decoding"] == 2 * 4 * (k + 1)
    plain = LLM.from_model(model).generate([[1, 2, 3], [5, 6, 7, 8, 9]], SamplingParams(max_tokens=17,
                                                                                       temperature=0))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10], [12, 13, 14]]
    params = SamplingParams(n=2, max_tokens=14, temperature=0)
    plain = LLM.from_model(model).generate(prompts, params)
    for num_blocks, budget in ((10, 8), (14, 512)):
        llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, num_blocks=num_blocks,
                                                               max_num_batched_tokens=budget, speculative="draft",
                                                               num_speculative_tokens=k), draft_model=model)
        out = llm.generate(prompts, params)
        stats = llm.engine.stats
        assert llm.engine.scheduler.num_preemptions > 0
        assert stats["draft_tokens"] > 0
        assert stats["tokens_from_decoding"] - stats["target_forwards_decoding"] == stats["draft_tokens"]
        assert [[c.token_ids for c in o.outputs] for o in out] == [[c.token_ids for c in o.outputs] for o in plain]


def test_fused_paged_attention_equals_the_gather_path(monkeypatch):
    """The extension's paged-attention kernel (decodes and n-gram verification read the cache in place) gives
    the same tokens and log-probs (fp32, 1e-5) as the gather + batched-matmul path, with forked samples."""
    from megalite import kernels

    if not kernels.fused_enabled():
        pytest.skip("megalite._C is not built")
    model = logprob_model()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 9, 10, 11], [4] * 13]
    params = SamplingParams(n=2, max_tokens=12, temperature=0.7, seed=3, logprobs=0)
    config = EngineConfig(block_size=4, num_blocks=64, speculative="ngram", num_speculative_tokens=3)
    calls = []
    fused_call = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a: calls.append(1) or fused_call(*a))
    fused = LLM.from_model(model, engine_config=config).generate(prompts, params)
    fused_calls = len(calls)
    assert fused_calls
    monkeypatch.setattr(kernels, "paged_attention_fused", lambda *tensors: False)
    gather = LLM.from_model(model, engine_config=config).generate(prompts, params)
    assert len(calls) == fused_calls
    for a, b in zip(fused, gather):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5)


def test_forked_samples_count_against_max_num_seqs():
    """A request is admitted with all the samples it forks into: running sequences never exceed max_num_seqs
    (before, six n=4 requests admitted together forked into 24 with a limit of 8), and outputs are unchanged."""
    model = tiny_model()
    prompts = [[1 + i, 2, 3, 4] for i in range(6)]
    params = [SamplingParams(n=4, max_tokens=5, seed=i) for i in range(6)]
    wide = LLM.from_model(model).generate(prompts, params)
    engine = LLM.from_model(model, engine_config=EngineConfig(max_num_seqs=8)).engine
    requests = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 8
    assert [[c.token_ids for c in r.output().outputs] for r in requests] == [[c.token_ids for c in o.outputs]
                                                                             for o in wide]
    alone = LLM.from_model(model, engine_config=EngineConfig(max_num_seqs=2)).generate([[1, 2]], SamplingParams(n=3))
    assert len(alone[0].outputs) == 3
