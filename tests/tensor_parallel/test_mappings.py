import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite import tensor_parallel as tpl
from megalite.testing import run_distributed
from megalite.topology import device

SHAPE = (4, 2, 8)


def _rand(seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(mapping, x, dy, **kwargs):
    x = x.detach().clone().to(device()).requires_grad_()
    y = mapping(x, **kwargs)
    y.backward(dy.to(device()))
    return y.detach().cpu(), x.grad.cpu()


def _all_mappings(tp):
    """Each mapping's forward and backward against the values every rank can compute alone."""
    topology.initialize(tp=tp)
    r = dist.get_rank()
    xs = [_rand(10 + i) for i in range(tp)]
    errors = {}

    def check(name, got, want):
        errors[name] = (got - want).abs().max().item() if got.shape == want.shape else float("inf")

    full_dys = [_rand(100 + i) for i in range(tp)]
    y, g = _run(tpl.copy_to_tensor_parallel_region, xs[0], full_dys[r])
    check("copy fwd", y, xs[0])
    check("copy bwd", g, sum(full_dys))

    y, g = _run(tpl.reduce_from_tensor_parallel_region, xs[r], full_dys[r])
    check("reduce fwd", y, sum(xs))
    check("reduce bwd", g, full_dys[r])

    last_dys = [d.chunk(tp, -1)[i] for i, d in enumerate(full_dys)]
    y, g = _run(tpl.scatter_to_tensor_parallel_region, xs[0], last_dys[r])
    check("scatter-last fwd", y, xs[0].chunk(tp, -1)[r])
    check("scatter-last bwd", g, torch.cat(last_dys, -1))

    y, g = _run(tpl.gather_from_tensor_parallel_region, xs[r].chunk(tp, -1)[0], full_dys[r])
    check("gather-last fwd", y, torch.cat([x.chunk(tp, -1)[0] for x in xs], -1))
    check("gather-last bwd", g, full_dys[r].chunk(tp, -1)[r])

    seq_dys = [d.chunk(tp, 0)[i] for i, d in enumerate(full_dys)]
    y, g = _run(tpl.scatter_to_sequence_parallel_region, xs[0], seq_dys[r])
    check("scatter-seq fwd", y, xs[0].chunk(tp, 0)[r])
    check("scatter-seq bwd", g, torch.cat(seq_dys, 0))

    shards = [x.chunk(tp, 0)[0] for x in xs]
    y, g = _run(tpl.gather_from_sequence_parallel_region, shards[r], full_dys[r])
    check("gather-seq fwd", y, torch.cat(shards, 0))
    check("gather-seq bwd reduce-scatter", g, sum(full_dys).chunk(tp, 0)[r])
    y, g = _run(tpl.gather_from_sequence_parallel_region, shards[r], full_dys[r], tensor_parallel_output_grad=False)
    check("gather-seq bwd split", g, full_dys[r].chunk(tp, 0)[r])

    y, g = _run(tpl.reduce_scatter_to_sequence_parallel_region, xs[r], seq_dys[r])
    check("reduce-scatter-seq fwd", y, sum(xs).chunk(tp, 0)[r])
    check("reduce-scatter-seq bwd", g, torch.cat(seq_dys, 0))
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_and_backward(tp):
    for rank, errors in enumerate(run_distributed(_all_mappings, tp, tp, timeout=180)):
        assert len(errors) == 15
        for name, err in errors.items():
            assert err <= 1e-6, (rank, name, err)


def test_no_group_is_identity():
    x = torch.randn(4, 4)
    for fn in (tpl.copy_to_tensor_parallel_region, tpl.reduce_from_tensor_parallel_region,
               tpl.scatter_to_tensor_parallel_region, tpl.gather_from_tensor_parallel_region,
               tpl.scatter_to_sequence_parallel_region, tpl.gather_from_sequence_parallel_region,
               tpl.reduce_scatter_to_sequence_parallel_region):
        assert fn(x) is x
