"""KV-cache generation against uncached decoding, the actor's log-probs, and tp=2 / pp=2 against tp=1."""

import pytest
import torch

from megalite import topology
from megalite.inference.sampler import filter_logits
from megalite.models import GPTModel
from megalite.rlhf.actor import sequence_log_probs
from megalite.rlhf.generation import SamplingConfig, generate
from megalite.testing import run_distributed
from megalite.topology import device
from tests.rlhf.common import config, padded_prompts

GREEDY = SamplingConfig(max_new_tokens=6, eos_id=5, greedy=True)
SAMPLED = SamplingConfig(max_new_tokens=6, eos_id=5, temperature=0.8, top_k=20, top_p=0.9)


def _generate(model, sampling, use_cache=True, seed=11):
    ids, mask = (t.to(device()) for t in padded_prompts())
    return generate(model, ids, mask, sampling, torch.Generator(device()).manual_seed(seed), use_cache=use_cache)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_kv_cache_greedy_equals_uncached_and_log_probs_match_actor(kind):
    model = GPTModel(config(kind))
    cached, uncached = _generate(model, GREEDY), _generate(model, GREEDY, use_cache=False)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert cached.tokens.shape[1] > 6
    torch.testing.assert_close(cached.log_probs, uncached.log_probs, rtol=0, atol=1e-5)
    out = _generate(model, SAMPLED)
    n = out.log_probs.shape[1]
    with torch.no_grad():
        actor, _ = sequence_log_probs(model, out.tokens, out.attention_mask, SAMPLED.temperature)
    torch.testing.assert_close(actor[:, -n:] * out.response_mask, out.log_probs, rtol=0, atol=1e-5)


def _naive_greedy(model, ids, mask, max_new_tokens, eos_id):
    """Row by row, the unpadded prompt rerun in full each step: argmax token and its log-prob."""
    rows = []
    with torch.no_grad():
        for row in range(ids.shape[0]):
            seq, picked = ids[row, -int(mask[row].sum()):][None], []
            for _ in range(max_new_tokens):
                log_probs = torch.log_softmax(model(seq)[0, -1, :config().vocab_size].float(), dim=-1)
                token = int(log_probs.argmax())
                picked.append((token, float(log_probs[token])))
                seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
                if token == eos_id:
                    break
            rows.append(picked)
    return rows


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_kv_cache_greedy_equals_naive_full_recompute(kind):
    """Independent of generate(): no cache, no padding, no batching, one plain forward per token."""
    model = GPTModel(config(kind)).eval()
    ids, mask = padded_prompts()
    out = generate(model, ids, mask, GREEDY)
    p = ids.shape[1]
    for row, picked in enumerate(_naive_greedy(model, ids, mask, GREEDY.max_new_tokens, GREEDY.eos_id)):
        n = len(picked)
        assert out.tokens[row, p:p + n].tolist() == [t for t, _ in picked], (row, out.tokens[row], picked)
        assert bool((out.tokens[row, p + n:] == GREEDY.pad_id).all()) and int(out.response_mask[row].sum()) == n
        torch.testing.assert_close(out.log_probs[row, :n], torch.tensor([lp for _, lp in picked]), rtol=0, atol=1e-5)


def test_eos_stops_rows_and_pads_after():
    model = GPTModel(config())
    first = _generate(model, GREEDY)
    eos = int(first.tokens[0, 6])
    out = _generate(model, SamplingConfig(max_new_tokens=6, eos_id=eos, greedy=True, pad_id=0))
    assert out.tokens[0, 6] == eos and out.response_mask[0, 0] == 1
    assert bool((out.response_mask[0, 1:] == 0).all()) and bool((out.tokens[0, 7:] == 0).all())


def test_filters_keep_top_k_and_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    probs = logits.softmax(-1)[0]
    p = float(probs[0] + probs[1]) - 1e-4
    assert torch.isinf(filter_logits(logits, top_p=p)).tolist() == [[False, False, True, True, True]]


def test_bad_sampling_config_raises():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="30"):
        _generate(GPTModel(config()), SamplingConfig(max_new_tokens=24))


