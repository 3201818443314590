"""The names of a checkpoint's files, the ``latest`` pointer, and the plain-JSON state helpers.

Layout under a save directory::

    latest                        the newest verified iteration, as text
    iter_0000100/.metadata        DCP: every global tensor's shape, dtype and saved chunks
    iter_0000100/__0_0.distcp     DCP: the chunks rank 0 wrote (one file per writing rank)
    iter_0000100/megalite.json    format tag, iteration, world size and rank 0's state (config, layout, ...)
    iter_0000100/rank_00000.json  each rank's own state (RNG streams), plain JSON
    iter_0000100/manifest.json    size of every other file and the sha256 of each of its blocks

How tensors are stored is :mod:`megalite.checkpoint.storage` (read back without unpickling:
:mod:`megalite.checkpoint.stored_chunks`); the manifest, :mod:`megalite.checkpoint.integrity`; writing and
publishing, :mod:`megalite.checkpoint.writer`; reading, :mod:`megalite.checkpoint.reader`.  Nothing is
pickled by megalite: state is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

FORMAT = "megalite"
FORMAT_VERSION = 4
LATEST = "latest"
MANIFEST = "manifest.json"
META = "megalite.json"
DCP_METADATA = ".metadata"
LOCK_NAME = ".megalite.lock"
"""The lock file a run holds in its save directory (``training.save_dir.SaveDirLock``)."""
WANDB_DIR = "wandb"
"""Where W&B writes under ``--save`` when ``--wandb-save-dir`` is not given (as Megatron-LM)."""
WRITE_PROBE = ".write_probe"
"""Prefix of the temporary file rank 0 writes to check ``--save`` is writable (``training.save_dir``)."""
RUN_FILES = (LOCK_NAME, WANDB_DIR)


def is_run_file(name: str) -> bool:
    """Whether ``name`` in a save directory is something a run puts there besides checkpoints (its lock, W&B
    folder, write probe, partial ``*.tmp`` saves): a directory holding only these holds no checkpoint yet, as
    at the start of a run (other ranks may look while rank 0 probes) or after one killed before its first save."""
    return name in RUN_FILES or name.startswith(WRITE_PROBE) or name.endswith(".tmp")


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def rank_state_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.json")


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, value, sync: bool = True) -> None:
    with open(path, "w") as f:
        json.dump(value, f, allow_nan=True)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def check_jsonable(value, what: str) -> None:
    """ValueError when ``value`` is not plain JSON data (dicts, lists, strings, numbers, booleans, None)."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be plain JSON data: {err}") from None


def open_regular(path: str, what: str = "checkpoint file"):
    """``path`` opened for binary reading; ValueError unless it is a regular file (not a link, FIFO or device).

    The open never blocks (a FIFO would wait for a writer forever) and never follows a symbolic link out of
    the checkpoint directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{what} {path} is missing") from None
    except OSError as err:
        if os.path.islink(path):
            raise ValueError(f"{what} {path} is a symbolic link, not a regular file") from None
        raise ValueError(f"{what} {path} is unreadable: {err.strerror or err}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{what} {path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def is_regular(path: str) -> bool:
    """Whether ``path`` is a regular file itself (a symbolic link is not, whatever it points at)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_pointer(path: str, what: str) -> str | None:
    """The stripped text of a small pointer file (``latest``, Megatron-LM's tracker), or None when it is absent."""
    if not os.path.lexists(path):
        return None
    with open_regular(path, what) as f:
        return f.read(64).decode(errors="replace").strip()


def read_latest(save_dir: str) -> int | None:
    """The iteration named by ``save_dir/latest``, or None when there is none."""
    pointer = os.path.join(save_dir, LATEST)
    text = read_pointer(pointer, "checkpoint pointer")
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"checkpoint pointer {pointer} is corrupt: {text[:40]!r} is not an iteration number")
    return int(text)


def read_json(path: str, what: str):
    try:
        with open_regular(path, what) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is unreadable (truncated or corrupt): {err}") from None


def fresh_output(output: str) -> str:
    """A temporary sibling of ``output`` for a converter to write into; ValueError when ``output`` exists and is
    not empty (a converter never overwrites)."""
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ValueError(f"output {output} already exists and is not empty; refusing to overwrite it")
    tmp = output.rstrip(os.sep) + ".converting"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    return tmp


def move_into_place(tmp: str, output: str) -> None:
    """Publish a converter's finished ``tmp`` directory (:func:`fresh_output`) as ``output``."""
    if os.path.isdir(output):
        os.rmdir(output)
    os.rename(tmp, output)
