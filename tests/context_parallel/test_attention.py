"""Context-parallel attention (p2p, all_gather, a2a at cp 2 and 4) equals single-rank SDPA, forward and backward."""

import pytest
import torch
import torch.nn.functional as F

from megalite.context_parallel import (chunk_indices, context_parallel_attention, document_ids, reset_position_ids,
                                       slice_for_rank)
from megalite.context_parallel.blockwise import BlockwiseAttention, Tokens
from megalite.testing import run_distributed

EOD = 0


def _inputs(seq, b, heads, groups, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, b, heads, d, generator=gen)
    k = torch.randn(seq, b, groups, d, generator=gen)
    v = torch.randn(seq, b, groups, d, generator=gen)
    dout = torch.randn(seq, b, heads * d, generator=gen)
    tokens = torch.randint(1, 5, (b, seq), generator=gen)
    tokens[tokens == 1] = EOD  # about a quarter of the tokens end a document
    return q, k, v, dout, document_ids(tokens, EOD)


def _reference(q, k, v, dout, documents):
    """SDPA over the whole sequence with a dense causal (and same-document) mask; output and grads."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    seq, b, heads, d = q.shape
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if documents is not None:
        mask = (mask & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=mask,
                                         enable_gqa=k.shape[2] != heads)
    out = out.permute(2, 0, 1, 3).reshape(seq, b, heads * d)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _check_group(group, cp, rank, seq, heads, groups, tile, seed):
    """Every comm type, causal and document-masked, against the reference on this rank's chunks."""
    errors = {}
    q, k, v, dout, docs = _inputs(seq, 2, heads, groups, 8, seed)
    for documents in (None, docs):
        ref = _reference(q, k, v, dout, documents)
        index = chunk_indices(seq, cp, rank)
        for comm in ("p2p", "all_gather", "a2a"):
            local = [t[index].clone().requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*local, group=group, comm_type=comm, documents=documents, tile=tile)
            out.backward(dout[index])
            got = [out.detach()] + [t.grad for t in local]
            want = [ref[0][index]] + [g[index] for g in ref[1:]]
            key = f"cp{cp}-{comm}-{'docs' if documents is not None else 'causal'}"
            errors[key] = max((a - b).abs().max().item() for a, b in zip(got, want))
    return errors


def _rank_fn():
    import torch.distributed as dist

    from megalite import topology

    topo = topology.initialize(cp=4)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = topo.global_rank
    errors = {}
    # cp 4: chunks of 3 tokens (odd), tiles of 2 so chunks split into uneven tiles; GQA (8 heads, 4 groups).
    errors.update(_check_group(topo.cp.group, 4, topo.cp.rank, 24, 8, 4, 2, seed=1))
    # cp 2: chunks of 5 tokens, one tile per chunk; plain multi-head.
    errors.update(_check_group(halves[rank // 2], 2, rank % 2, 20, 4, 4, 512, seed=2))
    return errors


def test_cp_attention_matches_sdpa():
    for errors in run_distributed(_rank_fn, 4, timeout=180):
        assert len(errors) == 12
        for key, error in errors.items():
            assert error < 1e-5, (key, error)


def test_single_rank_document_attention_matches_sdpa():
    """The cp=1 entry point (the dense path at this length) and the tiled path (uneven tiles of 4) directly."""
    q, k, v, dout, docs = _inputs(13, 3, 4, 2, 8, seed=3)
    ref = _reference(q, k, v, dout, docs)
    tokens = Tokens(torch.arange(13), docs, tile=4)

    def tiled(q, k, v):
        out = BlockwiseAttention.apply(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), tokens, tokens, 8 ** -0.5)
        return out.permute(2, 0, 1, 3).reshape(13, 3, -1)

    for attend in (lambda *t: context_parallel_attention(*t, group=None, documents=docs), tiled):
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*local)
        out.backward(dout)
        for got, want in zip([out.detach()] + [t.grad for t in local], ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_sequence_split_helpers():
    assert chunk_indices(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert chunk_indices(12, 3, 1, load_balance=False).tolist() == [4, 5, 6, 7]
    assert torch.cat([chunk_indices(16, 4, r) for r in range(4)]).sort().values.tolist() == list(range(16))
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9]])
    docs = document_ids(tokens, 0)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert reset_position_ids(docs).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    assert slice_for_rank(torch.arange(8)[None], 2, 1).tolist() == [[2, 3, 4, 5]]


def test_bad_comm_type():
    q = torch.zeros(4, 1, 2, 4)
    with pytest.raises(ValueError, match="unknown context-parallel comm type 'ring'; choose one of p2p, all_gather, a2a"):
        context_parallel_attention(q, q, q, group=None, comm_type="ring")