def _parallel_rank(kinds, tp, pp):
    expected = {kind: [_generate(GPTModel(config(kind)).to(device()), s) for s in (GREEDY, SAMPLED)] for kind in kinds}
    topo = topology.initialize(tp=tp, pp=pp)
    first, last = topo.is_first_stage(), topo.is_last_stage()
    layers = (0, 2) if pp == 1 else (0, 1) if first else (1, 2)
    for kind in kinds:
        model = GPTModel(config(kind), pre_process=first, post_process=last, layer_range=layers).to(device())
        for sampling, want in zip((GREEDY, SAMPLED), expected[kind]):
            got = _generate(model, sampling)
            assert torch.equal(got.tokens, want.tokens), (kind, sampling, got.tokens, want.tokens)
            torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kinds,tp,pp", [(("gpt2", "llama"), 2, 1), (("gpt2",), 1, 2)])
def test_parallel_generation_equals_single_rank(kinds, tp, pp):
    run_distributed(_parallel_rank, tp * pp, kinds, tp, pp, timeout=180)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_engine_generate_equals_static_generate(kind):
    """The engine path the backend uses: same greedy tokens, masks and log-probs; sampled log-probs are the actor's."""
    from megalite.rlhf.generation import engine_generate

    model = GPTModel(config(kind)).eval()
    ids, mask = padded_prompts()
    static, engine = generate(model, ids, mask, GREEDY), engine_generate(model, ids, mask, GREEDY)
    assert torch.equal(engine.tokens, static.tokens) and torch.equal(engine.attention_mask, static.attention_mask)
    assert torch.equal(engine.response_mask, static.response_mask)
    torch.testing.assert_close(engine.log_probs, static.log_probs, rtol=0, atol=1e-5)
    out = engine_generate(model, ids, mask, SAMPLED, torch.Generator().manual_seed(3))
    again = engine_generate(model, ids, mask, SAMPLED, torch.Generator().manual_seed(3))
    assert torch.equal(out.tokens, again.tokens)
    n = out.log_probs.shape[1]
    with torch.no_grad():
        actor, _ = sequence_log_probs(model, out.tokens, out.attention_mask, SAMPLED.temperature)
    torch.testing.assert_close(actor[:, -n:] * out.response_mask, out.log_probs, rtol=0, atol=1e-5)


def test_persistent_engine_is_built_once_and_sees_weight_updates_in_place():
    """One RolloutEngine over three calls (the second after an in-place weight change, the third on a smaller batch)
    builds one engine and gives exactly what a fresh engine gives on the same weights and seeds."""
    from megalite.rlhf.generation import RolloutEngine, engine_generate

    model = GPTModel(config("gpt2")).eval()
    ids, mask = padded_prompts()
    persistent, outputs = RolloutEngine(model), []
    for step, rows in enumerate((len(ids), len(ids), 2)):
        if step == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5)
        out = persistent.generate(ids[:rows], mask[:rows], SAMPLED, torch.Generator().manual_seed(7))
        fresh = engine_generate(model, ids[:rows], mask[:rows], SAMPLED, torch.Generator().manual_seed(7))
        for name in ("tokens", "attention_mask", "response_mask", "log_probs"):
            assert torch.equal(getattr(out, name), getattr(fresh, name)), (step, name)
        outputs.append(out)
    assert not torch.equal(outputs[0].log_probs, outputs[1].log_probs)  # the update reached the engine
    assert persistent.builds == 1


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_groups_prompt_is_prefilled_once_with_each_rows_samples(kind):
    """Three prompts x 4 samples (consecutive rows, as the RL rollouts lay out a GRPO group): one request of 4
    samples per prompt prefills a quarter of the prompt tokens, and every row samples the tokens, masks and
    log-probs of one request per row (its own seed), sampled and greedy."""
    from megalite.rlhf.generation import RolloutEngine

    model = GPTModel(config(kind)).eval()
    ids, mask = (t.repeat_interleave(4, dim=0) for t in padded_prompts())
    engines = {share: RolloutEngine(model, share_prompts=share) for share in (True, False)}
    for sampling in (SAMPLED, GREEDY):
        outs, prefill = {}, {}
        for share, engine in engines.items():
            before = engine.engine.scheduler.prefill_tokens if engine.engine is not None else 0
            outs[share] = engine.generate(ids, mask, sampling, torch.Generator().manual_seed(5))
            prefill[share] = engine.engine.scheduler.prefill_tokens - before
        assert prefill[False] == int(mask.sum()) and prefill[True] * 4 == prefill[False]
        for name in ("tokens", "attention_mask", "response_mask"):
            assert torch.equal(getattr(outs[True], name), getattr(outs[False], name)), name
        torch.testing.assert_close(outs[True].log_probs, outs[False].log_probs, rtol=0, atol=1e-6)
        if sampling is SAMPLED:  # each sample has its own stream: a group's samples differ
            assert len({tuple(row) for row in outs[True].tokens[:4].tolist()}) > 1


