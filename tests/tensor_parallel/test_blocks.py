import itertools

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.tensor_parallel import model_parallel_seed
from megalite.testing import run_distributed
from megalite.topology import device

from ._blocks import ParallelAttention, ParallelMLP, PlainAttention, PlainMLP, load_plain
from ._util import assert_all_small, block, max_err

H, S, B, HEADS, GROUPS = 16, 4, 2, 8, 4


def _parallel_grad(param, group):
    grad = param.grad.clone()
    if getattr(param, "sequence_parallel", False):
        dist.all_reduce(grad, group=group)
    return grad


def _compare_block(kind, group, sp, errors):
    tp, r = topology.group_size(group), topology.group_rank(group)
    plain = PlainMLP(H) if kind == "mlp" else PlainAttention(H, HEADS, GROUPS)
    torch.manual_seed(11)
    par = (ParallelMLP(H, group, sp) if kind == "mlp"
           else ParallelAttention(H, HEADS, GROUPS, group, sp)).to(device())
    load_plain(plain, 11)
    x, dy = torch.randn(S, B, H), torch.randn(S, B, H)
    x_ref = x.clone().requires_grad_()
    y_ref = plain(x_ref)
    y_ref.backward(dy)
    x_in = (block(x, 0, r, tp) if sp else x).clone().to(device()).requires_grad_()
    y = par(x_in)
    y.backward((block(dy, 0, r, tp) if sp else dy).to(device()))
    name = f"{kind} sp={sp}"
    errors[name + " out"] = max_err(y, block(y_ref, 0, r, tp) if sp else y_ref)
    errors[name + " dx"] = max_err(x_in.grad, block(x_ref.grad, 0, r, tp) if sp else x_ref.grad)
    ref_params = dict(plain.named_parameters())
    for pname, param in par.named_parameters():
        ref = ref_params[pname].grad
        if getattr(param, "tensor_model_parallel", False):
            ref = block(ref, param.partition_dim, r, tp)
        errors[f"{name} d{pname}"] = max_err(_parallel_grad(param, group), ref)


def _blocks_parity(tp):
    topology.initialize(tp=tp)
    model_parallel_seed(0, topology.current().tp.rank)
    errors = {}
    for kind, sp in itertools.product(("mlp", "attention"), (False, True)):
        _compare_block(kind, topology.current().tp.group, sp, errors)
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_and_attention_blocks_match_single_rank(tp):
    # mlp: out, dx, 4 params; attention: out, dx, 8 params; each with and without sequence parallelism.
    assert_all_small(run_distributed(_blocks_parity, tp, tp, timeout=180), 2 * (6 + 10))
