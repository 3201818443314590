"""Padding masks and per-row positions: a left-padded row computes what the unpadded row computes alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.models import GPTModel, KVCache
from megalite.tensor_parallel import gather_from_tensor_parallel_region
from megalite.testing import run_distributed
from megalite.topology import device
from tests.models.common import VOCAB, config, full_to_shard, left_padded


def _unpadded_rows(model, ids, labels, mask):
    """Per-row logits of the real tokens alone, and the parameter grads of their summed loss."""
    model.zero_grad()
    rows = []
    for row in range(ids.shape[0]):
        real = int(mask[row].sum())
        with torch.no_grad():
            rows.append(model(ids[row:row + 1, -real:])[0])
        model(ids[row:row + 1, -real:], labels=labels[row:row + 1, -real:]).sum().backward()
    return rows, {name: p.grad.clone() for name, p in model.named_parameters()}


def _masked_loss_backward(model, ids, labels, mask):
    model.zero_grad()
    (model(ids, labels=labels, attention_mask=mask) * mask).sum().backward()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_left_padded_rows_match_unpadded_rows(kind):
    model = GPTModel(config(kind))
    ids, labels, mask = left_padded()
    rows, grads = _unpadded_rows(model, ids, labels, mask)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
    assert torch.isfinite(padded).all()
    for row, alone in enumerate(rows):
        real = alone.shape[0]
        torch.testing.assert_close(padded[row, -real:], alone, rtol=0, atol=1e-5, msg=f"row {row}")
    _masked_loss_backward(model, ids, labels, mask)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_keeps_the_mask(granularity):
    ids, labels, mask = left_padded()
    grads = []
    for recompute in (None, granularity):
        model = GPTModel(config("llama", recompute_granularity=recompute))
        _masked_loss_backward(model, ids, labels, mask)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_padded_kv_cache_and_explicit_positions(kind):
    model = GPTModel(config(kind)).eval()
    ids, _, mask = left_padded()
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = KVCache()
        first = model(ids[:, :4], attention_mask=mask[:, :4], kv_cache=cache)
        second = model(ids[:, 4:], attention_mask=mask, kv_cache=cache)
        torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=0, atol=1e-5)
        positions = torch.stack([torch.arange(6), torch.arange(3, 9), torch.arange(6).flip(0)])
        batched = model(ids, position_ids=positions)
        for row in range(3):
            alone = model(ids[row:row + 1], position_ids=positions[row:row + 1])
            torch.testing.assert_close(batched[row:row + 1], alone, rtol=0, atol=1e-5, msg=f"row {row}")
        torch.testing.assert_close(model(ids, position_ids=torch.arange(6).expand(3, 6)), model(ids),
                                   rtol=0, atol=1e-5)
        assert (batched[2] - model(ids[2:])[0]).abs().max() > 1e-4, "position_ids had no effect"


def test_return_hidden_feeds_the_output_layer():
    model = GPTModel(config())
    ids, _, mask = left_padded()
    with torch.no_grad():
        hidden = model(ids, attention_mask=mask, return_hidden=True)
        assert hidden.shape == (3, 6, 32)
        logits = hidden @ model.embedding.word_embeddings.weight[:VOCAB].t()
        torch.testing.assert_close(logits, model(ids, attention_mask=mask), rtol=0, atol=1e-5)


def test_bad_mask_and_positions_raise():
    model = GPTModel(config())
    ids, labels, mask = left_padded()
    with pytest.raises(ValueError, match=r"attention_mask must be \[b, offset \+ s\] = \[3, 6\].*got \(3, 5\)"):
        model(ids, attention_mask=mask[:, 1:])
    cache = KVCache()
    model(ids[:, :4], attention_mask=mask[:, :4], kv_cache=cache)
    with pytest.raises(ValueError, match=r"= \[3, 6\] \(4 cached tokens\), got \(3, 2\)"):
        model(ids[:, 4:], attention_mask=mask[:, 4:], kv_cache=cache)
    with pytest.raises(ValueError, match=r"position_ids must be \[b, s\] = \[3, 6\], got \(1, 6\)"):
        model(ids, position_ids=torch.arange(6)[None])
    with pytest.raises(ValueError, match=r"position_ids range over \[0, 16\], outside \[0, 15\]"):
        model(ids, position_ids=torch.arange(11, 17).expand(3, 6) * torch.tensor([[1], [1], [0]]))
    with pytest.raises(ValueError, match="labels or return_hidden"):
        model(ids, labels=labels, return_hidden=True)


def _tp2_rank(kinds):
    ids, labels, mask = (t.to(device()) for t in left_padded())
    references = {}
    for kind in kinds:
        ref = GPTModel(config(kind)).to(ids.device)
        rows, _ = _unpadded_rows(ref, ids, labels, mask)
        _masked_loss_backward(ref, ids, labels, mask)
        with torch.no_grad():
            hidden = ref(ids, attention_mask=mask, return_hidden=True)
        references[kind] = rows, {n: p.grad for n, p in ref.named_parameters()}, hidden
    topo = topology.initialize(tp=2)
    for kind, (rows, grads, ref_hidden) in references.items():
        cfg = config(kind)
        for sequence_parallel in (False, True):
            where = f"{kind}, sequence_parallel={sequence_parallel}"
            model = GPTModel(cfg, sequence_parallel=sequence_parallel).to(ids.device)
            with torch.no_grad():
                logits = gather_from_tensor_parallel_region(model(ids, attention_mask=mask), topo.tp.group)
                hidden = model(ids, attention_mask=mask, return_hidden=True)
            torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=1e-5, msg=where)
            for row, alone in enumerate(rows):
                real = alone.shape[0]
                torch.testing.assert_close(logits[row, -real:, :VOCAB], alone, rtol=0, atol=1e-5,
                                           msg=f"{where}: row {row}")
            _masked_loss_backward(model, ids, labels, mask)
            for name, param in model.named_parameters():
                grad = param.grad
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(grad, group=topo.tp.group)
                expected = full_to_shard(name, grads[name], param, cfg, topo.tp.rank, topo.tp.size)
                torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5, msg=f"{where}: grad {name}")


def test_left_padded_rows_match_unpadded_rows_tp2():
    run_distributed(_tp2_rank, 2, ("gpt2", "llama"), timeout=240)
