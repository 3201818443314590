"""SamplingParams in vLLM's shape: validation, eos / min_tokens / stop ids, penalties and min-p against
transformers' logits processors, top-N and prompt log-probs against the model's forward, best_of, and a
failing request (non-finite logits) failing alone."""

import pytest
import torch

from megalite.data.tokenizer import ByteTokenizer
from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.sampler import adjust_logits, filter_logits
from tests.inference.common import VOCAB, logprob_model, poison_logits, tiny_model

# vLLM's SamplingParams field names for the options megalite supports.
VLLM_FIELDS = {"n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
               "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
               "logprobs", "prompt_logprobs", "include_stop_str_in_output", "logit_bias"}
BYTES = ByteTokenizer()


def byte_model():
    return tiny_model(vocab_size=BYTES.vocab_size, max_position_embeddings=64)


def test_field_names_and_one_clear_error_each():
    import dataclasses

    assert VLLM_FIELDS <= {f.name for f in dataclasses.fields(SamplingParams)}
    cases = [(dict(max_tokens=0), "max_tokens must be a positive integer"),
             (dict(min_tokens=5, max_tokens=4), r"min_tokens must be an integer in \[0, max_tokens=4\]"),
             (dict(temperature=1e-300), r"temperature must be 0 \(greedy\) or a number >= 0.01"),
             (dict(temperature=5e-324), "temperature must be"), (dict(temperature=float("nan")), "temperature"),
             (dict(temperature=10 ** 400), "temperature must be"), (dict(n=2, best_of=1), "best_of must be"),
             (dict(min_p=1.5), r"min_p must be in \[0, 1\]"), (dict(presence_penalty=3), "presence_penalty"),
             (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs="no"), "logprobs must be None or"),
             (dict(logprobs=True), "logprobs must be"), (dict(prompt_logprobs=-1), "prompt_logprobs must be"),
             (dict(stop=[""]), "stop must be a non-empty string"), (dict(stop_token_ids=["a"]), "stop_token_ids"),
             (dict(logit_bias={1: 200}), "logit_bias must be"), (dict(ignore_eos="yes"), "ignore_eos must be")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(top_k=-1).top_k == 0
    llm = LLM.from_model(tiny_model())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["a"]))
    with pytest.raises(ValueError, match="logit_bias names token ids outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={VOCAB: 1.0}))


def test_eos_min_tokens_ignore_eos_and_stop_ids():
    llm = LLM.from_model(byte_model(), tokenizer=BYTES)
    eos = {BYTES.eod: 100.0}
    out = llm.generate(["hi"], SamplingParams(max_tokens=6, logit_bias=eos, temperature=0))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.text, out.stop_reason) == ([BYTES.eod], "stop", "", None)
    out = llm.generate(["hi"], SamplingParams(max_tokens=6, logit_bias=eos, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == [BYTES.eod] * 6
    out = llm.generate(["hi"], SamplingParams(max_tokens=6, min_tokens=3, logit_bias=eos, seed=0))[0].outputs[0]
    assert out.token_ids[3:] == [BYTES.eod] and BYTES.eod not in out.token_ids[:3] and out.finish_reason == "stop"
    out = llm.generate(["hi"], SamplingParams(max_tokens=6, stop_token_ids=[70], logit_bias={70: 100.0}))[0]
    assert (out.outputs[0].token_ids, out.outputs[0].stop_reason, out.outputs[0].text) == ([70], 70, "F")


def test_stop_strings_through_the_engine_match_the_text():
    llm = LLM.from_model(byte_model(), tokenizer=BYTES)
    plain = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = plain.text[3:5]
    assert len(stop) == 2
    cut = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    c = cut.outputs[0]
    assert c.text == plain.text[:plain.text.index(stop)] and c.stop_reason == stop and c.finish_reason == "stop"
    assert c.token_ids == plain.token_ids[:len(c.token_ids)]
    kept = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == c.text + stop


def test_penalties_and_min_p_match_transformers_processors():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    histories = [[1, 2, 2, 5], [1, 2, 7, 7, 7], [1, 2]]
    params = SamplingParams(repetition_penalty=1.3)
    ours = adjust_logits(logits, histories, 2, params, frozenset())
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    for i, history in enumerate(histories):
        theirs = processor(torch.tensor([history]), logits[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], theirs, rtol=0, atol=0)
    ours = filter_logits(logits, min_p=0.1)
    theirs = transformers.MinPLogitsWarper(0.1)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    # OpenAI's frequency / presence penalties count the output only (the history after 2 prompt tokens).
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={3: 2.0})
    ours = adjust_logits(logits, histories, 2, params, frozenset())
    expected = logits.clone()
    expected[:, 3] += 2.0
    for i, history in enumerate(histories):
        for token in set(history[2:]):
            expected[i, token] -= 0.5 * history[2:].count(token) + 0.25
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_penalised_greedy_is_the_same_with_speculative_drafts():
    """Drafts are judged with the penalties of the history before each of them."""
    model = tiny_model()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]
    params = SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.5, frequency_penalty=0.3)
    plain = LLM.from_model(model).generate(prompts, params)
    llm = LLM.from_model(model, engine_config=EngineConfig(speculative="ngram", num_speculative_tokens=3))
    drafted = llm.generate(prompts, params)
    assert llm.engine.stats["draft_tokens"] > 0
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    unpenalised = LLM.from_model(model).generate(prompts, SamplingParams(max_tokens=14, temperature=0))
    assert [o.outputs[0].token_ids for o in unpenalised] != [o.outputs[0].token_ids for o in plain]


