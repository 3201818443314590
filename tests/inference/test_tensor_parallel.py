"""TP2 engine == TP1 engine (greedy and seeded sampling), and engine log-probs == the actor's (fp32, 1e-5)."""

import asyncio

import pytest
import torch

from megalite import topology
from megalite.checkpoint import save_sharded
from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.rlhf.actor import sequence_log_probs
from megalite.testing import run_distributed
from tests.inference.common import VOCAB, logprob_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [31, 4], [5] * 13, [11]]
ENGINE = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=24)


def _run(llm):
    greedy = [SamplingParams(max_tokens=6 + i, temperature=0, logprobs=0) for i in range(len(PROMPTS))]
    sampled = [SamplingParams(max_tokens=5, n=2, temperature=0.8, top_k=12, seed=i, logprobs=0)
               for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS, sampled)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


def _actor_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        log_probs, _ = sequence_log_probs(model, ids, temperature=temperature)
    return log_probs[0, len(prompt) - 1:].tolist()


def _tp_ranks(checkpoint):
    kinds = ("gpt2", "llama")
    references = {kind: _run(LLM.from_model(logprob_model(kind), engine_config=ENGINE)) for kind in kinds}
    topology.initialize(tp=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LLM.from_model(logprob_model()).generate([[VOCAB + 3]], SamplingParams())
    loaded = _run(LLM(checkpoint, tensor_parallel_size=2, engine_config=ENGINE))
    assert [[t for t, _ in r] for r in loaded] == [[t for t, _ in r] for r in references["llama"]]
    worst = max(_compare(logprob_model(kind), references[kind]) for kind in kinds)
    _serve_under_tp(references["llama"])
    return worst


def _serve_under_tp(reference):
    """The HTTP server at tp=2: rank 0 serves (and broadcasts plans), rank 1 runs the worker loop."""
    from tests.inference.test_serve import _with_server

    engine = LLM.from_model(logprob_model("llama"), engine_config=ENGINE).engine
    if engine.tp_rank != 0:
        engine.run_worker()
        return

    async def body(session, url, loop):
        async def one(i):
            request = {"prompt": PROMPTS[i], "max_tokens": 6 + i, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=request) as response:
                return (await response.json())["choices"][0]["token_ids"]
        return await asyncio.gather(*[one(i) for i in range(3)])

    assert asyncio.run(_with_server(engine, body)) == [reference[i][0][0] for i in range(3)]


def _compare(model, reference):
    llm = LLM.from_model(model, engine_config=ENGINE)
    got = _run(llm)
    worst = 0.0
    for i, (ref_request, request) in enumerate(zip(reference, got)):
        temperature = 1.0 if i < len(PROMPTS) else 0.8
        prompt = PROMPTS[i % len(PROMPTS)]
        for (ref_tokens, ref_lp), (tokens, lp) in zip(ref_request, request):
            assert tokens == ref_tokens, (i, tokens, ref_tokens)
            actor = _actor_logprobs(model, prompt, tokens, temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(actor, lp)), max(abs(a - b) for a, b in zip(ref_lp, lp)))
    assert llm.engine.allocator.num_used() == 0
    return worst


def test_tp2_matches_tp1_and_actor_log_probs(tmp_path):
    """GPT-2 and Llama (GQA) live models and a checkpoint loaded at tp=2, one launch; bad input raises on both
    ranks before any collective."""
    save_sharded(str(tmp_path / "ckpt"), 1, [logprob_model("llama")])
    worst = run_distributed(_tp_ranks, 2, str(tmp_path / "ckpt"))
    assert max(worst) <= 1e-5, worst
