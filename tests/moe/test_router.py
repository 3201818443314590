"""Router: pre- and post-softmax top-k, the aux and z losses against naive formulas, capacity dropping against a naive loop."""

import math

import pytest
import torch

from megalite.moe import MoEConfig, MoELayer, TopKRouter, capacity, set_aux_loss_scale

H, E, T = 8, 4, 24


def _router(**overrides):
    torch.manual_seed(0)
    config = MoEConfig(**{"num_experts": E, "ffn_hidden_size": 8, "init_method_std": 0.5, **overrides})
    return TopKRouter(H, config)


def _tokens():
    return torch.randn(T, H, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_pre_and_post_softmax_match_naive(pre_softmax):
    """Post-softmax (default): softmax of the top-k logits.  Pre-softmax: the top-k of the full softmax, as is."""
    router = _router(pre_softmax=pre_softmax, topk=2)
    x = _tokens()
    routing = router(x)
    logits = x @ router.weight.T
    for t in range(T):
        ranked = sorted(range(E), key=lambda e: -logits[t, e].item())[:2]
        assert routing.indices[t].tolist() == ranked
        if pre_softmax:
            full = [math.exp(logits[t, e].item()) for e in range(E)]
            weights = [full[e] / sum(full) for e in ranked]
        else:
            top = [math.exp(logits[t, e].item()) for e in ranked]
            weights = [w / sum(top) for w in top]
        assert routing.probs[t].tolist() == pytest.approx(weights, abs=1e-6)
    if not pre_softmax:
        assert torch.allclose(routing.probs.sum(-1), torch.ones(T), atol=1e-6)
    else:
        assert bool((routing.probs.sum(-1) < 1 - 1e-3).all())
    assert routing.dropped == 0


def _naive_losses(x, weight, topk):
    """Switch aux loss and z-loss written out over tokens and experts."""
    aux_sum, z_sum = 0.0, 0.0
    counts = [0] * E
    mean_prob = [0.0] * E
    for t in range(T):
        logits = [sum(x[t, i].item() * weight[e, i].item() for i in range(H)) for e in range(E)]
        denom = sum(math.exp(v) for v in logits)
        for e in range(E):
            mean_prob[e] += math.exp(logits[e]) / denom / T
        for e in sorted(range(E), key=lambda e: -logits[e])[:topk]:
            counts[e] += 1
        z_sum += math.log(denom) ** 2
    for e in range(E):
        aux_sum += counts[e] / (T * topk) * mean_prob[e]
    return E * aux_sum, z_sum / T, counts


def test_aux_and_z_losses_match_their_formulas():
    router = _router(topk=2, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    x = _tokens()
    routing = router(x)
    aux, z, counts = _naive_losses(x, router.weight.detach(), 2)
    assert routing.aux_loss == pytest.approx(aux, abs=1e-6)
    assert routing.z_loss == pytest.approx(z, abs=1e-5)
    assert routing.tokens_per_expert == counts
    assert routing.loss.item() == pytest.approx(0.3 * aux + 0.05 * z, abs=1e-5)


def test_router_losses_enter_backward_with_the_set_scale():
    """The layer's backward adds scale * d(coeff * loss) without the caller adding the loss."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=E, ffn_hidden_size=8, aux_loss_coeff=0.3, z_loss_coeff=0.05, init_method_std=0.5)
    layer = MoELayer(H, config)
    set_aux_loss_scale(layer, 0.5)
    x = _tokens().view(T, 1, H)
    g = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(4))
    (layer(x) * g).sum().backward()
    got = layer.router.weight.grad.clone()

    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    (layer(x) * g).sum().backward()
    main_only = layer.router.weight.grad.clone()
    weight = layer.router.weight.detach().clone().requires_grad_(True)
    logits = x.view(T, H) @ weight.T
    probs = torch.softmax(logits, -1)
    counts = torch.tensor(layer.last_stats["tokens_per_expert"], dtype=torch.float32)
    aux = E * (counts / (T * 2) * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    (0.5 * (0.3 * aux + 0.05 * z)).backward()
    assert (got - (main_only + weight.grad)).abs().max() <= 1e-5


def _naive_keep(probs, indices, limit, policy):
    """For each expert, the (token, slot) pairs it keeps, chosen by a plain loop."""
    kept = set()
    for e in range(E):
        pairs = [(t, s) for t in range(T) for s in range(indices.shape[1]) if indices[t, s] == e]
        if policy == "probs":
            pairs.sort(key=lambda p: -probs[p].item())
        kept.update(pairs[:limit])
    return kept


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_capacity_dropping_matches_naive(policy, factor):
    full = _router(topk=2)(_tokens())
    routing = _router(topk=2, capacity_factor=factor, token_drop_policy=policy)(_tokens())
    limit = capacity(T, E, 2, factor)
    assert limit == math.ceil(factor * T * 2 / E)
    expected = _naive_keep(full.probs, full.indices, limit, policy)
    got = {(t, s) for t in range(T) for s in range(2) if routing.indices[t, s] >= 0}
    assert got == expected
    assert routing.dropped == 2 * T - len(expected)
    for t, s in got:
        assert routing.indices[t, s] == full.indices[t, s] and routing.probs[t, s] == full.probs[t, s]
    dropped = routing.indices < 0
    assert bool((routing.probs[dropped] == 0).all())
    counts = torch.bincount(routing.indices[~dropped], minlength=E)
    assert int(counts.max()) <= limit
    if factor == 0.5:
        assert routing.dropped > 0


@pytest.mark.slow  # importing Megatron-Core's MoE utilities takes several seconds
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_routing_equals_megatron_core(pre_softmax):
    """--moe-router-pre-softmax and its default are Megatron-Core's own routing function's."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    router = _router(pre_softmax=pre_softmax, topk=2)
    x = _tokens()
    routing = router(x)
    probs, routed = moe_utils.topk_routing_with_score_function(x @ router.weight.detach().T, 2,
                                                                use_pre_softmax=pre_softmax)
    mine = torch.zeros(T, E).scatter_(1, routing.indices, routing.probs.detach())
    assert torch.equal(mine > 0, routed.bool())
    assert (mine - probs).abs().max() <= 1e-6
