"""The single-rank fast path of vocab_parallel_cross_entropy (F.cross_entropy) against the general path."""

import pytest
import torch

from megalite.tensor_parallel import cross_entropy as ce


def _loss_and_grad(fn, logits, dy):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x)
    loss.backward(dy)
    return loss.detach(), x.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("out_of_range", [False, True])
def test_fast_path_matches_general_path(smoothing, out_of_range):
    """In-range targets take F.cross_entropy; any target outside [0, v) keeps the general path's loss."""
    torch.manual_seed(0)
    logits, dy = torch.randn(3, 5, 11) * 3, torch.randn(3, 5)
    target = torch.randint(0, 11, (3, 5))
    if out_of_range:
        target[0, 1], target[2, 4] = -100, 11
    got = _loss_and_grad(lambda x: ce.vocab_parallel_cross_entropy(x, target, smoothing), logits, dy)
    want = _loss_and_grad(lambda x: ce._VocabParallelCrossEntropy.apply(x, target, smoothing, None), logits, dy)
    assert got[0].dtype == torch.float32 and got[0].shape == (3, 5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_log_probs_of_shared_rows_equal_the_expanded_rows():
    """``rows``: each of 4 logits rows normalized once for the 9 targets reading them gives the values of the rows
    expanded first, bit for bit on one rank, and the same gradient; mismatched shapes are refused."""
    torch.manual_seed(0)
    logits, dy = torch.randn(4, 11) * 3, torch.randn(3, 3)
    rows, target = torch.tensor([[0, 0, 1], [0, 2, 3], [0, 3, 3]]), torch.randint(0, 11, (3, 3))
    got = _loss_and_grad(lambda x: ce.vocab_parallel_log_probs(x, target, rows=rows), logits, dy)
    want = _loss_and_grad(lambda x: ce.vocab_parallel_log_probs(x[rows], target), logits, dy)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="must match target"):
        ce.vocab_parallel_log_probs(logits, target, rows=rows[:, :2])
