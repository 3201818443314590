"""Sampling: per-request seeds reproduce; first-token (and speculative) frequencies match the target distribution."""

import torch

from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference import sampler
from megalite.inference.sampler import choose_batch, draw, verify
from tests.inference.common import VOCAB, chi_square_p, poison_logits, reference_probs, tiny_model

DRAWS = 1200


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


def test_first_token_frequencies_match_filtered_softmax():
    model = tiny_model()
    prompt = [3, 17, 9, 22, 5]
    engine_config = EngineConfig(block_size=4, num_blocks=DRAWS + 16, max_num_batched_tokens=DRAWS)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.3, 6, 1.0), (1.0, 0, 0.8), (0.9, 10, 0.9)]:
        params = SamplingParams(n=DRAWS, max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
        out = LLM.from_model(model, engine_config=engine_config).generate([prompt], params)[0]
        counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=VOCAB)
        probs = reference_probs(_logits(model, prompt), temperature, top_k, top_p)
        assert chi_square_p(counts, probs) > 1e-3, (temperature, top_k, top_p)


def test_speculative_verification_preserves_the_distribution():
    """Joint (t1, t2) frequencies with n-gram drafts equal p(t1) p(t2 | t1) under top-k sampling."""
    model = tiny_model()
    prompt = list(range(VOCAB))
    top_k = 3
    params = SamplingParams(n=DRAWS, max_tokens=3, top_k=top_k, seed=2)
    engine_config = EngineConfig(block_size=8, num_blocks=2 * DRAWS + 32, max_num_batched_tokens=4 * DRAWS,
                                 speculative="ngram", num_speculative_tokens=2)
    llm = LLM.from_model(model, engine_config=engine_config)
    out = llm.generate([prompt], params)[0]
    stats = llm.engine.stats
    assert stats["target_forwards_decoding"] > 0 and stats["tokens_from_decoding"] > stats["target_forwards_decoding"]
    first = reference_probs(_logits(model, prompt), 1.0, top_k, 1.0)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for t1 in first.nonzero().flatten().tolist():
        joint[t1] = first[t1] * reference_probs(_logits(model, prompt + [t1]), 1.0, top_k, 1.0)
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.long)
    for c in out.outputs:
        counts[c.token_ids[0] * VOCAB + c.token_ids[1]] += 1
    assert chi_square_p(counts, joint.flatten()) > 1e-3


def test_verify_accepts_with_target_probability():
    """One draft token against fixed target logits: the emitted first token follows the target exactly."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 0.1, 0.2, -0.5]])
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5, dtype=torch.long)
    for _ in range(2000):
        counts[verify(logits, [1], params, generator)[0]] += 1
    assert chi_square_p(counts, logits[0].double().softmax(-1)) > 1e-3


def test_seeded_requests_reproduce_in_any_batch():
    model = tiny_model("gpt2")
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, top_p=0.95, seed=42)
    alone = LLM.from_model(model).generate([[1, 2, 3]], params)[0]
    others = [SamplingParams(max_tokens=4, seed=s) for s in range(5)]
    mixed = LLM.from_model(model, engine_config=EngineConfig(block_size=2, num_blocks=64, max_num_batched_tokens=5)
                           ).generate([[7, 8]] * 2 + [[1, 2, 3]] + [[9]] * 3, others[:2] + [params] + others[2:])[2]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    other_seed = LLM.from_model(model).generate([[1, 2, 3]], SamplingParams(n=3, max_tokens=6, seed=43))[0]
    assert [c.token_ids for c in other_seed.outputs] != [c.token_ids for c in alone.outputs]


def test_draw_gives_what_multinomial_gives_for_the_same_generator_state():
    probs = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)).mul(3).softmax(dim=-1)
    for seed in range(4):
        batched = [torch.Generator().manual_seed(seed + 10 * i) for i in range(3)]
        alone = [torch.Generator().manual_seed(seed + 10 * i) for i in range(3)]
        for _ in range(3):  # the generators' states advance alike, draw after draw
            expected = [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, alone)]
            assert draw(probs, batched) == expected


def test_mixed_batch_samples_once_and_gives_each_request_its_tokens_alone(monkeypatch):
    """Greedy, seeded temperature/top-k/top-p, penalties and log-probs in one batch: every request gets the tokens
    (and log-probs: batch-invariant numerics make the logits equal) it gets alone, and the plain sampled rows are
    drawn together, not one by one."""
    model = tiny_model("gpt2", batch_invariant=True)
    params = [SamplingParams(max_tokens=5, temperature=0, logprobs=1),
              SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=0),
              SamplingParams(max_tokens=5, temperature=0.8, seed=4, top_k=6, top_p=0.9),
              SamplingParams(max_tokens=5, temperature=0.8, seed=5, repetition_penalty=1.5, presence_penalty=0.5),
              SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=6)]
    prompts = [[1, 2, 3], [4, 5], [6, 7], [1, 1, 2], [3]]
    alone = [LLM.from_model(model).generate([p], s)[0].outputs for p, s in zip(prompts, params)]
    sizes = []
    real_draw = sampler.draw
    monkeypatch.setattr(sampler, "draw", lambda probs, generators: sizes.append(len(probs)) or
                        real_draw(probs, generators))
    mixed = LLM.from_model(model).generate(prompts, params)
    for single, batched in zip(alone, mixed):
        assert [(c.token_ids, c.logprobs, c.top_logprobs) for c in single] == \
               [(c.token_ids, c.logprobs, c.top_logprobs) for c in batched.outputs]
    assert len({tuple(c.token_ids) for c in mixed[4].outputs}) > 1
    assert max(sizes) == 3  # request 1 and both samples of 4 share one draw; 2 (top-k) and 3 (penalties) apart


def test_a_row_that_overflows_in_a_shared_draw_fails_alone(monkeypatch):
    """Finite logits that overflow at the request's temperature make its batch's shared draw non-finite: the rows
    of that draw are sampled one by one, so that request fails and the others get their tokens alone."""
    model = tiny_model("gpt2")
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = [SamplingParams(max_tokens=4, temperature=0.5, seed=i) for i in range(3)]
    expected = [LLM.from_model(model).generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, params)]
    poison_logits(monkeypatch, seed=1, value=3e38)
    engine = LLM.from_model(model).engine
    requests = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    assert "not finite" in requests[1].error and requests[1].finished
    assert [requests[i].output().outputs[0].token_ids for i in (0, 2)] == [expected[0], expected[2]]


def test_chunked_batches_choose_what_one_batch_chooses(monkeypatch):
    """Rows split into cache-sized chunks (here two rows each) draw the tokens one whole batch draws."""
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * 5 + [SamplingParams(temperature=0)] * 2
    rows = [0, 1, 2, 2, 3, 5, 6]

    def choose():
        return choose_batch(logits, rows, params, [torch.Generator().manual_seed(i) for i in range(7)])

    whole = choose()
    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 2 * VOCAB)
    assert choose() == whole and None not in whole
