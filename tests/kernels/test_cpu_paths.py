"""CPU-specific choices of the fused path: counting-sort row map, torch's LayerNorm for fp32, dropout masks."""

import pytest
import torch

import megalite.kernels as K
from megalite.kernels import reference as R

pytestmark = pytest.mark.usefixtures("require_extension")


@pytest.mark.parametrize("experts, tokens, k", [(4, 64, 2), (1, 9, 3), (3, 0, 2), (10**12, 17, 2)])
def test_counting_sort_row_map_equals_stable_argsort(experts, tokens, k):
    """Same row order as the stable argsort, ties (many per expert) and dropped (-1) slots included;
    ids far above the assignment count take the comparison-sort branch."""
    torch.manual_seed(0)
    ids = torch.randint(-1, min(experts, 6), (tokens, k))
    if experts > 6 and tokens:
        ids[::3, 0] = experts - 1
    got = torch.ops.megalite.permute_row_map(ids)
    assert torch.equal(got, R.permute_row_map(ids))
    assert got.numel() == int((ids >= 0).sum())
    tokens_in = torch.randn(tokens, 5)
    permuted, row_map = K.permute(tokens_in, ids)
    assert torch.equal(row_map, got) and torch.equal(permuted, tokens_in[got // k])


def test_row_map_op_registration():
    torch.library.opcheck(torch.ops.megalite.permute_row_map.default, (torch.tensor([[2, -1], [0, 2], [1, 0]]),),
                          test_utils=("test_schema", "test_faketensor"))


def test_extension_layer_norm_fp32_kernel_matches_reference():
    """fp32 on CPU routes to torch's LayerNorm, so the extension's fp32 kernel is checked here directly."""
    torch.manual_seed(0)
    x = torch.randn(6, 37, requires_grad=True)
    w, b = torch.randn(37, requires_grad=True), torch.randn(37, requires_grad=True)
    dy = torch.randn(6, 37)
    got = torch.ops.megalite.layer_norm_fwd(x, w, b, 1e-5)[0]
    got_grads = torch.autograd.grad(got, (x, w, b), dy)
    want = R.layer_norm(x, w, b, 1e-5)
    want_grads = torch.autograd.grad(want, (x, w, b), dy)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p, training", [(0.0, True), (0.3, False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_no_dropout_draws_no_mask(p, training, with_bias):
    x, residual = torch.randn(5, 7, requires_grad=True), torch.randn(5, 7, requires_grad=True)
    bias = torch.randn(7, requires_grad=True) if with_bias else None
    state = torch.get_rng_state()
    got = K.bias_dropout_add(x, bias, residual, p, training)
    assert torch.equal(torch.get_rng_state(), state)
    want = R.bias_dropout_add(x, bias, residual, p, training)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    leaves = [t for t in (x, bias, residual) if t is not None]
    dy = torch.randn(5, 7)
    for g, r in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


def test_fused_and_reference_dropout_masks_are_identical():
    x, residual = torch.randn(33, 65) + 5.0, torch.zeros(33, 65)
    torch.manual_seed(11)
    fused = K.bias_dropout_add(x, None, residual, 0.4, True)
    torch.manual_seed(11)
    mask = R.dropout_mask(x, 0.4)
    assert torch.equal(fused != 0, mask)
    assert 0.3 < 1 - mask.float().mean().item() < 0.5


@pytest.mark.parametrize("d", [8, 13, 64, 128])
def test_paged_attention_reads_blocks_in_place_like_the_reference(d):
    """GQA, decodes and multi-token queries (causal among themselves), contexts ending mid-block, shuffled
    and padded block tables: the kernel equals the per-sequence reference in fp32; rows of no sequence are 0.
    Head sizes: the kernel's register-resident paths (64, 128), a multiple of its 8-wide vectors and a size
    with a scalar tail."""
    torch.manual_seed(0)
    groups, per_group, num_blocks, block = 2, 3, 24, 4
    keys, values = torch.randn(groups, num_blocks, block, d), torch.randn(groups, num_blocks, block, d)
    starts, lengths = torch.tensor([0, 5, 12, 3]), torch.tensor([1, 3, 1, 2])
    first = torch.tensor([0, 2, 5, 7])
    tables = torch.stack([torch.randperm(num_blocks)[:5] for _ in range(4)])
    q = torch.randn(9, groups * per_group, d)
    assert K.paged_attention_fused(q, keys, values)
    got = K.paged_attention(q, keys, values, tables, starts, lengths, first, d ** -0.5)
    want = R.paged_attention(q, keys, values, tables, starts, lengths, first, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got[1].abs().max() == 0 and want[1].abs().max() == 0
    # Query 0 of sequence 0 sees one key: its output is that key's value, per head of the group.
    torch.testing.assert_close(got[0, :per_group], values[0, tables[0, 0], 0].expand(per_group, d))
    with pytest.raises(RuntimeError, match="block id 24 outside"):
        torch.ops.megalite.paged_attention(q, keys, values, torch.full_like(tables, num_blocks), starts, lengths,
                                           first, 1.0)
    torch.library.opcheck(torch.ops.megalite.paged_attention.default,
                          (q, keys, values, tables, starts, lengths, first, 0.5),
                          test_utils=("test_schema", "test_faketensor"))
