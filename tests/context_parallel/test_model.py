"""GPTModel under context parallelism and with packed sequences equals the single-rank model.

One 4-rank launch checks, per CP configuration (cp4: learned positions, 4 heads;
cp2: RoPE with grouped-query attention) and comm type, the per-token losses
and every parameter's gradient (summed over CP) against one rank, for plain
causal samples and for packed samples (reset positions, document masks), and
tp2 x cp2 with sequence parallelism on packed samples (every TP shard's
gradient).  The packed single-rank losses themselves equal each document run
alone.
"""

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import chunk_indices, document_ids, reset_position_ids, slice_for_rank
from megalite.models import GPTModel
from megalite.testing import run_distributed
from tests.models.common import VOCAB, config, full_to_shard

EOD = 0
SEQ = 24  # chunks of 3 tokens at cp4, 6 at cp2


def _packed_batch():
    """Two rows of documents separated by eod; the last document of each row runs to the end."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (2, SEQ + 1), generator=g)
    for row, ends in ((0, (4, 11, 12, 19)), (1, (8, 17))):
        tokens[row, list(ends)] = EOD
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _run(model, ids, labels, **kwargs):
    model.zero_grad()
    loss = model(ids, labels, **kwargs)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _references(cfg, ids, labels, docs):
    model = GPTModel(cfg)
    causal = _run(model, ids, labels)
    packed = _run(model, ids, labels, position_ids=reset_position_ids(docs), document_ids=docs)
    return causal, packed


def _per_document_error(cfg, ids, labels, docs, packed_loss):
    """Largest gap between the packed per-token losses and each document run alone as its own sample."""
    model = GPTModel(cfg)
    error = 0.0
    for row in range(ids.shape[0]):
        for doc in docs[row].unique():
            where = (docs[row] == doc).nonzero().flatten()
            alone = model(ids[row:row + 1, where], labels[row:row + 1, where]).detach()
            error = max(error, (alone[0] - packed_loss[row, where]).abs().max().item())
    return error


def _compare(cfg, ids, labels, docs, references, topo, comm):
    """Max errors (loss, grads) of the CP model for plain and packed samples against the references."""
    cp, rank = topo.cp.size, topo.cp.rank
    model = GPTModel(cfg, cp_comm_type=comm)
    index = chunk_indices(SEQ, cp, rank)
    errors = {}
    for kind, kwargs, (ref_loss, ref_grads) in (
            ("causal", {}, references[0]),
            ("packed", {"position_ids": slice_for_rank(reset_position_ids(docs), cp, rank), "document_ids": docs},
             references[1])):
        loss, grads = _run(model, slice_for_rank(ids, cp, rank), slice_for_rank(labels, cp, rank), **kwargs)
        for grad in grads.values():
            dist.all_reduce(grad, group=topo.cp.group)
        errors[f"cp{cp}-{comm}-{kind}-loss"] = (loss - ref_loss[:, index]).abs().max().item()
        errors[f"cp{cp}-{comm}-{kind}-grads"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    return errors


def _compare_tp_sp(cfg, ids, labels, docs, packed_reference):
    """tp2 x cp2 with sequence parallelism, packed samples: losses and every TP shard's gradient."""
    topo = topology.initialize(tp=2, cp=2)
    cp, rank = topo.cp.size, topo.cp.rank
    model = GPTModel(cfg, sequence_parallel=True)
    index = chunk_indices(SEQ, cp, rank)
    loss, grads = _run(model, slice_for_rank(ids, cp, rank), slice_for_rank(labels, cp, rank),
                       position_ids=slice_for_rank(reset_position_ids(docs), cp, rank), document_ids=docs)
    params = dict(model.named_parameters())
    error = 0.0
    for name, grad in grads.items():
        if getattr(params[name], "sequence_parallel", False):
            dist.all_reduce(grad, group=topo.tp.group)
        dist.all_reduce(grad, group=topo.cp.group)
        want = full_to_shard(name, packed_reference[1][name], params[name], cfg, topo.tp.rank, topo.tp.size)
        error = max(error, (grad - want).abs().max().item())
    return {"tp2cp2-sp-packed-loss": (loss - packed_reference[0][:, index]).abs().max().item(),
            "tp2cp2-sp-packed-grads": error}


def _rank_fn():
    ids, labels = _packed_batch()
    docs = document_ids(ids, EOD)
    configs = {4: config("gpt2", max_position_embeddings=SEQ), 2: config("llama", max_position_embeddings=SEQ)}
    references = {cp: _references(cfg, ids, labels, docs) for cp, cfg in configs.items()}
    errors = {f"cp1-{cfg.position_embedding_type}-per-document": _per_document_error(cfg, ids, labels, docs,
                                                                                        references[cp][1][0])
              for cp, cfg in configs.items()}
    for cp in (4, 2):
        topo = topology.initialize(cp=cp)
        for comm in ("p2p", "all_gather", "a2a"):
            errors.update(_compare(configs[cp], ids, labels, docs, references[cp], topo, comm))
    errors.update(_compare_tp_sp(configs[2], ids, labels, docs, references[2][1]))
    with pytest.raises(ValueError, match="a2a needs the attention heads 4 and key/value heads 2"):
        GPTModel(configs[2], cp_group=topology.initialize(cp=4).cp.group, cp_comm_type="a2a")
    # Generation (KV cache) and padding masks are for cp=1; a model trained at any cp loads there.
    with pytest.raises(ValueError, match=r"not supported with context parallelism \(cp=4\); run them at cp=1"):
        GPTModel(configs[4])(ids[:, :6], attention_mask=torch.ones(2, 6))
    return errors


def test_context_parallel_gpt_matches_single_rank():
    for errors in run_distributed(_rank_fn, 4, timeout=240):
        assert len(errors) == 2 + 2 * 3 * 4 + 2
        for key, error in errors.items():
            assert error < 1e-5, (key, error)
