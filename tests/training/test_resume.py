"""Checkpoints: a run stopped by SIGTERM while an --async-save write is in flight, then resumed (again saving
asynchronously), reproduces the uninterrupted run exactly.

The uninterrupted run also passes --load with an empty directory, which must start from scratch.
"""

import os

import pytest

from megalite.checkpoint import CheckpointReader
from megalite.training.checkpointing import iteration_dir, read_latest
from megalite.testing import run_distributed
from tests.training.helpers import pretrain_on_rank, read_metrics, tiny_argv, train

DISTOPT_DP2 = ["--use-distributed-optimizer", "--eval-interval", "4", "--eval-iters", "1"]


def test_sigterm_save_and_resume_match_uninterrupted_run(tiny_data, tmp_path):
    tensorboard = str(tmp_path / "tb")
    _, full = train(tiny_data, tmp_path / "full", 2, *DISTOPT_DP2, "--load", str(tmp_path / "empty"),
                    "--tensorboard-dir", tensorboard, iters=8)
    save = str(tmp_path / "ckpt")

    stopped_at, first = _train_with_slow_async_save(tiny_data, tmp_path / "first", 2, *DISTOPT_DP2, "--save", save,
                                                    "--async-save", "--save-interval", "2", iters=8,
                                                    sigterm_in_iteration=3)
    assert stopped_at == 3
    assert read_latest(save) == 3 and os.path.isdir(iteration_dir(save, 2))
    assert {".metadata", "manifest.json", "megalite.json", "rank_00000.json", "rank_00001.json"} <= set(
        os.listdir(iteration_dir(save, 3)))
    reader = CheckpointReader(save)
    assert reader.state["consumed_samples"] == 24
    assert set(reader.rank_state(1)["rng"]) >= {"cpu", "python", "numpy", "tp_tracker"}

    finished_at, second = train(tiny_data, tmp_path / "second", 2, *DISTOPT_DP2, "--load", save, "--save", save,
                                "--async-save", "--save-interval", "2", iters=8)
    assert finished_at == 8 and read_latest(save) == 8
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert [r["iteration"] for r in second] == [4, 5, 6, 7, 8]
    for resumed, uninterrupted in zip(first + second, full):
        for key in ("loss", "lr", "grad_norm", "consumed_samples"):
            assert resumed[key] == uninterrupted[key], (resumed["iteration"], key)
        assert resumed.get("valid_loss") == uninterrupted.get("valid_loss")
    assert "valid_loss" in full[3] and "valid_ppl" in full[7]
    assert full[-1]["loss"] < full[0]["loss"]
    assert {"iteration", "loss", "lr", "grad_norm", "tokens_per_sec", "loss_scale"} <= set(full[0])
    _check_tensorboard(tensorboard, full)


def _slow_async_rank(argv, sigterm_in_iteration):
    """pretrain() whose checkpoint hashing takes a second, so the iteration-2 async save is still in flight
    when SIGTERM arrives in iteration 3; the SIGTERM save must wait for it."""
    import time

    from megalite.checkpoint import integrity

    real = integrity.file_digests

    def slow(path):
        time.sleep(0.5)
        return real(path)

    integrity.file_digests = slow
    return pretrain_on_rank(argv, sigterm_in_iteration)


def _train_with_slow_async_save(data, workdir, world_size, *extra, iters, sigterm_in_iteration):
    workdir.mkdir(parents=True, exist_ok=True)
    argv = tiny_argv(data, workdir, "--train-iters", str(iters), *extra)
    results = run_distributed(_slow_async_rank, world_size, argv, sigterm_in_iteration, timeout=180)
    return results[0], read_metrics(workdir / "metrics.jsonl")


def _check_tensorboard(directory, records):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "throughput/tokens_per_sec",
            "valid/loss", "valid/ppl"} <= tags
    assert {"memory/max_rss_gib", "memory/mem_allocated_gib"} & tags  # the CPU's or the GPU's peak
    assert [e.step for e in events.Scalars("train/loss")] == [r["iteration"] for r in records]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])

