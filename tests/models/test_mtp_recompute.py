"""Multi-token prediction under full recompute: each depth is recomputed in backward, and nothing changes.

The depths here end in an MoE layer with DeepSeek routing (the expert bias counts tokens) and dropout is on, so
the replay must draw the same masks and the routers must count each token once although they route it twice.
"""

from __future__ import annotations

import pytest
import torch

from megalite.models import GPTModel
from megalite.moe import MoEConfig, MoELayer
from tests.models.common import batch, config


def _step(method: str | None):
    """One training forward and backward: (per-token loss, MTP losses, grads, router counts, MTP layer calls)."""
    moe = MoEConfig(num_experts=4, ffn_hidden_size=16, topk=2, activation="swiglu", score_function="sigmoid",
                    enable_expert_bias=True, aux_loss_coeff=1e-2, init_method_std=0.5)
    cfg = config("llama", mtp_num_layers=2, mtp_loss_scaling_factor=0.3, hidden_dropout=0.1, moe=moe,
                 moe_layer_freq=[0, 1], recompute_granularity=None if method is None else "full",
                 recompute_method=method)
    model = GPTModel(cfg)
    calls = [0] * len(model.mtp.layers)
    for depth, layer in enumerate(model.mtp.layers):
        layer.register_forward_hook(lambda *_, depth=depth: calls.__setitem__(depth, calls[depth] + 1))
    ids, labels = batch(s=10)
    torch.manual_seed(1)
    per_token = model(ids, labels)
    per_token.mean().backward()
    counts = {name: m.router.tokens_since_update.clone() for name, m in model.named_modules()
              if isinstance(m, MoELayer)}
    grads = {name: p.grad for name, p in model.named_parameters()}
    return per_token.detach(), torch.stack(model.mtp.last_losses), grads, counts, calls


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_mtp_under_full_recompute_equals_no_recompute(method):
    loss, mtp, grads, counts, calls = _step(None)
    r_loss, r_mtp, r_grads, r_counts, r_calls = _step(method)
    assert calls == [1, 1] and r_calls == [2, 2], "each MTP depth runs once, and again in backward under recompute"
    torch.testing.assert_close(r_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(r_mtp, mtp, rtol=0, atol=0)
    assert sorted(counts) == ["decoder.layers.1.mlp", "mtp.layers.0.transformer_layer.mlp",
                              "mtp.layers.1.transformer_layer.mlp"]
    for name, count in counts.items():
        assert count.sum() == 2 * 10 * 2, name  # b * s tokens, top-2, counted once
        assert torch.equal(r_counts[name], count), name
    assert grads.keys() == r_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(r_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_flags_accept_mtp_with_full_recompute():
    from megalite.training.arguments import validate_args
    from megalite.training.flags import gpt_config, parse_args

    args = validate_args(parse_args(["--vocab-size", "64", "--num-layers", "2", "--mtp-num-layers", "1",
                                     "--recompute-granularity", "full", "--recompute-method", "block"]), 1)
    cfg = gpt_config(args)
    assert (cfg.mtp_num_layers, cfg.recompute_granularity, cfg.recompute_method) == (1, "full", "block")
