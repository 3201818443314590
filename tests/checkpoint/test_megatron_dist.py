"""Megatron-LM torch_dist checkpoints, written by Megatron-Core at tp=2 x pp=2, load into megalite at other layouts.

The save directory is built once per module by Megatron-Core itself (:mod:`tests.checkpoint.megatron_fixture`).
megalite's logits, loaded at tp=1 (``load_model``), at tp=2, and after converting to megalite, equal
Megatron-Core's own (its ``dist_checkpointing.load`` into a tp=1 model) on the same tokens, as do Megatron-Core's
after converting back (``--to megatron``).  ``pretrain --load`` resumes at the saved iteration; a missing shard
file and a contradicting architecture are one clear error each.
"""

import os
import shutil

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")
pytestmark = pytest.mark.slow  # Megatron-Core writes the module's save directory from 4 ranks (~30 s)

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


def test_load_model_equals_megatron(megatron_dir, reference):
    from megalite.checkpoint import load_model, read_checkpoint_info

    info = read_checkpoint_info(megatron_dir)
    assert info["iteration"] == megatron_fixture.ITERATION
    config = info["config"]
    assert (config.vocab_size, config.num_layers, config.num_query_groups, config.activation,
            config.position_embedding_type, config.normalization, config.qk_layernorm) == \
        (90, 4, 2, "swiglu", "rope", "RMSNorm", True)
    with torch.no_grad():
        logits = load_model(megatron_dir)(IDS)
    _close(logits, reference)


def test_tp2_load_equals_megatron(megatron_dir, reference):
    logits = run_distributed(_tp_logits, 2, megatron_dir, 2, timeout=120)
    for rank_logits in logits:
        _close(rank_logits, reference)


def test_inspect_lists_megalite_names(megatron_dir):
    from megalite.checkpoint.__main__ import describe

    text = describe(megatron_dir)
    assert f"checkpoint {megatron_dir}/iter_0000003" in text and "iteration 3, written by 4 rank(s)" in text
    assert "format: Megatron-LM torch_dist" in text and "tp=2, pp=2" in text
    assert "decoder.layers.3.mlp.linear_fc1.weight" in text and "128x32" in text
    assert "decoder.layers.0.input_layernorm.weight" in text and "embedding.word_embeddings.weight" in text
    assert "decoder.layers.2.self_attention.k_layernorm.weight" in text  # stacked in Megatron's file
    assert "90x32" in text  # the real vocabulary, without Megatron's padding rows


def _trainer_resumes(path, metrics):
    import contextlib
    import io

    from megalite.training import gpt, pretrain

    argv = ["--load", path, "--use-checkpoint-args", "--tensor-model-parallel-size", "2", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "4",
            "--weight-decay", "0.01", "--metrics-file", metrics,
            "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0", "--mock-data", "--split", "100,0,0"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        iteration = pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.forward_step, argv=argv)
    return iteration, out.getvalue()


def test_pretrain_load_resumes_the_megatron_run(megatron_dir, tmp_path):
    """At the saved iteration, the data position and Megatron's LR schedule (its OptimizerParamScheduler state)."""
    import json

    metrics = str(tmp_path / "metrics.jsonl")
    (iteration, out), _ = run_distributed(_trainer_resumes, 2, megatron_dir, metrics, timeout=180)
    path = megatron_dir
    records = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in records] == [4]
    megatron = megatron_fixture.megatron_scheduler(3)
    assert records[0]["lr"] == pytest.approx(megatron.get_lr(megatron.optimizer.param_groups[0]), rel=1e-12)
    assert iteration == 4
    assert "architecture from checkpoint" in out and "--num-query-groups 2" in out and "--swiglu" in out
    assert f"loaded checkpoint {path} at iteration 3, layout" in out
    assert "iteration 4/4 |" in out and "iteration 3/4" not in out


def test_a_missing_shard_file_is_a_clear_error(megatron_dir, tmp_path):
    from megalite.checkpoint import load_model

    copy = str(tmp_path / "copy")
    shutil.copytree(megatron_dir, copy)
    os.remove(os.path.join(copy, "iter_0000003", "__1_0.distcp"))
    with pytest.raises(ValueError, match=r"is incomplete: shard file __1_0.distcp, named in its .metadata, is missing"):
        load_model(copy)


def test_a_contradicting_architecture_is_a_clear_error(megatron_dir):
    from megalite.checkpoint import load_sharded, read_checkpoint_info
    from megalite.models import GPTModel

    config = read_checkpoint_info(megatron_dir)["config"]
    config.num_query_groups = 4
    with pytest.raises(ValueError, match="holds a different architecture: num_query_groups is 2 in the checkpoint "
                                         "but 4 in the model"):
        load_sharded(megatron_dir, [GPTModel(config)])


def test_convert_to_megalite_and_back_to_megatron(megatron_dir, reference, tmp_path):
    from megalite.checkpoint import load_model, read_checkpoint_info

    ours, theirs = str(tmp_path / "megalite"), str(tmp_path / "megatron")
    assert megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", megatron_dir,
                                    "--output", ours) == 0
    assert read_checkpoint_info(ours)["iteration"] == megatron_fixture.ITERATION
    with torch.no_grad():
        _close(load_model(ours)(IDS), reference)
    # Back to Megatron-LM's layout, read by Megatron-Core's own dist_checkpointing.load.
    assert megatron_fixture.convert("--from", "megalite", "--to", "megatron", "--input", ours,
                                    "--output", theirs) == 0
    assert open(os.path.join(theirs, "latest_checkpointed_iteration.txt")).read() == "3"
    logits = run_distributed(megatron_fixture.megatron_logits, 1, theirs, IDS, timeout=120)[0]
    _close(logits[..., :90], reference)
    with pytest.raises(ValueError, match="already exists and is not empty"):
        megatron_fixture.convert("--from", "megatron", "--to", "megalite", "--input", megatron_dir, "--output", ours)


def test_a_megalite_save_into_the_megatron_directory_is_loaded_next(megatron_dir, tmp_path):
    """A megalite run that resumed the Megatron run and saved into the same directory resumes from its own save."""
    from megalite.checkpoint import load_model, save_sharded
    from megalite.checkpoint.locate import find_checkpoint

    copy = str(tmp_path / "copy")
    shutil.copytree(megatron_dir, copy)
    model = load_model(copy)
    assert find_checkpoint(copy) == os.path.join(copy, "iter_0000003")
    save_sharded(copy, 5, [model])
    assert find_checkpoint(copy) == os.path.join(copy, "iter_0000005")
    with torch.no_grad():
        assert torch.equal(load_model(copy)(IDS), model(IDS))
