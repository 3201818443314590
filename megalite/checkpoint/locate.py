"""Which checkpoint a path names: the one notion of "a checkpoint directory" for every entry point.

A path names a checkpoint when it is a save directory whose ``latest`` names an existing iteration
directory, or an iteration directory itself (it holds a manifest or DCP metadata).  ``load_model``,
``LLM``, ``inspect``, the training service and the trainer's ``--load`` all go through
:func:`find_checkpoint` / :func:`resolve_directory`.  A damaged ``latest`` (or iteration directories
without one) is an error naming the newest iteration that still verifies, so it can be loaded directly.
"""

from __future__ import annotations

import os
import re

from megalite.checkpoint.files import DCP_METADATA, LATEST, MANIFEST, iteration_dir, read_latest
from megalite.checkpoint.integrity import read_manifest, verify_files

_ITERATION_DIR = re.compile(r"iter_(\d{7,})")


def find_checkpoint(path: str) -> str | None:
    """The iteration directory that ``path`` names, or None when ``path`` is missing or holds no checkpoint.

    ValueError when ``path`` looks like a save directory but its ``latest`` is damaged, names a missing
    iteration, or is absent beside iteration directories; the message names the newest verified iteration.
    """
    if not os.path.isdir(path):
        return None
    try:
        iteration = read_latest(path)
    except ValueError as err:
        raise ValueError(f"{err}; {_newest_hint(path)}") from None
    if iteration is not None:
        directory = iteration_dir(path, iteration)
        if not os.path.isdir(directory):
            raise ValueError(f"{os.path.join(path, LATEST)} names iteration {iteration}, but {directory} does not "
                             f"exist; {_newest_hint(path)}")
        return directory
    if os.path.lexists(os.path.join(path, MANIFEST)) or os.path.lexists(os.path.join(path, DCP_METADATA)):
        return path
    if _iterations(path):
        raise ValueError(f"{path} holds iteration directories but no {LATEST} pointer; {_newest_hint(path)}")
    return None


def resolve_directory(path: str) -> str:
    """The iteration directory of ``path``: a save directory (its ``latest``) or an iteration directory."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    directory = find_checkpoint(path)
    if directory is None:
        raise ValueError(f"{path} holds no checkpoint: no '{LATEST}' file and no {MANIFEST}")
    return directory


def _iterations(save_dir: str) -> list[int]:
    """The iterations of ``save_dir``'s published iteration directories, newest first."""
    found = (_ITERATION_DIR.fullmatch(name) for name in os.listdir(save_dir))
    return sorted((int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(save_dir, m.group(0)))),
                  reverse=True)


def newest_verified(save_dir: str) -> int | None:
    """The newest iteration of ``save_dir`` whose every file matches its manifest (sizes and hashes), or None."""
    for iteration in _iterations(save_dir):
        directory = iteration_dir(save_dir, iteration)
        try:
            if verify_files(directory, read_manifest(directory)) is None:
                return iteration
        except ValueError:
            continue
    return None


def _newest_hint(save_dir: str) -> str:
    iteration = newest_verified(save_dir)
    if iteration is None:
        return f"no iteration directory in {save_dir} passes verification"
    directory = iteration_dir(save_dir, iteration)
    return (f"the newest verified checkpoint is iteration {iteration}: load it by its directory "
            f"(--load {directory})")
