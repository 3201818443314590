"""Every load path reads only verified regular files of the checkpoint directory, and agrees on what a
checkpoint directory is.

Covers (issue 42, round two): a ``.metadata`` whose ``relative_path`` points at another run's data file or
at an unlisted file; FIFOs where a checkpoint file should be (refused, never waited on); ``--load
RUN/iter_N``; a damaged ``latest`` (the error names the newest verified iteration).
"""

import dataclasses
import os
import pickle
import shutil

import pytest
import torch

from megalite.checkpoint import load_model, load_sharded, save_sharded
from megalite.checkpoint.files import LOCK_NAME, WANDB_DIR, WRITE_PROBE
from megalite.checkpoint.locate import find_checkpoint
from megalite.testing import run_distributed
from megalite.training.checkpointing import checkpoint_info, load_checkpoint, save_checkpoint
from megalite.training.save_dir import check_not_overwriting
from tests.checkpoint.test_bad_input import load_tp2_error, small_gpt, rehash, flip_byte
from tests.run_once import run_once

IDS = torch.arange(6).view(1, 6)


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS)


def point_metadata_at(directory, relative):
    """Rewrite ``.metadata`` so every chunk lives in ``relative``, and update the manifest to match."""
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=relative)
                             for index, info in metadata.storage_data.items()}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    rehash(directory, ".metadata")


