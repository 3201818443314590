"""Prefix-shared preference rows (the prompt once, then chosen, then rejected as two branches of one document)
give the losses, rewards and gradients of the unshared rows (prompt twice): on one rank through the dense
attention and the tiles, and at tp=2 and cp=2 (ring attention over the branched rows) against one rank; so do
they for a sliding-window model, whose window measures distance along each sequence, not along the row."""

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import prepare_batch, reset_position_ids
from megalite.context_parallel.sequence_split import BRANCH, sequence_positions
from megalite.rlhf.preference import PreferenceConfig, completion_pair, pack_pair, pack_shared_pair, pair_log_probs
from megalite.testing import run_distributed
from tests.models.common import full_to_shard
from tests.rlhf.test_preference import _batch, _grads, _models, _packed

# The second and third pairs' completions start alike, so the shared prefix runs past the prompt.
PAIRS = [([5, 6, 7], [8, 9, 10, 11], [12, 13]), ([20, 21], [22, 23, 24], [22, 23, 25, 26, 27]),
         ([30, 31, 32, 33, 34], [35, 36], [35, 38, 39])]
CONFIGS = [PreferenceConfig("dpo", beta=0.3, label_smoothing=0.2), PreferenceConfig("ipo", beta=0.7),
           PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.4)]


def _rows(pack):
    return _batch(PAIRS, pack)


def _losses(model, ref_model, cfg, pack, cp_group=None):
    return _packed(model, ref_model, cfg, cp_group, PAIRS, pack)


def test_shared_row_layout():
    """Pair 2: prompt [20, 21] and the completions' shared start [22, 23]; the last shared token (23) opens both
    branches, and rejected's positions continue from the trunk."""
    tokens, mask, docs = pack_shared_pair(*completion_pair(*PAIRS[1]), 12, 0)
    assert tokens.tolist() == [20, 21, 22, 23, 24, 23, 25, 26, 27, 0, 0, 0, 0]
    assert mask.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert docs.tolist() == [0, 0, 0] + [BRANCH] * 2 + [2 * BRANCH] * 4 + [1] * 4
    assert reset_position_ids(docs[None])[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 3]
    # A window measures rejected's distance to the trunk as in its sequence: chosen's 2 tokens between do not count.
    assert sequence_positions(docs[None])[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 9, 10, 11, 12]
    batch = prepare_batch(tokens[None], assistant_mask=mask[None], documents=docs[None])
    # Labels counted: 22, 23 (trunk), 24 (chosen), 25, 26, 27 (rejected); not 23 again nor across branches.
    assert batch["loss_mask"][0].tolist() == [0, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="needs 9 tokens \\(the shared prefix once, then chosen and rejected\\), "
                                         "more than --seq-length \\+ 1 = 8"):
        pack_shared_pair(*completion_pair(*PAIRS[1]), 7, 0)


@pytest.mark.parametrize("window", [None, 2], ids=["full", "window2"])
@pytest.mark.parametrize("tile", [None, 4], ids=["dense", "tiled"])
def test_shared_equals_unshared(tile, window, monkeypatch):
    """Losses, rewards and every gradient of shared rows equal the unshared rows' (dense path, and the tiles
    with tile pairs skipped and partial across the branches), also with a sliding window shorter than chosen's
    branch, so a rejected token is within the window of prompt tokens it lies farther than the window from in
    the row."""
    if tile is not None:
        import megalite.context_parallel.attention as attention

        monkeypatch.setattr(attention, "use_dense", lambda *a: False)
        monkeypatch.setattr(attention, "DEFAULT_TILE", tile)
        monkeypatch.setitem(attention.context_parallel_attention.__kwdefaults__, "tile", tile)
    model, ref_model = _models(window)
    if window is not None:  # the window changes the answer
        full = _losses(*_models(), CONFIGS[0], pack_pair)[0]
        assert (_losses(model, ref_model, CONFIGS[0], pack_pair)[0] - full).abs().max() > 1e-3
    for cfg in CONFIGS:
        want_losses, want_chosen, want_rejected = _losses(model, ref_model, cfg, pack_pair)
        want_grads = _grads(model, want_losses.mean())
        losses, chosen, rejected = _losses(model, ref_model, cfg, pack_shared_pair)
        grads = _grads(model, losses.mean())
        torch.testing.assert_close(losses.detach(), want_losses.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chosen, want_chosen, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rejected, want_rejected, rtol=1e-5, atol=1e-5)
        assert (chosen - rejected).abs().max() > 1e-3
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _rank_fn(cases):
    topo = topology.initialize(tp=2, cp=2)
    errors = []
    for window, cfg, want_losses, want_grads in cases:
        model, ref_model = _models(window)
        losses, _, _ = _losses(model, ref_model, cfg, pack_shared_pair, topo.cp.group)
        grads = _grads(model, losses.mean())
        params = dict(model.named_parameters())
        gpt_cfg = model.config
        for name, grad in grads.items():  # each CP rank holds its tokens' share of the gradient
            dist.all_reduce(grad, group=topo.cp.group)
        error = max((grads[n] - full_to_shard(n, g, params[n], gpt_cfg, topo.tp.rank, 2)).abs().max().item()
                    for n, g in want_grads.items())
        errors.append(((losses.detach() - want_losses).abs().max().item(), error))
    return errors


