"""Sampling: per-request seeds reproduce; first-token (and speculative) frequencies match the target distribution."""

import pytest
import torch

from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference import noise, sampler
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
    counts = torch.zeros(5, dtype=torch.long)
    for seed in range(2000):
        counts[verify(logits, [1], params, seed, 9)[0]] += 1
    assert chi_square_p(counts, logits[0].double().softmax(-1)) > 1e-3


def test_verify_emits_the_tokens_the_sample_draws_without_drafts():
    """Each position's token is the sample's own draw there: drafts equal to it are accepted, the first that differs
    is replaced by it, so speculation cannot change a seed's tokens (sampled and greedy)."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    seen = set()
    for temperature in (1.0, 0.0):
        params = SamplingParams(temperature=temperature, top_k=5)
        for seed in range(30):
            alone = [verify(logits[i:i + 1], [], params, seed, 20 + i)[0] for i in range(4)]
            for drafts in (alone[:3], alone[:1] + [(alone[1] + 1) % VOCAB, alone[2]], [(alone[0] + 1) % VOCAB] * 3):
                emitted = verify(logits, drafts, params, seed, 20)
                accepted = next((i for i, (d, t) in enumerate(zip(drafts, alone)) if d != t), 3)
                assert emitted == alone[:accepted + 1], (temperature, seed, drafts)
                seen.add(accepted)
    assert seen == {0, 1, 3}


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


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_uniform(seed: int, position: int, j: int) -> float:
    """The documented uniform of ``(seed, position, j)`` (megalite/inference/noise.py), on Python integers with
    unsigned 32-bit arithmetic: the tensor version's signed tricks must give the same values."""
    seed %= 2 ** 64
    keys = [_mix32(_mix32(_mix32((position & 0xFFFFFFFF) ^ c) ^ (seed & 0xFFFFFFFF)) ^ (seed >> 32))
            for c in (noise.KEY1, noise.KEY2)]
    return ((_mix32(_mix32(keys[0] ^ j) ^ keys[1]) >> 9) + 0.5) / 2 ** 23


def test_noise_is_the_documented_counter_based_hash():
    seeds = [0, 1, 2 ** 40 + 7, 2 ** 63 - 1, -5, 2 ** 64 + 3]
    positions = [0, 3, 17, 2 ** 31 + 1, 5, 0]
    got = noise.uniform([noise.as_seed(s) for s in seeds], positions, VOCAB)
    expected = torch.tensor([[_reference_uniform(s, t, j) for j in range(VOCAB)] for s, t in zip(seeds, positions)],
                            dtype=torch.float32)
    assert torch.equal(got, expected)
    assert 0 < float(got.min()) and float(got.max()) < 1
    assert torch.equal(noise.exponential([3], [4], VOCAB), -noise.uniform([3], [4], VOCAB).log())
    # seeds equal mod 2^64 are one seed; another seed or position is another stream
    assert torch.equal(noise.uniform([noise.as_seed(-5)], [2], 8), noise.uniform([2 ** 64 - 5 - 2 ** 64], [2], 8))
    rows = noise.uniform([7, 8, 7, 7], [2, 2, 3, 2], VOCAB)
    assert torch.equal(rows[0], rows[3]) and not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])


def test_draw_is_each_rows_own_noise_whatever_the_batch():
    """A row's token is ``argmax(p / q)`` with its own seed and position's noise: the same in any batch, order or
    chunk, and the same on every call (no generator state advances)."""
    probs = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)).mul(3).softmax(dim=-1)
    seeds, positions = [11, 12, 13, 11, 11, 2 ** 62], [5, 5, 5, 6, 7, 5]
    whole = draw(probs, seeds, positions)
    alone = [int((p / noise.exponential([s], [t], VOCAB)[0]).argmax()) for p, s, t in zip(probs, seeds, positions)]
    assert whole == alone and draw(probs, seeds, positions) == whole
    order = [4, 0, 5, 2, 1, 3]
    assert draw(probs[order], [seeds[i] for i in order], [positions[i] for i in order]) == [whole[i] for i in order]
    assert draw(probs[2:3], seeds[2:3], positions[2:3]) == whole[2:3]
    flat = torch.full((64, VOCAB), 1.0 / VOCAB)  # every token equally likely: each stream picks its own
    assert len(set(draw(flat, [1] * 64, list(range(64))))) > 20 and len(set(draw(flat, list(range(64)), [0] * 64))) > 20


