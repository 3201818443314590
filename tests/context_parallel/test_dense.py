"""The dense packed-document path at cp=1 equals the tiled (blockwise) path: output and every gradient, fp32
(documents branched for prefix sharing included, with a window measured along each sequence)."""

import math

import pytest
import torch

from megalite.context_parallel import attention, context_parallel_attention
from megalite.context_parallel.blockwise import BlockwiseAttention, Tokens
from megalite.context_parallel.dense import DENSE_MAX_LENGTH, dense_attention, use_dense
from megalite.context_parallel.sequence_split import BRANCH, sequence_positions

SEQ = 24


def _documents(kind: str, b: int) -> torch.Tensor | None:
    """``[b, SEQ]`` document ids of one packing (non-decreasing, as the packed batches make them)."""
    gen = torch.Generator().manual_seed(7)
    if kind == "causal":
        return None
    if kind == "single":
        return torch.zeros(b, SEQ, dtype=torch.long)
    if kind == "many":  # random lengths, a different packing per row
        ends = torch.rand(b, SEQ, generator=gen) < 0.3
        return ends.long().cumsum(-1) - ends.long()
    if kind == "tile_aligned":  # documents of 4 tokens: with tiles of 4 none crosses a tile boundary
        return (torch.arange(SEQ) // 4).expand(b, SEQ).contiguous()
    if kind == "one_token":  # every token its own document: each query sees only itself
        return torch.arange(SEQ).expand(b, SEQ).contiguous()
    if kind == "padded":  # pack()'s layout: conversations, then one padding document to the end of the row
        rows = [[0] * 9 + [1] * 7 + [2] * 8, [0] * 20 + [1] * 4, [0] * 5 + [1] * 3 + [2] * 16]
        return torch.tensor(rows[:b])
    if kind == "branched":  # prefix sharing: trunks with two or three branches of uneven lengths, then padding
        rows = [[0] * 4 + [BRANCH] * 9 + [2 * BRANCH] * 6 + [1] * 5,
                [0] * 2 + [BRANCH] * 3 + [2 * BRANCH] * 7 + [3 * BRANCH] * 5 + [1] * 7,
                [0] * 6 + [1] * 2 + [1 + BRANCH] * 8 + [1 + 2 * BRANCH] * 8]
        return torch.tensor(rows[:b])
    raise AssertionError(kind)


def _run(fn, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", ["causal", "single", "many", "tile_aligned", "one_token", "padded", "branched"])
@pytest.mark.parametrize("heads,groups,dv", [(4, 4, 8), (4, 2, 8), (4, 1, 6)])
def test_dense_equals_blockwise(kind, heads, groups, dv, window):
    """Every packing, with and without a sliding window, multi-head, GQA and a value head dim of its own (MLA):
    output, dq, dk, dv <= 1e-5."""
    b, d = 3, 8
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    q = torch.randn(b, heads, SEQ, d, generator=gen)
    k = torch.randn(b, groups, SEQ, d, generator=gen)
    v = torch.randn(b, groups, SEQ, dv, generator=gen)
    dout = torch.randn(b, heads, SEQ, dv, generator=gen)
    documents = _documents(kind, b)
    scale = 1 / math.sqrt(d)
    got = _run(lambda *t: dense_attention(*t, documents, scale, window), q, k, v, dout)
    sequence = None if documents is None else sequence_positions(documents)  # as context_parallel_attention's
    for tile in (4, 512):  # uneven tiles that skip pairs, and one tile over the whole row
        tokens = Tokens(torch.arange(SEQ), documents, tile, sequence)
        want = _run(lambda *t: BlockwiseAttention.apply(*t, tokens, tokens, scale, window), q, k, v, dout)
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.shape == w.shape, name
            torch.testing.assert_close(a, w, rtol=0, atol=1e-5, msg=f"{kind} window {window} tile {tile}: {name}")


def test_dense_keeps_the_input_dtype():
    """bf16 inputs: fp32 math as on the tiles, the output back in bf16, equal to the tiled path's."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, SEQ, 8, generator=gen).bfloat16() for _ in range(3))
    documents = _documents("many", 2)
    tokens = Tokens(torch.arange(SEQ), documents)
    out = dense_attention(q, k, v, documents, 0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, BlockwiseAttention.apply(q, k, v, tokens, tokens, 0.5))


def test_only_short_rows_at_one_rank_run_dense(monkeypatch):
    assert use_dense(317, 1) and use_dense(DENSE_MAX_LENGTH, 1)
    assert not use_dense(DENSE_MAX_LENGTH + 1, 1)  # long packs keep the tiles, which skip masked pairs
    assert not use_dense(317, 2)  # context parallelism keeps its own paths
    calls = []
    monkeypatch.setattr(attention, "dense_attention", lambda *a: calls.append("dense") or dense_attention(*a))
    real = BlockwiseAttention.apply
    monkeypatch.setattr(BlockwiseAttention, "apply", lambda *a: calls.append("tiles") or real(*a))
    q = torch.randn(SEQ, 2, 2, 8)
    documents = _documents("many", 2)
    context_parallel_attention(q, q, q, group=None, documents=documents)
    context_parallel_attention(q, q, q, group=None, documents=documents, window=3)
    assert calls == ["dense", "dense"]  # a sliding window too (faster dense up to DENSE_MAX_LENGTH)
