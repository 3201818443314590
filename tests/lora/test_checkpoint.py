"""Adapter-only checkpoints load on top of the base under another layout; merging keeps the output."""

import pytest
import torch

from megalite import topology
from megalite.checkpoint import CheckpointReader
from megalite.lora import LoRAConfig, apply_lora
from megalite.lora.state import (adapter_layouts, global_adapters, load_adapters, load_global_adapters,
                                 read_adapter_checkpoint, save_adapters)
from megalite.models.gpt import GPTModel
from megalite.testing import run_distributed
from tests.lora.test_adapters import _config, _random_b, _tokens

LORA = LoRAConfig(rank=4, alpha=8)


def _save_at_tp2(save_dir):
    """Adapters with random B on a tp=2 model, saved; returns the per-token loss, adapted and merged."""
    single = apply_lora(GPTModel(_config()), LORA)
    tensors = _random_b(single)
    topology.initialize(tp=2)
    model = GPTModel(_config())
    lora = apply_lora(model, LORA)
    load_global_adapters(lora, tensors)
    save_adapters(save_dir, 3, lora)
    tokens = _tokens(5)[0]
    adapted = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).detach()
    lora.merge()
    return adapted, model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).detach()


@pytest.mark.slow
def test_adapters_saved_at_tp2_load_on_the_base_at_tp1(tmp_path):
    save_dir = str(tmp_path / "adapters")
    losses = run_distributed(_save_at_tp2, 2, save_dir, timeout=120)
    model = GPTModel(_config())
    lora = apply_lora(model, LORA)
    load_adapters(save_dir, lora)
    tokens = _tokens(5)[0]
    got = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).detach()
    for loss, merged in losses:
        assert torch.allclose(got, loss, rtol=1e-5, atol=0), (got - loss).abs().max()
        assert torch.allclose(merged, loss, rtol=1e-5, atol=0), (merged - loss).abs().max()
    # Adapters only: exactly the adapter tensors, with their global shapes, and no base weight.
    reader = CheckpointReader(save_dir)
    want = {name: gp.shape for name, _, gp in adapter_layouts(lora)}
    assert {name: tuple(shape) for name, shape in reader.shapes.items()} == want
    lora_config, base_config, tensors = read_adapter_checkpoint(save_dir)  # e.g. for export_peft
    assert (lora_config, base_config) == (LORA, _config())
    assert all(torch.equal(tensors[name], t) for name, t in global_adapters(lora).items())
    stored = sum(torch.Size(shape).numel() for shape in reader.shapes.values())
    assert stored == sum(p.numel() for p in lora.parameters()) < 0.2 * sum(p.numel() for p in model.parameters())


def test_adapter_checkpoint_with_other_settings_is_refused(tmp_path):
    lora = apply_lora(GPTModel(_config()), LORA)
    save_adapters(str(tmp_path / "a"), 1, lora)
    other = apply_lora(GPTModel(_config()), LoRAConfig(rank=2, alpha=8))
    with pytest.raises(ValueError, match="rank=4.*this run has rank=2"):
        load_adapters(str(tmp_path / "a"), other)


def test_merged_model_gives_the_adapted_output():
    model = GPTModel(_config())
    lora = apply_lora(model, LORA)
    load_global_adapters(lora, _random_b(lora))
    ids = _tokens(6)[0][:, :-1]
    base = GPTModel(_config())(input_ids=ids).detach()
    adapted = model(input_ids=ids).detach()
    assert (adapted - base).abs().max() > 1e-3  # the adapters change the output
    (merged,) = lora.merge()
    out = merged(input_ids=ids).detach()
    assert torch.allclose(out, adapted, rtol=1e-5, atol=1e-5), (out - adapted).abs().max()
    with pytest.raises(ValueError, match="already merged"):
        lora.merge()