def test_top_n_and_prompt_logprobs_equal_the_forward():
    model = logprob_model()
    prompt = [3, 17, 9, 22, 5, 8, 30, 2, 11, 4]
    llm = LLM.from_model(model, engine_config=EngineConfig(block_size=4, max_num_batched_tokens=4))
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=3, prompt_logprobs=2))[0]
    c = out.outputs[0]
    with torch.no_grad():
        full = model(torch.tensor([prompt + c.token_ids]))[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]] - full[i - 1, prompt[i]].item()) < 1e-5
        for token, value in entry.items():
            assert abs(value - full[i - 1, token].item()) < 1e-5
        assert set(full[i - 1].topk(2).indices.tolist()) <= set(entry)
    for j, token in enumerate(c.token_ids):
        row = full[len(prompt) - 1 + j]
        assert abs(c.logprobs[j] - row[token].item()) < 1e-5
        assert set(row.topk(3).indices.tolist()) <= set(c.top_logprobs[j]) and len(c.top_logprobs[j]) <= 4


def test_best_of_returns_the_most_likely_samples():
    model = tiny_model()
    every = LLM.from_model(model).generate([[1, 2, 3]], SamplingParams(n=4, max_tokens=5, seed=7, logprobs=0))[0]
    best = LLM.from_model(model).generate([[1, 2, 3]], SamplingParams(n=2, best_of=4, max_tokens=5, seed=7))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]


def test_a_request_with_non_finite_logits_fails_alone(monkeypatch):
    """NaN logits for one request's rows: that request fails, the others in the same steps finish as before."""
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    params = [SamplingParams(max_tokens=4, seed=i) for i in range(3)]
    expected = LLM.from_model(model).generate([prompts[0], prompts[2]], [params[0], params[2]])
    poison_logits(monkeypatch, seed=1)
    engine = LLM.from_model(model).engine
    requests = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    assert "not finite" in requests[1].error and requests[1].finished
    assert [r.output().outputs[0].token_ids for r in (requests[0], requests[2])] == \
        [o.outputs[0].token_ids for o in expected]
    assert engine.allocator.num_used() == 0 and not engine.requests
    with pytest.raises(RuntimeError, match="request 1 failed: sampling failed: .*not finite"):
        LLM.from_model(model).generate(prompts, params)
