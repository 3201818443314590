"""Single-rank MoE layer: expert paths agree with a per-token loop, dropless routing, config validation."""

import pytest
import torch
import torch.nn.functional as F

from megalite.moe import MoEConfig, MoELayer
from megalite.moe.experts import grouped_mm_usable

T = 12


def _naive(layer, x):
    """Every token through its top-k experts one at a time, weighted by the combine weights."""
    config, ex = layer.config, layer.experts
    routing = layer.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(config.topk):
            e = int(routing.indices[t, slot])
            if e < 0:
                continue
            hidden = F.linear(x[t], ex.fc1_weight[e], None if ex.fc1_bias is None else ex.fc1_bias[e])
            if config.activation == "swiglu":
                gate, up = hidden.chunk(2)
                hidden = F.silu(gate) * up
            else:
                hidden = F.gelu(hidden, approximate="tanh" if config.activation == "gelu_tanh" else "none")
            y = F.linear(hidden, ex.fc2_weight[e], None if ex.fc2_bias is None else ex.fc2_bias[e])
            out[t] += routing.probs[t, slot] * y
    return out


@pytest.mark.parametrize("hidden", [8, 6])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swiglu"])
def test_expert_paths_match_per_token_loop(activation, hidden):
    """Loop path, grouped path (torch.grouped_mm at h=8, padded bmm at h=6) and the naive loop agree."""
    results = []
    for grouped in (False, True):
        torch.manual_seed(0)
        config = MoEConfig(num_experts=4, ffn_hidden_size=8, topk=2, activation=activation, add_bias=True,
                           grouped_gemm=grouped, init_method_std=0.5)
        layer = MoELayer(hidden, config)
        with torch.no_grad():
            layer.experts.fc1_bias.normal_(0.0, 0.5)
            layer.experts.fc2_bias.normal_(0.0, 0.5)
        x = torch.randn(T, 1, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = layer(x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        expected = _naive(layer, x.detach().view(T, hidden))
        assert (out.view(T, hidden) - expected).abs().max() <= 1e-5
        results.append([out, x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-5, (a - b).abs().max()
    weight_t = layer.experts.fc1_weight.transpose(1, 2)
    assert grouped_mm_usable(torch.zeros(T, hidden), weight_t) == (hidden % 4 == 0)


def test_dropless_keeps_every_token_with_unit_weights():
    torch.manual_seed(0)
    config = MoEConfig(num_experts=8, ffn_hidden_size=8, topk=3, init_method_std=0.5)
    layer = MoELayer(8, config)
    x = torch.randn(T * 4, 8, generator=torch.Generator().manual_seed(2))
    routing = layer.router(x)
    assert bool((routing.indices >= 0).all()) and routing.dropped == 0
    assert (routing.probs.sum(-1) - 1).abs().max() <= 1e-6
    assert sum(routing.tokens_per_expert) == x.shape[0] * 3
    assert all(len(set(row)) == 3 for row in routing.indices.tolist())
    assert (layer(x.view(-1, 1, 8)).view(-1, 8) - _naive(layer, x)).abs().max() <= 1e-5


def test_same_seed_same_model():
    config = MoEConfig(num_experts=4, ffn_hidden_size=8)
    torch.manual_seed(5)
    a = MoELayer(8, config)
    torch.manual_seed(5)
    b = MoELayer(8, config)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert all(p.expert_parallel for p in a.experts.parameters())
    assert not getattr(a.router.weight, "expert_parallel", False)


@pytest.mark.parametrize("kwargs, ep, message", [
    (dict(num_experts=6), 4, "num_experts 6 is not divisible by the expert-parallel size 4"),
    (dict(num_experts=4, topk=5), 1, "topk 5 exceeds num_experts 4"),
    (dict(num_experts=4, activation="relu"), 1, "activation must be one of"),
    (dict(num_experts=4, dispatcher="ring"), 1, "dispatcher must be one of"),
    (dict(num_experts=4, capacity_factor=0.0), 1, "capacity_factor must be positive or None, got 0.0"),
    (dict(num_experts=0), 1, "num_experts must be a positive integer, got 0"),
    (dict(num_experts=4, shared_expert_gate=True), 1, r"shared_expert_gate needs a shared expert"),
    (dict(num_experts=4, shared_expert_intermediate_size=0), 1,
     "shared_expert_intermediate_size must be a positive integer or None, got 0"),
])
def test_bad_config(kwargs, ep, message):
    config = MoEConfig(ffn_hidden_size=8, **kwargs)
    with pytest.raises(ValueError, match=message):
        config.validate(ep)


def test_bad_input_width():
    layer = MoELayer(8, MoEConfig(num_experts=2, ffn_hidden_size=8))
    with pytest.raises(ValueError, match=r"hidden size 6, expected 8"):
        layer(torch.zeros(4, 1, 6))


def test_a_shared_expert_size_needs_its_module():
    with pytest.raises(ValueError, match="needs a shared_experts module exactly when it is set"):
        MoELayer(8, MoEConfig(num_experts=2, ffn_hidden_size=8, shared_expert_intermediate_size=8))
