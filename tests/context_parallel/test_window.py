"""Sliding-window attention (``GPTConfig.window_size``): blockwise tiles, context parallelism, transformers' Mistral.

- The blockwise attention with a window (tiles skipped, full and partial) equals a dense masked
  softmax, forward and backward, with and without documents.
- A GPT with a window at cp=2 (p2p, all_gather, a2a; plain, packed and branched (prefix-shared) samples)
  gives the cp=1 per-token losses and gradients.
- Against transformers' own MistralForCausalLM with a window shorter than the sequence: logits,
  left-padded logits, greedy generation with the static decoder (KV cache) and with the paged
  inference engine (chunked prefill, blocks behind the window freed).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import (chunk_indices, context_parallel_attention, document_ids, reset_position_ids,
                                       slice_for_rank)
from megalite.context_parallel.sequence_split import BRANCH
from megalite.models import GPTModel
from megalite.testing import run_distributed
from tests.models.common import VOCAB, config

SEQ, EOD = 24, 0


def _dense_reference(q, k, v, window, documents=None):
    """softmax with the causal window mask written out, ``[s, b, n, d]`` in, ``[s, b, n*d]`` out."""
    s, b, n, d = q.shape
    k, v = (t.repeat_interleave(n // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) / math.sqrt(d)
    distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    allowed = (distance >= 0) & (distance <= window)
    allowed = allowed.expand(b, 1, s, s)
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, n * d)


@pytest.mark.parametrize("window", [0, 3, 6, 30])
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_window_matches_dense_mask(window, packed):
    g = torch.Generator().manual_seed(window)
    q = torch.randn(20, 2, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(20, 2, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(20, 2, 2, 8, generator=g, requires_grad=True)
    documents = None
    if packed:
        documents = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [0] * 13 + [1] * 7])
    grad = torch.randn(20, 2, 32, generator=g)
    got = context_parallel_attention(q, k, v, documents=documents, tile=4, window=window)
    got_grads = torch.autograd.grad((got * grad).sum(), (q, k, v))
    want = _dense_reference(q, k, v, window, documents)
    want_grads = torch.autograd.grad((want * grad).sum(), (q, k, v))
    assert (got - want).abs().max() <= 1e-5
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() <= 1e-5


def test_a_bad_window_or_a_cache_that_cannot_honour_it_is_one_error():
    from megalite.models import KVCache

    q = torch.zeros(4, 1, 2, 8)
    with pytest.raises(ValueError, match="attention window must be a non-negative integer or None, got -2"):
        context_parallel_attention(q, q, q, window=-2)
    with pytest.raises(ValueError, match="GPTConfig.window_size must be a non-negative integer or None, got 2.5"):
        config("llama", window_size=2.5).validate()
    model = GPTModel(config("llama", window_size=3)).eval()
    with pytest.raises(ValueError, match=r"sliding-window attention \(window_size=3\) needs an attention mask or a "
                                         r"KV cache that applies the same window"):
        model(torch.ones(1, 4, dtype=torch.long), kv_cache=KVCache())


def _run(model, ids, labels, **kwargs):
    model.zero_grad()
    loss = model(ids, labels, **kwargs)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_fn():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, VOCAB, (2, SEQ + 1), generator=g)
    tokens[0, [6, 15]] = EOD
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    docs = document_ids(ids, EOD)
    # A trunk of 3 and branches of 7 and 8 (the second's window reaches the trunk across the first), then a document.
    branched = torch.tensor([[0] * 3 + [BRANCH] * 7 + [2 * BRANCH] * 8 + [1] * 6, [0] * 9 + [1] * 15])
    positions = reset_position_ids(branched)
    cfg = config("llama", max_position_embeddings=SEQ, window_size=5)
    reference = GPTModel(cfg)
    refs = {"causal": _run(reference, ids, labels), "packed": _run(reference, ids, labels, document_ids=docs),
            "branched": _run(reference, ids, labels, document_ids=branched, position_ids=positions)}
    topo = topology.initialize(cp=2)
    index = chunk_indices(SEQ, 2, topo.cp.rank)
    errors = {}
    for comm in ("p2p", "all_gather", "a2a"):
        model = GPTModel(cfg, cp_comm_type=comm)
        for kind, kwargs in (("causal", {}), ("packed", {"document_ids": docs}),
                             ("branched", {"document_ids": branched,
                                           "position_ids": slice_for_rank(positions, 2, topo.cp.rank)})):
            loss, grads = _run(model, slice_for_rank(ids, 2, topo.cp.rank), slice_for_rank(labels, 2, topo.cp.rank),
                               **kwargs)
            ref_loss, ref_grads = refs[kind]
            for grad in grads.values():
                dist.all_reduce(grad, group=topo.cp.group)
            errors[f"{comm}-{kind}-loss"] = (loss - ref_loss[:, index]).abs().max().item()
            errors[f"{comm}-{kind}-grads"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    return errors


def test_window_at_cp2_matches_cp1():
    for errors in run_distributed(_rank_fn, 2, timeout=240):
        assert len(errors) == 18
        for key, error in errors.items():
            assert error < 1e-5, (key, error)


@pytest.mark.slow
def test_window_matches_transformers_mistral():
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf import hf_to_megalite
    from megalite.rlhf.generation import SamplingConfig, generate

    torch.manual_seed(0)
    hf_config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                           sliding_window=4, tie_word_embeddings=False)
    hf = transformers.MistralForCausalLM(hf_config).eval()
    cfg, tensors, _ = hf_to_megalite(hf_config.to_dict(), dict(hf.state_dict()))
    assert cfg.window_size == hf_config.sliding_window - 1
    cfg.make_vocab_size_divisible_by = 1
    model = GPTModel(cfg).eval()
    model.load_state_dict(tensors, strict=True)

    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        full = GPTModel(config("llama", **{**vars(cfg), "window_size": None})).eval()
        full.load_state_dict(tensors, strict=True)
        assert (full(ids) - want).abs().max() > 1e-3  # the window is shorter than the sequence

        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, attention_mask=mask)
        real = mask.bool()
        assert (got[real] - want[real]).abs().max() <= 1e-5 * want[real].abs().max()

    prompt = ids[:1, :5]
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 5:]
    out = generate(model, prompt, torch.ones_like(prompt), SamplingConfig(max_new_tokens=10, greedy=True))
    assert out.tokens[0, 5:].tolist() == expected.tolist()

    # The paged engine: decodes and (chunked) prefills within the window, blocks behind it freed.
    from megalite.inference import EngineConfig, LLMEngine, SamplingParams

    prompts = [ids[0, :5].tolist(), ids[1, :12].tolist()]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    engine = LLMEngine(model, EngineConfig(block_size=2, num_blocks=64, max_num_batched_tokens=6))
    requests = [engine.add_request(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.allocator.num_used())
    assert [r.output().outputs[0].token_ids for r in requests] == expected
    # Without freeing the sequences end holding 8 + 11 blocks of 2 tokens.  With the window (a query sees 4
    # tokens) a decode keeps the 3 blocks its window spans, a 6-token prefill chunk the 5 its queries see.
    assert peak <= 8 and engine.allocator.num_used() == 0