def load_alone(path):
    from megalite.inference import LLM

    errors = []
    for load in (load_model, LLM, lambda p: load_sharded(p, [small_gpt(seed=99)])):
        try:
            load(path)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def _refused_everywhere(path, match):
    """Every load path (alone: load_model, LLM, load_sharded; two tp ranks together, as a resume) refuses ``path`` with ``match``,
    within a minute (a blocking open of a FIFO would hang instead)."""
    for error in run_distributed(load_alone, 1, path, timeout=60)[0]:
        assert error is not None and match in error, error
    for error, unchanged in run_distributed(load_tp2_error, 2, path, timeout=60):
        assert error is not None and match in error and unchanged, error


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the same architecture and file sizes with different weights."""
    root = tmp_path_factory.mktemp("runs")
    mine, other = str(root / "mine"), str(root / "other")
    save_sharded(mine, 1, [small_gpt()])
    save_sharded(other, 1, [small_gpt(seed=3)])
    assert not torch.equal(_logits(load_model(mine)), _logits(load_model(other)))
    return mine, other


def _copy(runs, tmp_path, name):
    save = str(tmp_path / name)
    shutil.copytree(runs[0], save)
    return save, os.path.join(save, "iter_0000001")


def test_metadata_pointing_at_another_runs_data_file_is_refused_on_every_path(runs, tmp_path):
    save, directory = _copy(runs, tmp_path, "decoy")
    decoy = os.path.relpath(os.path.join(runs[1], "iter_0000001", "__0_0.distcp"), directory)
    assert os.path.getsize(os.path.join(directory, decoy)) == os.path.getsize(os.path.join(directory, "__0_0.distcp"))
    point_metadata_at(directory, decoy)
    _refused_everywhere(save, "which is not a data file of this directory listed in its manifest.json")


def test_metadata_pointing_at_an_unlisted_file_of_the_directory_is_refused(runs, tmp_path):
    save, directory = _copy(runs, tmp_path, "unlisted")
    shutil.copy(os.path.join(runs[1], "iter_0000001", "__0_0.distcp"), os.path.join(directory, "__1_0.distcp"))
    point_metadata_at(directory, "__1_0.distcp")
    _refused_everywhere(save, "'__1_0.distcp', which is not a data file of this directory listed")


def test_fifos_are_refused_not_waited_on(runs, tmp_path):
    save, directory = _copy(runs, tmp_path, "fifo_named")
    os.mkfifo(os.path.join(directory, "__7_0.distcp"))
    point_metadata_at(directory, "__7_0.distcp")
    _refused_everywhere(save, "'__7_0.distcp', which is not a data file")

    for name in ("__0_0.distcp", ".metadata", "megalite.json", "manifest.json"):
        save, directory = _copy(runs, tmp_path, f"fifo_{name}")
        os.remove(os.path.join(directory, name))
        os.mkfifo(os.path.join(directory, name))
        _refused_everywhere(save, f"{name} is not a regular file")

    save, _ = _copy(runs, tmp_path, "fifo_latest")
    os.remove(os.path.join(save, "latest"))
    os.mkfifo(os.path.join(save, "latest"))
    _refused_everywhere(save, "latest is not a regular file")


def test_a_symlink_out_of_the_directory_is_refused(runs, tmp_path):
    save, directory = _copy(runs, tmp_path, "symlink")
    shard = os.path.join(directory, "__0_0.distcp")
    os.remove(shard)
    os.symlink(os.path.join(runs[1], "iter_0000001", "__0_0.distcp"), shard)
    _refused_everywhere(save, "__0_0.distcp is not a regular file")


def test_a_manifest_entry_outside_the_directory_is_refused(runs, tmp_path):
    import json

    save, directory = _copy(runs, tmp_path, "manifest_escape")
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"]["../../other/iter_0000001/__0_0.distcp"] = manifest["files"]["__0_0.distcp"]
    with open(path, "w") as f:
        json.dump(manifest, f)
    _refused_everywhere(save, "which is not a file name inside the checkpoint directory")


def test_an_iteration_directory_is_a_checkpoint_for_every_entry_point(tmp_path):
    save = str(tmp_path / "run")
    for iteration, seed in ((1, 5), (2, 6), (3, 7)):
        save_checkpoint(save, iteration, [small_gpt(seed=seed)], None, None, consumed_samples=8 * iteration)
    second = os.path.join(save, "iter_0000002")
    assert find_checkpoint(save) == os.path.join(save, "iter_0000003") and find_checkpoint(second) == second
    assert find_checkpoint(str(tmp_path / "absent")) is None and find_checkpoint(str(tmp_path / "run" / "absent")) is None
    # A directory that holds something, but no checkpoint, is an error naming what it holds (no fresh start).
    with pytest.raises(ValueError, match=f"{tmp_path} holds run, but no checkpoint"):
        find_checkpoint(str(tmp_path))
    assert checkpoint_info(second)["iteration"] == 2
    restored = small_gpt(seed=99)
    assert load_checkpoint(second, [restored], None, None)[:2] == (2, 16)
    assert torch.equal(_logits(restored), _logits(small_gpt(seed=6)))
    assert torch.equal(_logits(load_model(second)), _logits(small_gpt(seed=6)))
    # Resuming from one of SAVE's iteration directories continues SAVE: saving there is no overwrite.
    assert check_not_overwriting(save, second, 2, False) is None
    assert check_not_overwriting(save, save, 3, False) is None
    with pytest.raises(ValueError, match="holds no checkpoint"):
        check_not_overwriting(save, str(tmp_path / "elsewhere"), 0, False)


@pytest.mark.parametrize("pointer", ["-1", "garbage", "9"])
def test_a_damaged_latest_names_the_newest_verified_iteration(tmp_path, pointer):
    save = str(tmp_path / "run")
    for iteration in (4, 5):
        save_sharded(save, iteration, [small_gpt(seed=iteration)])
    with open(os.path.join(save, "latest"), "w") as f:
        f.write(pointer)
    newest = os.path.join(save, "iter_0000005")
    hint = f"the newest verified checkpoint is iteration 5: load it by its directory (--load {newest})"
    for load in (load_model, lambda p: load_checkpoint(p, [small_gpt()], None, None), checkpoint_info):
        with pytest.raises(ValueError) as err:
            load(save)
        assert hint in str(err.value)
    assert torch.equal(_logits(load_model(newest)), _logits(small_gpt(seed=5)))

    shard = os.path.join(newest, "__0_0.distcp")
    flip_byte(shard, os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match="the newest verified checkpoint is iteration 4"):
        load_model(save)
    os.remove(os.path.join(save, "latest"))
    with pytest.raises(ValueError, match="holds iteration directories but no latest pointer; the newest verified "
                                         "checkpoint is iteration 4"):
        load_model(save)


@run_once
def resume_from_an_iteration_directory(run) -> tuple[str, int, str, str, int]:
    """Train 3 of 4 iterations (``--exit-interval 3``) saving each into ``run``, then resume the same schedule with
    ``--load RUN/iter_0000002 --save RUN`` to iteration 4.  Returns the iteration directory, the resumed run's last
    iteration, its stdout and stderr, and the iteration ``run``'s ``latest`` names afterwards."""
    from tests.training.test_megatron_flags import TINY, run_on_rank

    # Both runs have the same --train-iters: it sets the LR schedule's length, which a resume must not change.
    schedule = TINY + ["--train-iters", "4", "--save", str(run)]
    first = schedule + ["--save-interval", "1", "--exit-interval", "3"]
    assert run_distributed(run_on_rank, 1, first, False, timeout=240)[0][0] == 3
    second = os.path.join(run, "iter_0000002")
    resume = schedule + ["--load", second]
    iteration, out, err, _ = run_distributed(run_on_rank, 1, resume, False, timeout=240)[0]
    return second, iteration, out, err, checkpoint_info(str(run))["iteration"]