def _row_by_row(model, ids, mask, sampling, seed):
    """The rollout engine's documented sampling, one row at a time and without a KV cache: row ``i`` draws with the
    noise of seed ``sample_seed(s_i, 0)``, ``s_i`` the ``i``-th of ``b`` seeds drawn from ``seed``, each token the
    ``argmax(p / q)`` of the filtered ``p = softmax(logits / T)`` of the row's whole sequence and ``q`` the seed's
    ``Exp(1)`` noise at the token's position in the row's unpadded sequence; log-probs unfiltered."""
    from megalite.inference.noise import exponential
    from megalite.inference.sequence import sample_seed

    seeds = torch.randint(2 ** 62, (len(ids),), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for row, keep, s in zip(ids.tolist(), mask.tolist(), seeds):
        tokens, new, log_probs = [t for t, k in zip(row, keep) if k], [], []
        for _ in range(sampling.max_new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long))
            scaled = logits[0, -1, :model.config.vocab_size].float() / sampling.temperature
            probs = filter_logits(scaled[None], sampling.top_k, sampling.top_p).softmax(dim=-1)
            token = int((probs[0] / exponential([sample_seed(s, 0)], [len(tokens)], probs.shape[-1])[0]).argmax())
            new.append(token)
            log_probs.append(float(scaled.log_softmax(dim=-1)[token]))
            tokens.append(token)
            if token == sampling.eos_id:
                break
        out.append((new, log_probs))
    return out


def test_rollout_engine_samples_each_rows_seeded_stream():
    """The rollout engine's sampled tokens, pinned to what each row's own seeded stream gives when decoded alone
    without a cache (rows in pairs of one prompt, so a group's prompt is prefilled once and its samples fork): a
    change to the engine's batching, scheduling or bookkeeping must keep every row's tokens and log-probs."""
    from megalite.rlhf.generation import RolloutEngine

    model = GPTModel(config("gpt2")).eval()
    ids, mask = (t.repeat_interleave(2, dim=0) for t in padded_prompts(b=4))
    engine = RolloutEngine(model)
    for seed in (3, 4):
        out = engine.generate(ids, mask, SAMPLED, torch.Generator().manual_seed(seed))
        expected = _row_by_row(model, ids, mask, SAMPLED, seed)
        p = ids.shape[1]
        assert len({tuple(new) for new, _ in expected}) > 2  # the rows sample different continuations
        for i, (new, log_probs) in enumerate(expected):
            assert out.tokens[i, p:p + len(new)].tolist() == new, (seed, i)
            assert out.response_mask[i].tolist() == [1] * len(new) + [0] * (out.response_mask.shape[1] - len(new))
            torch.testing.assert_close(out.log_probs[i, :len(new)], torch.tensor(log_probs), rtol=0, atol=1e-5)


def test_rollout_engine_switches_a_training_model_to_eval_once_per_call(monkeypatch):
    """A training-mode actor is put in eval mode once for a whole rollout call (not around each engine step) and
    given back in training mode."""
    from megalite.rlhf.generation import RolloutEngine

    model = GPTModel(config("gpt2")).train()
    ids, mask = padded_prompts()
    switches, train = [], model.train

    def counted(mode=True):
        switches.append(mode)
        return train(mode)
    monkeypatch.setattr(model, "train", counted)
    RolloutEngine(model).generate(ids, mask, SAMPLED, torch.Generator().manual_seed(7))
    assert switches == [False, True] and model.training
