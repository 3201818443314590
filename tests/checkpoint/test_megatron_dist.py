"""Megatron-LM torch_dist checkpoints, written by Megatron-Core at tp=2 x pp=2, load into megalite at other layouts.

The save directory is built once per module by Megatron-Core itself (:mod:`tests.checkpoint.megatron_fixture`).
megalite's logits, loaded at tp=1 (``load_model``) and at tp=2, equal Megatron-Core's own (its
``dist_checkpointing.load`` into a tp=1 model) on the same tokens.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")

from megalite.testing import run_distributed  # noqa: E402
from tests.checkpoint import megatron_fixture  # noqa: E402

IDS = torch.arange(2 * 12).reshape(2, 12).mul(7).remainder(90)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(save directory, Megatron-Core's logits of IDS over the real vocabulary)``."""
    path = str(tmp_path_factory.mktemp("megatron") / "save")
    os.makedirs(path)
    return path, megatron_fixture.write_checkpoint(path, IDS)[..., :90]


@pytest.fixture(scope="module")
def megatron_dir(saved):
    return saved[0]


@pytest.fixture(scope="module")
def reference(saved):
    return saved[1]


def _close(actual, expected):
    assert actual.shape == expected.shape
    rel = (actual - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-5, f"relative difference {rel.item():.3g}"


def _tp_logits(path, tp):
    from megalite import checkpoint, topology
    from megalite.models import GPTModel
    from megalite.tensor_parallel import gather_from_tensor_parallel_region

    topo = topology.initialize(tp=tp)
    config = checkpoint.read_checkpoint_info(path)["config"]
    model = GPTModel(config).eval()
    checkpoint.load_sharded(path, [model])
    with torch.no_grad():
        logits = gather_from_tensor_parallel_region(model(IDS), topo.tp.group)[..., :config.vocab_size]
    return logits.transpose(0, 1) if logits.shape[0] != IDS.shape[0] else logits


@pytest.mark.slow
def test_load_model_equals_megatron(megatron_dir, reference):
    from megalite.checkpoint import load_model, read_checkpoint_info

    info = read_checkpoint_info(megatron_dir)
    assert info["iteration"] == megatron_fixture.ITERATION
    config = info["config"]
    assert (config.vocab_size, config.num_layers, config.num_query_groups, config.activation,
            config.position_embedding_type, config.normalization) == (90, 4, 2, "swiglu", "rope", "RMSNorm")
    with torch.no_grad():
        logits = load_model(megatron_dir)(IDS)
    _close(logits, reference)


@pytest.mark.slow
def test_tp2_load_equals_megatron(megatron_dir, reference):
    logits = run_distributed(_tp_logits, 2, megatron_dir, 2, timeout=120)
    for rank_logits in logits:
        _close(rank_logits, reference)
