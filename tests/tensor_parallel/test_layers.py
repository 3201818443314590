import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalite.testing import run_distributed
from megalite.topology import device

from ._util import assert_all_small, block, master, max_err

S, B = 4, 2


def _column_case(group, sp, bias_mode, gather, overlap, errors):
    tp, r = topology.group_size(group), topology.group_rank(group)
    name = f"col sp={sp} bias={bias_mode} gather={gather} overlap={overlap}"
    hin, hout = 8, 16
    torch.manual_seed(7)
    layer = ColumnParallelLinear(hin, hout, bias=bias_mode != "none", gather_output=gather,
                                 skip_bias_add=bias_mode == "skip", sequence_parallel=sp, tp_group=group,
                                 async_grad_allreduce=overlap, device=device())
    ref = nn.Linear(hin, hout, bias=bias_mode != "none")
    with torch.no_grad():
        ref.weight.copy_(master((hout, hin), 7))
        if ref.bias is not None:
            ref.bias.copy_(torch.randn(hout))
            layer.bias.copy_(block(ref.bias, 0, r, tp))
    x, dy = torch.randn(S, B, hin), torch.randn(S, B, hout)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy)

    x_in = (block(x, 0, r, tp) if sp else x).clone().to(device()).requires_grad_()
    out = layer(x_in)
    if bias_mode == "skip":
        out, bias = out
        assert gather or bias is layer.bias
        y = out + bias
    else:
        y = out
    want_y, dy_local = (y_ref, dy) if gather else (block(y_ref, -1, r, tp), block(dy, -1, r, tp))
    y.backward(dy_local.to(device()))
    errors[name + " out"] = max_err(y, want_y)
    errors[name + " dx"] = max_err(x_in.grad, block(x_ref.grad, 0, r, tp) if sp else x_ref.grad)
    errors[name + " dw"] = max_err(layer.weight.grad, block(ref.weight.grad, 0, r, tp))
    if ref.bias is not None:
        errors[name + " db"] = max_err(layer.bias.grad, block(ref.bias.grad, 0, r, tp))


def _row_case(group, sp, bias_mode, input_is_parallel, errors):
    tp, r = topology.group_size(group), topology.group_rank(group)
    name = f"row sp={sp} bias={bias_mode} input_is_parallel={input_is_parallel}"
    hin, hout = 16, 8
    torch.manual_seed(8)
    layer = RowParallelLinear(hin, hout, bias=bias_mode != "none", input_is_parallel=input_is_parallel,
                              skip_bias_add=bias_mode == "skip", sequence_parallel=sp, tp_group=group,
                              device=device())
    ref = nn.Linear(hin, hout, bias=bias_mode != "none")
    with torch.no_grad():
        ref.weight.copy_(master((hout, hin), 8))
        if ref.bias is not None:
            ref.bias.copy_(torch.randn(hout))
            layer.bias.copy_(ref.bias)
    x, dy = torch.randn(S, B, hin), torch.randn(S, B, hout)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy)

    x_in = (block(x, -1, r, tp) if input_is_parallel else x).clone().to(device()).requires_grad_()
    y = layer(x_in)
    if bias_mode == "skip":
        y, bias = y
        assert bias is layer.bias
        y = y + bias
    want_y, dy_local = (block(y_ref, 0, r, tp), block(dy, 0, r, tp)) if sp else (y_ref, dy)
    y.backward(dy_local.to(device()))
    errors[name + " out"] = max_err(y, want_y)
    errors[name + " dx"] = max_err(x_in.grad, block(x_ref.grad, -1, r, tp) if input_is_parallel else x_ref.grad)
    errors[name + " dw"] = max_err(layer.weight.grad, block(ref.weight.grad, 1, r, tp))
    if ref.bias is not None:
        grad = layer.bias.grad.clone()
        if getattr(layer.bias, "sequence_parallel", False):
            dist.all_reduce(grad, group=group)
        errors[name + " db"] = max_err(grad, ref.bias.grad)


