"""router_statistics gathers every MoE layer's last training micro-batch: mean losses, token counts, imbalance."""

import pytest
import torch

from megalite.models import GPTModel
from megalite.moe import MoELayer, router_statistics
from tests.moe.test_gpt_moe import _batch, _config


def test_router_statistics_of_one_rank_model():
    config = _config("llama")  # an MoE MLP in both layers
    model = GPTModel(config)
    assert router_statistics([model], config.num_layers, 4) == {}
    tokens, labels = _batch(0)
    model(tokens, labels=labels)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2
    stats = router_statistics([model], config.num_layers, 4)
    counts = torch.tensor([layer.last_stats["tokens_per_expert"] for layer in layers], dtype=torch.float64)
    assert counts.sum() == 2 * tokens.numel() * config.moe.topk
    assert stats["moe_aux_loss"] == pytest.approx(sum(float(l.last_stats["aux_loss"]) for l in layers) / 2)
    assert stats["moe_z_loss"] == pytest.approx(sum(float(l.last_stats["z_loss"]) for l in layers) / 2)
    assert [stats[f"moe_tokens_expert_{e}"] for e in range(4)] == counts.sum(0).int().tolist()
    imbalance = (counts.max(1).values / counts.mean(1)).mean().item()
    assert stats["moe_load_imbalance"] == pytest.approx(imbalance)