@pytest.mark.slow
def test_tp2_cp2_equal_one_rank():
    """Shared rows at tp=2 x cp=2 (vocab-parallel log-probs, ring attention over the branches) against one rank:
    the shared rows there, and with a sliding window the unshared rows (the window measured along each sequence
    in the tiles of every rank)."""
    cases = []
    for window, pack in ((None, pack_shared_pair), (2, pack_pair)):
        model, ref_model = _models(window)
        losses, _, _ = _losses(model, ref_model, CONFIGS[0], pack)
        cases.append((window, CONFIGS[0], losses.detach(), _grads(model, losses.mean())))
    for errors in run_distributed(_rank_fn, 4, cases, timeout=120):
        assert len(errors) == 2
        for loss_error, grad_error in errors:
            assert loss_error < 1e-5 and grad_error < 1e-5, (loss_error, grad_error)


def test_trim_is_exact():
    """The trainer's cut after the last labelled token (rounded up to 8) keeps every pair's sums and counts."""
    from megalite.rlhf.preference_training import trim

    model, _ = _models()
    tokens, mask, docs = _rows(pack_shared_pair)
    batch = prepare_batch(tokens, assistant_mask=mask, documents=docs)
    cut = trim(batch, 8)
    assert cut["tokens"].shape == cut["document_ids"].shape == cut["position_ids"].shape == (len(PAIRS), 16)
    assert cut["loss_normalizer"] is batch["loss_normalizer"]

    def sums(b):
        log_probs = -model(b["tokens"], b["labels"], position_ids=b["position_ids"], document_ids=b["document_ids"])
        return torch.stack(pair_log_probs(log_probs, b["loss_mask"], b["document_ids"]))

    torch.testing.assert_close(sums(cut), sums(batch), rtol=1e-6, atol=1e-6)


def test_shared_prefix_ends_where_an_id_or_a_mask_value_first_differs():
    """The shared start ends at the first column where any sequence's id or mask value differs (or the shortest
    sequence ends); DPO's layout keeps its last token in the branches, ``label_split=False`` in the trunk."""
    from megalite.rlhf.preference import shared_prefix

    ids_differ = [([1, 2, 3, 4], [0, 0, 1, 1]), ([1, 2, 3, 5], [0, 0, 1, 1]), ([1, 2, 3], [0, 0, 1])]
    mask_differs = [([1, 2, 3, 4], [0, 0, 1, 1]), ([1, 2, 3, 4], [0, 1, 1, 1])]
    assert shared_prefix(ids_differ)[3] == 2 and shared_prefix(ids_differ, label_split=False)[3] == 3
    assert shared_prefix(mask_differs)[3] == 0 and shared_prefix(mask_differs, label_split=False)[3] == 1
    tokens, mask, docs, trunk = shared_prefix(mask_differs, label_split=False)
    assert tokens == [1, 2, 3, 4, 2, 3, 4] and mask == [0, 0, 1, 1, 1, 1, 1] and docs[:1] == [0]