def test_draw_frequencies_follow_p_across_seeds_and_positions():
    """Chi-square of 4000 draws from one fixed distribution (zeros included), over seeds at one position and over
    positions of one seed: the noise is Exp(1), so tokens come with probability ``p`` (seeded: cannot flake)."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01, 0.0, 0.0], dtype=torch.float64)
    n = 4000
    for seeds, positions in ((list(range(n)), [7] * n), ([12345] * n, list(range(n)))):
        tokens = torch.tensor(draw(probs.float().expand(n, -1), seeds, positions))
        counts = torch.bincount(tokens, minlength=len(probs))
        assert counts[-2:].sum() == 0
        assert chi_square_p(counts, probs) > 1e-3
    uniforms = noise.uniform(list(range(n)), [3] * n, 1)[:, 0]  # entry 0 of 4000 seeds in 20 equal bins
    assert chi_square_p(torch.bincount((uniforms * 20).long(), minlength=20), torch.full((20,), 0.05)) > 1e-3


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
    monkeypatch.setattr(sampler, "draw", lambda probs, seeds, positions: sizes.append(len(probs)) or
                        real_draw(probs, seeds, positions))
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
        return choose_batch(logits, rows, params, list(range(7)), [4] * 7)

    whole = choose()
    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 2 * VOCAB)
    assert choose() == whole and None not in whole


def test_a_generation_resumed_at_its_position_continues_the_same_stream():
    """The noise is a function of (seed, position) alone: a request whose prompt is another's prompt plus its first
    tokens, with the same sample seed, samples that one's remaining tokens (a partial rollout continued after a
    weight update needs no saved generator state); a different seed does not."""
    model = tiny_model("gpt2", batch_invariant=True)

    def tokens(prompt, max_tokens, seed):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        return LLM.from_model(model).engine.generate([prompt], params, sample_seeds=[[seed]])[0].outputs[0].token_ids

    whole = tokens([1, 2, 3], 8, 77)
    assert tokens([1, 2, 3] + whole[:3], 5, 77) == whole[3:]
    assert whole[3:] not in [tokens([1, 2, 3] + whole[:3], 5, seed) for seed in (78, 79)]


def test_finite_rows_and_consecutive_row_selection():
    """``finite_rows`` flags exactly the rows with a NaN or an inf (a row near the fp32 limit is finite), as
    ``isfinite(...).all(-1)`` does; ``select_rows`` gives ``logits[rows]``, a view where the rows run consecutively;
    a NaN in a group's probabilities is refused."""
    logits = torch.randn(6, 7)
    logits[1, 3], logits[2, 0], logits[3, 6] = float("inf"), float("-inf"), float("nan")
    logits[4] = torch.finfo(torch.float32).max
    assert sampler.finite_rows(logits) == torch.isfinite(logits).all(dim=-1).tolist() == [True, False, False, False,
                                                                                            True, True]
    for rows in ([2, 3, 4], [0, 2, 3], [5, 4], [1]):
        torch.testing.assert_close(sampler.select_rows(logits, rows), logits[rows], rtol=0, atol=0, equal_nan=True)
    assert sampler.select_rows(logits, [2, 3, 4]).data_ptr() == logits[2].data_ptr()
    with pytest.raises(FloatingPointError, match="not finite"):
        sampler.target_probs(logits[3:4], SamplingParams(temperature=1.0))
