"""The names of a checkpoint's files, the ``latest`` pointer, and the plain-JSON state helpers.

Layout under a save directory::

    latest                        the newest verified iteration, as text
    iter_0000100/.metadata        DCP: every global tensor's shape, dtype and saved chunks
    iter_0000100/__0_0.distcp     DCP: the chunks rank 0 wrote (one file per writing rank)
    iter_0000100/megalite.json    format tag, iteration, world size and rank 0's state (config, layout, ...)
    iter_0000100/rank_00000.json  each rank's own state (RNG streams), plain JSON
    iter_0000100/manifest.json    size of every other file and the sha256 of each of its blocks

How tensors are stored is :mod:`megalite.checkpoint.storage`; the manifest,
:mod:`megalite.checkpoint.integrity`; writing and publishing, :mod:`megalite.checkpoint.writer`;
reading, :mod:`megalite.checkpoint.reader`.  Nothing is pickled by megalite: state is JSON.
"""

from __future__ import annotations

import json
import os

FORMAT = "megalite"
FORMAT_VERSION = 4
LATEST = "latest"
MANIFEST = "manifest.json"
META = "megalite.json"
DCP_METADATA = ".metadata"


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


def read_latest(save_dir: str) -> int | None:
    """The iteration named by ``save_dir/latest``, or None when there is none."""
    pointer = os.path.join(save_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint pointer {pointer} is corrupt: {text[:40]!r} is not an iteration number")
    return int(text)


def resolve_directory(path: str) -> str:
    """The iteration directory of ``path``: a save directory (its ``latest``) or an iteration directory."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    iteration = read_latest(path)
    if iteration is None:
        if not os.path.isfile(os.path.join(path, MANIFEST)) and not os.path.isfile(os.path.join(path, DCP_METADATA)):
            raise ValueError(f"{path} holds no checkpoint: no 'latest' file and no {MANIFEST}")
        return path
    directory = iteration_dir(path, iteration)
    if not os.path.isdir(directory):
        raise ValueError(f"{path}/latest names iteration {iteration}, but {directory} does not exist")
    return directory


def read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is unreadable (truncated or corrupt): {err}") from None
