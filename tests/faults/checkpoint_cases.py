"""Campaign cases on checkpoints: forged and corrupted directories, a damaged ``latest``, an edited field with a
consistent manifest, ``--load RUN/iter_N``, a full disk and a save killed mid-write.

Each load case runs every single-process load path (``load_model``, ``LLM``, ``load_sharded``); the two-rank
cases load together at tp=2, as a resume does.
"""

import os
import shutil

import torch

from megalite.checkpoint import load_model, read_latest, save_sharded
from megalite.testing import run_distributed
from megalite.training.checkpointing import load_checkpoint, save_checkpoint
from tests.checkpoint.test_bad_input import KILLED_SAVE, flip_byte, full_disk, kill_mid_write, load_tp2_error, small_gpt
from tests.checkpoint.test_edited_state import edit_state
from tests.checkpoint.test_load_paths import load_alone, point_metadata_at, resume_from_an_iteration_directory
from tests.faults.campaign import Case, in_scratch, outcome

LOAD_PATHS = ("load_model", "LLM", "load_sharded")
IDS = torch.arange(6).view(1, 6)


def _refused_alone(path, phrase: str) -> str:
    """``refused by every load path: PHRASE...`` (the rest of load_model's error) when each path's error holds
    ``phrase``, else what each other path did."""
    errors = load_alone(path)
    wrong = [f"{name}: {error or 'loaded it'}" for name, error in zip(LOAD_PATHS, errors)
             if error is None or phrase not in error]
    return "; ".join(wrong) or f"refused by every load path: {errors[0][errors[0].index(phrase):]}"


def _refused_by_two_ranks(path, phrase: str) -> str:
    """``both ranks refused, model unchanged: PHRASE...`` (the rest of rank 0's error) when both tp ranks' errors
    hold ``phrase``."""
    results = run_distributed(load_tp2_error, 2, path, timeout=120)
    wrong = [f"rank {rank}: {error or 'loaded it'}{'' if unchanged else ' (model changed)'}"
             for rank, (error, unchanged) in enumerate(results)
             if error is None or phrase not in error or not unchanged]
    first = results[0][0]
    return "; ".join(wrong) or f"both ranks refused, model unchanged: {first[first.index(phrase):]}"


def _run(scratch, seed=7) -> tuple[str, str]:
    """A save directory holding iteration 1 of a small model, and that iteration's directory."""
    save = str(scratch / f"run{seed}")
    save_sharded(save, 1, [small_gpt(seed=seed)])
    return save, os.path.join(save, "iter_0000001")


def _metadata_outside(scratch) -> str:
    """``.metadata`` points every chunk at another run's data file of the same size (manifest updated)."""
    save, directory = _run(scratch)
    _, other = _run(scratch, seed=3)
    point_metadata_at(directory, os.path.relpath(os.path.join(other, "__0_0.distcp"), directory))
    return save


def _metadata_unlisted(scratch) -> str:
    """``.metadata`` points at a data file planted in the directory but absent from the manifest."""
    save, directory = _run(scratch)
    _, other = _run(scratch, seed=3)
    shutil.copy(os.path.join(other, "__0_0.distcp"), os.path.join(directory, "__1_0.distcp"))
    point_metadata_at(directory, "__1_0.distcp")
    return save


def _fifo(scratch) -> str:
    """A FIFO in place of the data file: reading it would block forever."""
    save, directory = _run(scratch)
    os.remove(os.path.join(directory, "__0_0.distcp"))
    os.mkfifo(os.path.join(directory, "__0_0.distcp"))
    return save