def _tied_output_case(group, errors):
    """An output layer reusing the word-embedding shard as its weight."""
    tp, r = topology.group_size(group), topology.group_rank(group)
    vocab, h = 16, 8
    torch.manual_seed(9)
    embedding = VocabParallelEmbedding(vocab, h, tp_group=group, device=device())
    head = ColumnParallelLinear(h, vocab, bias=False, tp_group=group, device=device())
    ref_weight = master((vocab, h), 9).requires_grad_()
    x, dy = torch.randn(S, B, h), torch.randn(S, B, vocab)
    x_ref = x.clone().requires_grad_()
    y_ref = F.linear(x_ref, ref_weight)
    y_ref.backward(dy)
    x_in = x.clone().to(device()).requires_grad_()
    y = head(x_in, weight=embedding.weight)
    y.backward(block(dy, -1, r, tp).to(device()))
    errors["tied out"] = max_err(y, block(y_ref, -1, r, tp))
    errors["tied dx"] = max_err(x_in.grad, x_ref.grad)
    errors["tied dw"] = max_err(embedding.weight.grad, block(ref_weight.grad, 0, r, tp))
    errors["tied head weight unused"] = float(head.weight.grad is not None)


def _linear_parity(tp):
    topology.initialize(tp=tp)
    group = topology.current().tp.group
    errors = {}
    for sp, bias_mode, gather, overlap in itertools.product((False, True), ("bias", "skip", "none"),
                                                            (False, True), (True, False)):
        if not (sp and gather):
            _column_case(group, sp, bias_mode, gather, overlap, errors)
    for sp, bias_mode, input_is_parallel in itertools.product((False, True), ("bias", "skip", "none"),
                                                              (True, False)):
        if not (sp and not input_is_parallel):
            _row_case(group, sp, bias_mode, input_is_parallel, errors)
    _tied_output_case(group, errors)
    return errors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_linear_parity(tp):
    col = sum(4 if b != "none" else 3 for sp, b, g, o in itertools.product(
        (False, True), ("bias", "skip", "none"), (False, True), (True, False)) if not (sp and g))
    row = sum(4 if b != "none" else 3 for sp, b, i in itertools.product(
        (False, True), ("bias", "skip", "none"), (True, False)) if not (sp and not i))
    assert_all_small(run_distributed(_linear_parity, tp, tp, timeout=180), col + row + 4)


def _shard_attributes():
    topology.initialize(tp=2)
    col = ColumnParallelLinear(4, 6)
    row = RowParallelLinear(6, 4, sequence_parallel=True)
    plain_row = RowParallelLinear(6, 4)
    dist.barrier()  # no rank tears down its groups while another is still connecting them
    return dict(
        col_w=(col.weight.tensor_model_parallel, col.weight.partition_dim, tuple(col.weight.shape)),
        col_b=(col.bias.tensor_model_parallel, col.bias.partition_dim, tuple(col.bias.shape)),
        row_w=(row.weight.tensor_model_parallel, row.weight.partition_dim, tuple(row.weight.shape)),
        row_b=(getattr(row.bias, "tensor_model_parallel", False), row.bias.sequence_parallel, tuple(row.bias.shape)),
        plain_row_b=getattr(plain_row.bias, "sequence_parallel", False),
        sizes=(col.tp_size, col.tp_rank, row.tp_size, row.tp_rank),
        rank=dist.get_rank(),
    )


def test_parameter_attributes():
    for out in run_distributed(_shard_attributes, 2, timeout=180):
        assert out["col_w"] == (True, 0, (3, 4))
        assert out["col_b"] == (True, 0, (3,))
        assert out["row_w"] == (True, 1, (4, 3))
        assert out["row_b"] == (False, True, (4,))
        assert out["plain_row_b"] is False
        assert out["sizes"] == (2, out["rank"], 2, out["rank"])


def test_single_process_is_plain_linear():
    torch.manual_seed(3)
    col = ColumnParallelLinear(5, 7)
    row = RowParallelLinear(7, 5, input_is_parallel=False)
    x = torch.randn(3, 5)
    assert col.tp_size == 1 and col.tp_group is None
    assert torch.equal(col(x), F.linear(x, master((7, 5), 3), torch.zeros(7)))
    assert torch.equal(row(col(x)), F.linear(col(x), row.weight, row.bias))