def test_the_trainer_resumes_from_an_iteration_directory_and_saves_on_into_its_run(tmp_path):
    """``--load RUN/iter_0000002 --save RUN`` loads iteration 2 (not "no checkpoint, from scratch") and may save
    into RUN, whose iterations it continues."""
    second, iteration, out, err, latest = resume_from_an_iteration_directory(tmp_path / "run")
    assert iteration == 4 and "holds no checkpoint" not in err
    assert f"loaded checkpoint {second} at iteration 2" in out
    assert latest == 4


def test_a_directory_with_files_but_no_checkpoint_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "iter_0000001.tmp").mkdir()  # an interrupted megalite save counts as nothing
    with pytest.raises(ValueError, match=f"{tmp_path} holds notes.txt, but no checkpoint"):
        load_model(str(tmp_path))
    os.remove(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="holds no checkpoint: it is empty"):
        load_model(str(tmp_path))


def test_a_run_killed_before_its_first_save_leaves_nothing_to_load(tmp_path):
    """The lock file and W&B folder a run puts in its save directory are not "files but no checkpoint": a
    supervisor's restart with the same ``--load`` starts afresh instead of stopping with exit 2."""
    (tmp_path / LOCK_NAME).write_text("pid 1")
    (tmp_path / WANDB_DIR).mkdir()
    (tmp_path / "iter_0000001.tmp").mkdir()
    assert find_checkpoint(str(tmp_path)) is None
    (tmp_path / f"{WRITE_PROBE}abc123").write_text("")  # rank 0's writability probe, seen by other ranks
    assert find_checkpoint(str(tmp_path)) is None
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path} holds notes.txt, but no checkpoint"):
        find_checkpoint(str(tmp_path))


@pytest.mark.parametrize("rank_dir", ["mp_rank_00", "mp_rank_01_002", "mp_rank_00_000_001"])
def test_every_megatron_legacy_rank_directory_names_a_legacy_checkpoint(tmp_path, rank_dir):
    """tp only, tp and pp (or ep), and tp, pp and ep suffixes: each is Megatron-LM's legacy layout (the one rank
    directory pattern the legacy reader uses too)."""
    from megalite.checkpoint.locate import checkpoint_format

    (tmp_path / rank_dir).mkdir()
    assert checkpoint_format(str(tmp_path)) == "megatron_legacy"
