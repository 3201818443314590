"""Split backward: under a WeightGradStore the layers defer exactly their weight gradients."""

import torch

from megalite.moe import MoEConfig
from megalite.moe.experts import Experts
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, column_parallel_linear
from megalite.tensor_parallel.weight_grad import WeightGradStore, defer_weight_grads


def _layers():
    torch.manual_seed(0)
    column, row = ColumnParallelLinear(8, 12), RowParallelLinear(12, 8)
    experts = Experts(8, MoEConfig(num_experts=2, ffn_hidden_size=6), num_local=2, first=0)
    tied = torch.nn.Parameter(torch.randn(5, 8))
    return column, row, experts, tied


def _loss(layers, x):
    column, row, experts, tied = layers
    h = row(torch.tanh(column(x)))
    h = experts(h.reshape(-1, 8), [4, 2]).reshape(h.shape)
    return column_parallel_linear(h, tied).square().sum()


def test_weight_grads_wait_for_the_store_and_then_equal_a_plain_backward():
    x = torch.randn(3, 2, 8)
    plain = _layers()
    _loss(plain, x).backward()
    split = _layers()
    store = WeightGradStore()
    seen = []
    split[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    inp = x.clone().requires_grad_(True)
    with defer_weight_grads(store):
        loss = _loss(split, inp)
        loss.backward()
    weights = [split[0].weight, split[1].weight, split[2].fc1_weight, split[2].fc2_weight, split[3]]
    assert all(w.grad is None for w in weights) and len(store) == len(weights)
    assert split[0].bias.grad is not None and inp.grad is not None  # B computed the rest
    store.run()
    assert seen[-1] and len(store) == 0
    for a, b in zip(plain[:3], split[:3]):
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(split[3].grad, plain[3].grad, rtol=1e-6, atol=1e-6)
