"""Multi-rank GPT tests: tensor parallelism (with and without sequence parallelism) against tp=1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import topology
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_seed
from megalite.testing import run_distributed
from megalite.topology import device
from tests.models.common import VOCAB, batch, config, full_to_shard


def _reference(cfg, ids, labels):
    """tp=1 model (built before any topology exists), its per-token loss, logits and grads."""
    model = GPTModel(cfg).to(ids.device)
    loss = model(ids, labels=labels)
    loss.sum().backward()
    with torch.no_grad():
        logits = model(ids)
    return model, loss.detach(), logits


def _check_tp_parity(kinds):
    ids, labels = (t.to(device()) for t in batch())
    references = {kind: _reference(config(kind), ids, labels) for kind in kinds}
    topo = topology.initialize(tp=2)
    rank, tp = topo.tp.rank, topo.tp.size
    for kind, (ref, ref_loss, ref_logits) in references.items():
        cfg = config(kind)
        ref_params = dict(ref.named_parameters())
        for sequence_parallel in (False, True):
            where = f"{kind}, sequence_parallel={sequence_parallel}"
            model = GPTModel(cfg, sequence_parallel=sequence_parallel).to(ids.device)
            params = dict(model.named_parameters())
            assert sorted(params) == sorted(ref_params), where
            for name, param in params.items():
                expected = full_to_shard(name, ref_params[name].detach(), param, cfg, rank, tp)
                assert torch.equal(param.detach(), expected), f"{where}: weight {name}"
            with torch.no_grad():
                logits = model(ids)
            assert logits.shape == (2, 8, 56), where
            local = full_to_shard("output_layer", ref_logits.transpose(0, 2), params["embedding.word_embeddings.weight"],
                                  cfg, rank, tp).transpose(0, 2)
            real = min(56, max(0, VOCAB - rank * 56))
            torch.testing.assert_close(logits[..., :real], local[..., :real], rtol=0, atol=1e-5, msg=where)
            assert bool((logits[..., real:] == -1.0e4).all()), where
            loss = model(ids, labels=labels)
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5, msg=where)
            loss.sum().backward()
            for name, param in params.items():
                grad = param.grad
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(grad, group=topo.tp.group)
                expected = full_to_shard(name, ref_params[name].grad, param, cfg, rank, tp)
                torch.testing.assert_close(grad, expected, rtol=0, atol=1e-5, msg=f"{where}: grad {name}")


def test_tensor_parallel_matches_single_rank():
    run_distributed(_check_tp_parity, 2, ("gpt2", "llama", "llama_kv", "qwen"), timeout=240)


def _check_recompute_under_sequence_parallel():
    topo = topology.initialize(tp=2)
    ids, labels = (t.to(device()) for t in batch())
    results = {}
    modes = {None: {}, "full": {}, "selective": {}, "uniform-2": {"recompute_method": "uniform",
                                                                  "recompute_num_layers": 2},
             "block-1": {"recompute_method": "block", "recompute_num_layers": 1}}
    for granularity, method in modes.items():
        cfg = config("llama", hidden_dropout=0.2, attention_dropout=0.3,
                     recompute_granularity="full" if method else granularity, **method)
        model = GPTModel(cfg, sequence_parallel=True).to(ids.device)
        model_parallel_seed(42, topo.tp.rank)
        loss = model(ids, labels=labels)
        loss.sum().backward()
        results[granularity] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    loss, grads = results[None]
    for granularity in ("full", "selective", "uniform-2", "block-1"):
        torch.testing.assert_close(results[granularity][0], loss, rtol=0, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(results[granularity][1][name], grad, rtol=0, atol=1e-6,
                                       msg=f"{granularity}: {name}")
    model.eval()
    assert (model(ids, labels=labels) - loss).abs().max() > 1e-3, "dropout had no effect"


def test_recompute_with_dropout_under_sequence_parallel():
    run_distributed(_check_recompute_under_sequence_parallel, 2, timeout=240)
