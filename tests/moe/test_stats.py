"""router_statistics gathers every MoE layer's last training micro-batch: mean losses, token counts, imbalance."""

import pytest
import torch

from megalite.models import GPTModel
from megalite.moe import MoEConfig, MoELayer, router_statistics
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


def _biased_model_statistics():
    """A DeepSeek-routed two-layer model with known expert biases, after one training forward."""
    from tests.models.common import batch, config as gpt_config

    moe = MoEConfig(num_experts=8, ffn_hidden_size=16, topk=2, score_function="sigmoid", enable_expert_bias=True,
                    init_method_std=0.5)
    model = GPTModel(gpt_config("llama", moe=moe))
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    with torch.no_grad():
        for number, layer in enumerate(layers):
            layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.5, 8) * (number + 1))
    ids, labels = batch()
    model(ids, labels=labels)
    return model, layers, router_statistics([model], 2, 8)


def test_router_statistics_per_layer_imbalance_and_expert_bias_norm():
    _, layers, stats = _biased_model_statistics()
    for layer in layers:
        counts = torch.tensor(layer.last_stats["tokens_per_expert"], dtype=torch.float64)
        assert stats[f"moe_load_imbalance_layer_{layer.layer_number}"] == pytest.approx(
            (counts.max() / counts.mean()).item(), rel=1e-12)
        assert stats[f"moe_expert_bias_norm_layer_{layer.layer_number}"] == pytest.approx(
            torch.linalg.vector_norm(layer.router.expert_bias.double()).item(), rel=1e-12)
    assert stats[f"moe_load_imbalance_layer_{layers[0].layer_number}"] != stats[
        f"moe_load_imbalance_layer_{layers[1].layer_number}"], "the two layers' loads should differ"
    everything = torch.cat([layer.router.expert_bias.double() for layer in layers])
    assert stats["moe_expert_bias_norm"] == pytest.approx(torch.linalg.vector_norm(everything).item(), rel=1e-12)
    assert stats["moe_load_imbalance"] == pytest.approx(
        sum(stats[f"moe_load_imbalance_layer_{layer.layer_number}"] for layer in layers) / 2)


def test_router_statistics_reach_tensorboard_the_metrics_file_and_the_stdout_line(tmp_path):
    """What the trainer's logger writes, read back from each sink."""
    import io
    import json

    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from megalite.training.metrics import MetricsLogger

    _, _, stats = _biased_model_statistics()
    stream = io.StringIO()
    logger = MetricsLogger(True, str(tmp_path / "metrics.jsonl"), str(tmp_path / "tb"), 5, stream=stream)
    logger.log(3, {"loss": 1.0, **stats})
    logger.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: v for k, v in record.items() if k.startswith("moe_")} == stats
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for key in ("load_imbalance_layer_0", "load_imbalance_layer_1", "expert_bias_norm_layer_1", "expert_bias_norm",
                "tokens_expert_7"):
        (scalar,) = events.Scalars(f"moe/{key}")
        assert (scalar.step, scalar.value) == (3, pytest.approx(stats[f"moe_{key}"], rel=1e-6))
    line = stream.getvalue()
    assert f"moe_load_imbalance {stats['moe_load_imbalance']:.4f}" in line
    assert f"moe_expert_bias_norm {stats['moe_expert_bias_norm']:.4f}" in line
