import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import topology
from megalite.tensor_parallel import RNGStatesTracker, get_rng_tracker, model_parallel_seed, recompute
from megalite.tensor_parallel.random import get_device_states, set_device_states
from megalite.testing import run_distributed
from megalite.topology import device

from ._blocks import ParallelAttention, ParallelMLP
from ._util import max_err


def test_fork_uses_and_advances_named_state_only():
    tracker = RNGStatesTracker()
    torch.manual_seed(1)
    tracker.add("a", 123)
    default_draw = torch.rand(3)
    torch.manual_seed(1)
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), default_draw)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(123)))
    assert not torch.equal(first, second)
    saved = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), third)


def test_tracker_rejects_duplicates_and_unknown_names():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    for call, message in ((lambda: tracker.add("a", 2), "'a' already exists"),
                          (lambda: tracker.add("b", 1), "seed 1 is already used"),
                          (lambda: tracker.fork("c").__enter__(), "'c' was never added")):
        try:
            call()
        except ValueError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"no ValueError for {message}")


def _seeding():
    topology.initialize(tp=2)
    model_parallel_seed(42, topology.current().tp.rank)
    default = torch.rand(4)
    with get_rng_tracker().fork():
        parallel = torch.rand(4)
    dist.barrier()  # no rank tears down its groups while another is still connecting them
    return default, parallel


def test_model_parallel_seed_differs_only_inside_fork():
    (d0, p0), (d1, p1) = run_distributed(_seeding, 2, timeout=180)
    assert torch.equal(d0, d1)
    assert not torch.equal(p0, p1)
    torch.manual_seed(42)
    assert torch.equal(d0, torch.rand(4))


def _train_step(blocks, x, dy, use_recompute):
    x = x.clone().requires_grad_()
    y = x
    for blk in blocks:
        y = recompute(blk, y) if use_recompute else blk(y)
    y.backward(dy)
    return [y.detach()] + [x.grad] + [p.grad.clone() for blk in blocks for p in blk.parameters()]


def _recompute_parity(sp):
    topology.initialize(tp=2)
    group, rank = topology.current().tp.group, topology.current().tp.rank
    model_parallel_seed(3, rank)
    torch.manual_seed(3)
    blocks = [ParallelAttention(16, 4, 2, group, sp, dropout=0.3).to(device()),
              ParallelMLP(16, group, sp, dropout=0.3).to(device())]
    x, dy = torch.randn(4 // (2 if sp else 1), 2, 16), torch.randn(4 // (2 if sp else 1), 2, 16)
    x, dy = x.to(device()), dy.to(device())
    start = get_device_states(), get_rng_tracker().get_states()
    plain = _train_step(blocks, x, dy, use_recompute=False)
    for blk in blocks:
        blk.zero_grad(set_to_none=True)
    set_device_states(start[0])
    get_rng_tracker().set_states(start[1])
    recomputed = _train_step(blocks, x, dy, use_recompute=True)
    for blk in blocks:
        blk.eval()
    no_dropout = blocks[1](blocks[0](x))
    errors = {f"tensor {i}": max_err(a, b) for i, (a, b) in enumerate(zip(plain, recomputed))}
    errors["dropout active"] = float(max_err(plain[0], no_dropout) < 0.1 * no_dropout.abs().max().item())
    return errors


def test_recompute_replays_dropout_under_tp():
    for sp in (False, True):
        for rank, errors in enumerate(run_distributed(_recompute_parity, 2, sp, timeout=180)):
            assert len(errors) == 2 + 8 + 4 + 1
            assert all(v <= 1e-6 for v in errors.values()), (sp, rank, errors)