def _flipped(scratch) -> str:
    save, directory = _run(scratch)
    shard = os.path.join(directory, "__0_0.distcp")
    flip_byte(shard, os.path.getsize(shard) // 2)
    return save


def _forged(make, phrase: str, ranks: int):
    check = _refused_alone if ranks == 1 else _refused_by_two_ranks
    return in_scratch(lambda scratch: check(make(scratch), phrase))


def _damaged_latest(scratch) -> str:
    save = str(scratch / "run")
    for iteration in (4, 5):
        save_sharded(save, iteration, [small_gpt(seed=iteration)])
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("garbage")
    return _refused_alone(save, "the newest verified checkpoint is iteration 5: load it by its directory")


def _edited_field(scratch) -> str:
    save, _ = _run(scratch)
    edited, _ = edit_state(save, scratch, "megalite.json", "iteration", -3)
    return _refused_alone(edited, "field 'iteration' is -3, not a count")


def _load_iteration_directory(scratch) -> str:
    """``RUN/iter_0000002`` is a checkpoint: the trainer's load restores iteration 2 and its weights."""
    save = str(scratch / "run")
    for iteration in (1, 2, 3):
        save_checkpoint(save, iteration, [small_gpt(seed=iteration)], None, None, consumed_samples=8 * iteration)
    second = os.path.join(save, "iter_0000002")
    restored = small_gpt(seed=99)
    iteration, consumed = load_checkpoint(second, [restored], None, None)[:2]
    with torch.no_grad():
        same = torch.equal(load_model(second)(IDS), small_gpt(seed=2).eval()(IDS))
        same = same and torch.equal(restored.eval()(IDS), small_gpt(seed=2).eval()(IDS))
    return f"loaded iteration {iteration} ({consumed} samples), {'its' if same else 'other'} weights"


def _trainer_resume(scratch) -> str:
    second, iteration, out, err, latest = resume_from_an_iteration_directory(scratch / "run")
    loaded = f"loaded checkpoint {second} at iteration 2" in out and "holds no checkpoint" not in err
    return f"{'resumed iteration 2' if loaded else 'did not resume: ' + err[-200:]}, trained to {iteration}, " \
           f"latest {latest}"


def _full_disk(scratch) -> str:
    save, _ = _run(scratch)
    with full_disk():
        observed = outcome(lambda: save_sharded(save, 2, [small_gpt(seed=3)]))
    return f"{observed.replace(save, 'RUN')}; latest {read_latest(save)}, dirs {sorted(os.listdir(save))}"


def _killed_save(scratch) -> str:
    save = str(scratch / "run")
    kill_mid_write(KILLED_SAVE, save)
    with torch.no_grad():
        same = torch.equal(load_model(save)(IDS), small_gpt().eval()(IDS))
    return f"latest {read_latest(save)}, {'iteration 1 loads' if same else 'other weights'}"


CASES = [
    Case(".metadata points outside (another run's file)", "refused by every load path: which is not a data file "
         "of this directory listed in its manifest.json",
         _forged(_metadata_outside, "which is not a data file of this directory listed in its manifest.json", 1),
         fast=True),
    Case(".metadata points at an unlisted file", "refused by every load path: '__1_0.distcp', which is not a data file",
         _forged(_metadata_unlisted, "'__1_0.distcp', which is not a data file", 1), fast=True),
    Case("FIFO in place of a data file", "refused by every load path: __0_0.distcp is not a regular file",
         _forged(_fifo, "__0_0.distcp is not a regular file", 1), fast=True),
    Case("flipped byte in a data file", "refused by every load path: __0_0.distcp fails its content hash check",
         _forged(_flipped, "__0_0.distcp fails its content hash check", 1), fast=True),
    Case("damaged latest", "refused by every load path: the newest verified checkpoint is iteration 5",
         in_scratch(_damaged_latest), fast=True),
    Case("edited field, consistent manifest", "refused by every load path: field 'iteration' is -3, not a count",
         in_scratch(_edited_field), fast=True),
    Case("load RUN/iter_N (in-process)", "loaded iteration 2 (16 samples), its weights",
         in_scratch(_load_iteration_directory), fast=True),
    Case("full disk during save", "CheckpointWriteError: saving iteration 2 to RUN failed: no space left on RUN "
         "(needed about 1 MiB); the partial iter_0000002.tmp was removed and latest still names iteration 1; "
         "latest 1, dirs ['iter_0000001', 'latest']", in_scratch(_full_disk), fast=True),
    Case("tp=2 resume: .metadata points outside", "both ranks refused, model unchanged: which is not a data file",
         _forged(_metadata_outside, "which is not a data file", 2)),
    Case("tp=2 resume: FIFO in place of a data file", "both ranks refused, model unchanged: __0_0.distcp is not a "
         "regular file", _forged(_fifo, "__0_0.distcp is not a regular file", 2)),
    Case("tp=2 resume: flipped byte", "both ranks refused, model unchanged: __0_0.distcp fails its content hash check",
         _forged(_flipped, "__0_0.distcp fails its content hash check", 2)),
    Case("trainer --load RUN/iter_N --save RUN", "resumed iteration 2, trained to 4, latest 4",
         in_scratch(_trainer_resume)),
    Case("save killed (kill -9) mid-write", "latest 1, iteration 1 loads", in_scratch(_killed_save)),
]
