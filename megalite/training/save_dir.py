"""Safety of the ``--save`` directory, checked before the first iteration.

- **One writer.** :class:`SaveDirLock` holds an exclusive ``flock`` on ``SAVE/.megalite.lock`` for
  the whole run (a TrainingService holds it on its ``checkpoint_dir``).  The kernel drops the lock
  when its holder dies, however it dies, so a killed job can never leave it stuck; a second job on
  the same directory fails at once, naming the holder.  (flock works on local file systems and on most cluster file systems; on NFS it may be advisory
  only per host.)
- **No silent overwrite.** :func:`check_not_overwriting` refuses a ``--save`` directory that already
  holds another run's checkpoints which this run did not load (the ``--save X --load X`` habit with a
  typo in ``--load``), unless ``--override-existing-checkpoints``.  Both take the names their caller
  knows these settings by (:class:`DirNames`), so the service's errors name its own arguments.
- **Room.** :func:`check_writable_with_room` creates the directory, writes a probe file, and
  compares the free space with an estimate of one checkpoint (:func:`checkpoint_bytes`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.checkpoint.files import LOCK_NAME, WRITE_PROBE
from megalite.checkpoint.locate import find_checkpoint
from megalite.training.checkpointing import read_latest



@dataclass(frozen=True)
class DirNames:
    """How the caller's user names the save directory, the load source and the override."""

    save: str = "--save"
    load: str = "--load"
    override: str = "--override-existing-checkpoints"


FLAGS = DirNames()


class SaveDirLock:
    """An exclusive, non-blocking flock on ``save_dir``'s lock file; the file names the holder."""

    def __init__(self, save_dir: str, names: DirNames = FLAGS):
        path = os.path.join(save_dir, LOCK_NAME)
        self._file = open(path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "an unknown process"
            self._file.close()
            raise ValueError(f"{names.save} {save_dir} is in use by another job ({holder}); only one job may write a "
                             f"save directory at a time") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def check_not_overwriting(save_dir: str, load_dir: str | None, loaded_iteration: int, override: bool,
                          names: DirNames = FLAGS) -> str | None:
    """Refuse to write over checkpoints in ``save_dir`` that this run did not load (from ``save_dir`` itself or
    one of its iteration directories: a run that resumes from ``SAVE/iter_N`` continues ``SAVE``).

    Returns a warning to print when ``override`` lets it through, else None; raises ValueError.
    """
    latest = read_latest(save_dir)
    if latest is None:
        return None
    loaded = find_checkpoint(load_dir) if load_dir is not None and loaded_iteration else None
    loaded_it = loaded is not None and os.path.realpath(os.path.dirname(loaded)) == os.path.realpath(save_dir)
    if loaded_it:
        return None
    if load_dir is None:
        why = f"no {names.load} was given"
    elif loaded_iteration:
        why = f"it loaded iteration {loaded_iteration} from {names.load} {load_dir}"
    else:
        why = f"{names.load} {load_dir} holds no checkpoint"
    if override:
        return (f"warning: {names.save} {save_dir} holds another run's checkpoints (latest iteration {latest}) and "
                f"{why}; writing over them ({names.override})")
    raise ValueError(f"{names.save} {save_dir} already holds another run's checkpoints (latest iteration {latest}) "
                     f"that this run did not load: {why}. Pass {names.load} {save_dir} to continue that run, choose "
                     f"another {names.save}, or pass {names.override} to write over them")


def checkpoint_bytes(model_chunks, dp_size: int, group=None) -> int:
    """An upper estimate of one checkpoint's size over all ranks (collective over ``group``, default: the default
    group).

    Weights are written once per model-parallel shard, plus three fp32 tensors per weight for
    the optimizer (main copy, two Adam moments); each DP replica counts 1/dp of its shard.
    """
    local = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            local += p.numel() * (p.element_size() + 12)
    total = torch.tensor([local / dp_size], dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=group)
    return int(total.item() * 1.05) + (1 << 20)


def check_writable_with_room(save_dir: str, needed_bytes: int) -> None:
    """ValueError unless ``save_dir`` can be created and written and has ``needed_bytes`` free."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=WRITE_PROBE) as probe:
            probe.write(b"megalite")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        raise ValueError(f"--save {save_dir} is not writable: {err.strerror or err}") from None
    free = shutil.disk_usage(save_dir).free
    if free < needed_bytes:
        raise ValueError(f"--save {save_dir} has {_size(free)} free, but one checkpoint needs about "
                         f"{_size(needed_bytes)}")


def _size(count: int) -> str:
    return f"{count / 2 ** 30:.2f} GiB" if count >= 2 ** 30 else f"{count / 2 ** 20:.1f} MiB"
