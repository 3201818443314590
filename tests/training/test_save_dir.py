"""--save safety: a typo in --load never overwrites another run, a finished run rewrites nothing,
one job per save directory (a lock that dies with its holder), and a preflight of writability and room."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from megalite.testing import run_distributed
from megalite.training.checkpointing import read_latest
from megalite.training.save_dir import LOCK_NAME, SaveDirLock, check_writable_with_room
from tests.training.helpers import pretrain_on_rank, tiny_argv, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snapshot(directory):
    """Every file under ``directory`` with its content hash and modification time."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = (hashlib.sha256(f.read()).hexdigest(),
                                                           os.stat(path).st_mtime_ns)
    return files


def test_typo_load_finished_rerun_lock_and_override(tiny_data, tmp_path):
    save = str(tmp_path / "run")
    train(tiny_data, tmp_path / "first", 1, "--save", save, "--load", save, iters=3)
    assert read_latest(save) == 3
    before = _snapshot(save)

    with pytest.raises(AssertionError, match=(
            rf"ValueError: --save {save} already holds another run's checkpoints \(latest iteration 3\) that this "
            rf"run did not load: --load {tmp_path}/rnu holds no checkpoint. Pass --load {save} to continue")):
        train(tiny_data, tmp_path / "typo", 1, "--save", save, "--load", str(tmp_path / "rnu"), iters=6)
    assert _snapshot(save) == before

    finished = run_distributed(pretrain_on_rank, 1, tiny_argv(tiny_data, tmp_path / "again", "--train-iters", "3",
                                                              "--save", save, "--load", save))
    assert finished == [3]
    assert _snapshot(save) == before

    held = SaveDirLock(save)
    with pytest.raises(AssertionError, match=rf"--save {save} is in use by another job \(pid {os.getpid()} on "):
        train(tiny_data, tmp_path / "second", 1, "--save", save, "--load", save, "--override-opt-param-scheduler",
              iters=6)
    held.release()
    assert {k: v for k, v in _snapshot(save).items() if k != LOCK_NAME} == {
        k: v for k, v in before.items() if k != LOCK_NAME}

    train(tiny_data, tmp_path / "over", 1, "--save", save, "--override-existing-checkpoints", "--lr-warmup-iters", "0", iters=1)
    assert read_latest(save) == 1


def test_lock_is_exclusive_and_released_when_its_holder_dies(tmp_path):
    directory = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from megalite.training.save_dir import SaveDirLock\n"
                               "lock = SaveDirLock(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(120)",
                               directory], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"is in use by another job \(pid {holder.pid} on "):
            SaveDirLock(directory)
    finally:
        holder.kill()
        holder.wait()
    assert os.path.exists(os.path.join(directory, LOCK_NAME))
    SaveDirLock(directory).release()


def test_preflight_rejects_unwritable_or_full_save_dir(tiny_data, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(AssertionError, match=rf"ValueError: --save {blocker}/ckpt is not writable: Not a directory"):
        train(tiny_data, tmp_path / "w", 1, "--save", str(blocker / "ckpt"), iters=3)
    assert not (tmp_path / "w" / "metrics.jsonl").exists()
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"--save .* has [0-9.]+ [MG]iB free, but one checkpoint needs about [0-9.]+ [MG]iB"):
        check_writable_with_room(str(tmp_path / "full"), 2 * free)
