"""The scoring server over tensor collectives equals a local copy on every rank (GPT critic values,
teacher full logits and top-k), as does the replicated fallback; an exception in the owner's forward reaches every
rank as the same error, as does one rank's malformed request; prefetch overlaps the owner's work with the training step and records staleness; the
forward KL on the teacher's support is TP-parallel exact."""

import time

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.models import GPTModel
from megalite.rlhf import CriticModel
from megalite.rlhf.scoring_server import ScoringServer, Prefetcher
from megalite.rlhf.distillation import TeacherOutput, forward_kl, teacher_fn, teacher_rewards
from megalite.testing import run_distributed
from tests.rlhf.common import VOCAB, config, padded_prompts

CRITIC_SECONDS = 1.0


def _inputs(rank, step=0):
    """Rank-dependent rows and columns, so the transport pads and slices."""
    return padded_prompts(seed=20 + 10 * rank + step, b=2 + rank, p=5 + rank)


def _close(got: tuple, want: tuple, atol: float = 1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=0, atol=atol)
        else:
            assert torch.equal(g, w)


def _equal_rank(owner):
    rank = dist.get_rank()
    teacher, critic = GPTModel(config()).eval(), CriticModel(config()).eval()
    owns = rank == owner
    served = {
        "critic": (lambda ids, mask: critic(ids, mask)),
        "full": teacher_fn(teacher),
        "topk": teacher_fn(teacher, topk=4),
    }
    buffers_before = None
    for name, fn in served.items():
        central = ScoringServer(fn if owns else None, owner=owner)
        replicated = ScoringServer(fn, replicated=True)
        assert (central.model_fn is None) == (not owns)
        for step in range(2):
            ids, mask = _inputs(rank, step)
            with torch.no_grad():
                local = fn(ids, mask)
            local = local if isinstance(local, tuple) else (local,)
            _close(central(ids, mask), local)
            _close(replicated(ids, mask), local, atol=0)
            if step == 0:
                buffers_before = {k: v.data_ptr() for k, v in central._buffers.items()}
        # Same request sizes: every buffer was reused, none reallocated.
        assert {k: v.data_ptr() for k, v in central._buffers.items()} == buffers_before
        if name == "topk":
            out = TeacherOutput.from_outputs(central(*_inputs(rank)))
            assert out.indices.shape == out.log_probs.shape == (2 + rank, 5 + rank, 4)
            moved = central.bytes_received if not owns else central.bytes_sent
        central.close()
        replicated.close()
    return moved


@pytest.mark.parametrize("owner", [0, 1])
def test_served_equals_local_and_replicated_for_critic_logits_and_topk(owner):
    moved = run_distributed(_equal_rank, 2, owner, timeout=240)
    # Three requests of padded [3, 6] rows; top-k (fp32 values, int64 indices, fp32 token log-probs) per token.
    per_request = 3 * 6 * (4 * 4 + 4 * 8 + 4)
    assert moved[1 - owner] == 3 * per_request and moved[owner] == 3 * per_request


def _failing_rank(owner):
    rank = dist.get_rank()
    calls = []

    def fn(ids, mask):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError(f"injected failure on {ids.shape[0]} rows")
        return ids.float() * mask

    central = ScoringServer(fn if rank == owner else None, owner=owner)
    ids, mask = _inputs(rank)
    with pytest.raises(RuntimeError) as error:
        central(ids, mask)
    after = central(ids, mask)[0]
    assert torch.equal(after, ids.float() * mask)
    # One rank's malformed request is refused on every rank before any payload moves.
    bad_ids = ids[0] if rank == 2 else ids
    with pytest.raises(ValueError, match=r"invalid inputs on rank\(s\) \[2\]"):
        central(bad_ids, mask if rank != 2 else mask[0])
    assert torch.equal(central(ids, mask)[0], ids.float() * mask)
    central.close()
    return str(error.value)


def test_owner_exception_reaches_every_rank():
    messages = run_distributed(_failing_rank, 3, 1, timeout=180)
    assert messages == ["scoring server on rank 1 failed: ValueError: injected failure on 9 rows"] * 3


def _prefetch_rank(owner, slow):
    rank = dist.get_rank()
    critic = CriticModel(config()).eval()

    def fn(ids, mask):
        if slow:
            time.sleep(CRITIC_SECONDS)
        return critic(ids, mask)

    central = ScoringServer(fn if rank == owner else None, owner=owner)
    central.version = 3
    steps, received = [], []
    prefetcher = Prefetcher(central, [_inputs(rank, step) for step in range(3)], depth=1, current_version=lambda: 5)
    for batch, values in prefetcher:
        start = time.monotonic()
        time.sleep(CRITIC_SECONDS if slow else 0.0)
        steps.append((start, time.monotonic()))
        received.append((batch, values[0]))
    central.close()
    with torch.no_grad():
        for (ids, mask), values in received:
            torch.testing.assert_close(values, critic(ids, mask), rtol=0, atol=1e-5)
    return steps, central.intervals, prefetcher.staleness


def test_prefetch_overlaps_critic_with_training_step_and_records_staleness():
    results = run_distributed(_prefetch_rank, 2, 0, True, timeout=180)
    steps, critic, _ = results[0]
    # Batch i+1's critic work was issued before step i and must run during it.
    for i in range(2):
        step_start, step_end = steps[i]
        critic_start, critic_end = critic[i + 1]
        assert critic_start < step_end and step_start < critic_end, (steps, critic)
    # The owner served version 3; the caller used the results at version 5 (non-owners learn 3 from the header).
    assert [r[2] for r in results] == [[2, 2, 2]] * 2 and results[1][1] == []


def _kl_reference(logits, teacher):
    student = torch.log_softmax(logits, dim=-1)
    indices = teacher.indices if teacher.indices is not None else torch.arange(logits.shape[-1]).expand(logits.shape)
    support = torch.log_softmax(teacher.log_probs, dim=-1)
    return (support.exp() * (support - student.gather(-1, indices))).sum(-1)


def _distill_rank():
    topo = topology.initialize(tp=2)
    torch.manual_seed(0)
    logits = torch.randn(2, 5, VOCAB)
    teacher_logits = torch.randn(2, 5, VOCAB) * 2
    ids = torch.randint(0, VOCAB, (2, 5))
    full = TeacherOutput.from_outputs(teacher_fn(lambda i, attention_mask: teacher_logits)(ids, torch.ones_like(ids)))
    top = TeacherOutput.from_outputs(teacher_fn(lambda i, attention_mask: teacher_logits, topk=6)(ids,
                                                                                                 torch.ones_like(ids)))
    full_kl = (torch.log_softmax(teacher_logits, -1).exp()
               * (torch.log_softmax(teacher_logits, -1) - torch.log_softmax(logits, -1))).sum(-1)
    torch.testing.assert_close(_kl_reference(logits, full), full_kl, rtol=0, atol=1e-5)
    block = VOCAB // 2
    for teacher in (full, top):
        reference = logits.clone().requires_grad_()
        expected = _kl_reference(reference, teacher)
        expected.sum().backward()
        shard = logits[..., topo.tp.rank * block:(topo.tp.rank + 1) * block].clone().requires_grad_()
        got = forward_kl(shard, teacher, topo.tp.group)
        got.sum().backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(shard.grad, reference.grad[..., topo.tp.rank * block:(topo.tp.rank + 1) * block],
                                   rtol=0, atol=1e-6)
    mask = torch.ones(2, 4)
    expected_token = torch.log_softmax(teacher_logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(teacher_rewards(top, mask, 0.5), 0.5 * expected_token, rtol=0, atol=1e-6)
    return True


def test_forward_kl_on_teacher_support_tp2_equals_single_process():
    assert run_distributed(_distill_rank, 2, timeout=120) == [True, True]


def _bad_owner():
    ScoringServer(None, owner=5)


def test_bad_owner_raises():
    with pytest.raises(AssertionError, match="owner rank 5 is outside the world of 2"):
        run_distributed(_bad_owner, 2, timeout=60)
