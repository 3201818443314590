"""Which checkpoint a path names: the one notion of "a checkpoint directory" for every entry point.

A path names a checkpoint when it is a save directory whose ``latest`` names an existing iteration
directory, or an iteration directory itself (it holds a manifest or DCP metadata).  Megatron-LM's save
directories (``latest_checkpointed_iteration.txt`` naming ``iter_XXXXXXX`` or ``release``) and iteration
directories are recognised too; :func:`checkpoint_format` tells which format an iteration directory holds.
A directory that holds files but none of these is an error naming what it holds (never a fresh start).  ``load_model``,
``LLM``, ``inspect``, the training service and the trainer's ``--load`` all go through
:func:`find_checkpoint` / :func:`resolve_directory`.  A damaged ``latest`` (or iteration directories
without one) is an error naming the newest iteration that still verifies, so it can be loaded directly.
"""

from __future__ import annotations

import os
import re

from megalite.checkpoint.files import (DCP_METADATA, LATEST, MANIFEST, is_run_file, iteration_dir, read_latest,
                                      read_pointer)
from megalite.checkpoint.integrity import read_manifest, verify_files

_ITERATION_DIR = re.compile(r"iter_(\d{7,})")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_DIST_METADATA = "metadata.json"
MEGATRON_LEGACY_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")
"""A Megatron-LM legacy rank directory: ``mp_rank_TT``, then ``_PPP`` when pp > 1 and ``_EEE`` when ep > 1."""


def checkpoint_format(directory: str) -> str | None:
    """``"megalite"``, ``"megatron_dist"`` (Megatron-Core torch_dist), ``"megatron_legacy"``
    (``mp_rank_XX/model_optim_rng.pt``) or None: the format of iteration directory ``directory``."""
    if not os.path.isdir(directory):
        return None
    names = os.listdir(directory)
    if MANIFEST in names:
        return "megalite"
    if MEGATRON_DIST_METADATA in names:
        return "megatron_dist"
    if any(MEGATRON_LEGACY_RANK_DIR.fullmatch(name) for name in names):
        return "megatron_legacy"
    if DCP_METADATA in names:
        return "megalite"  # a megalite directory that lost its manifest: its reader names what is missing
    return None


def _megatron_iteration_dir(save_dir: str) -> str | None:
    """The iteration directory that Megatron-LM's tracker file in ``save_dir`` names, or None without one."""
    tracker = os.path.join(save_dir, MEGATRON_TRACKER)
    text = read_pointer(tracker, "Megatron-LM checkpoint tracker")
    if text is None:
        return None
    if text == "release":
        directory = os.path.join(save_dir, "release")
    elif text.isdigit():
        directory = iteration_dir(save_dir, int(text))
    else:
        raise ValueError(f"Megatron-LM checkpoint tracker {tracker} is corrupt: {text[:40]!r} is neither an "
                         "iteration number nor 'release'")
    if checkpoint_format(directory) is None:
        raise ValueError(f"{tracker} names {os.path.basename(directory)}, but {directory} "
                         f"{'holds no Megatron-LM checkpoint' if os.path.isdir(directory) else 'does not exist'}")
    return directory


def find_checkpoint(path: str) -> str | None:
    """The iteration directory that ``path`` names, or None when ``path`` is missing or empty.

    ValueError when ``path`` looks like a save directory but its ``latest`` is damaged, names a missing
    iteration, or is absent beside iteration directories (the message names the newest verified
    iteration), and when ``path`` holds files but no checkpoint of any known format (the message names
    them).  What a run itself puts there besides checkpoints (:func:`files.is_run_file`: lock, W&B folder, write
    probe, partial ``*.tmp`` saves) counts as nothing: a run killed before its first save restarts from scratch,
    and ranks looking while rank 0 probes the directory see no stranger's files.
    """
    if not os.path.isdir(path):
        return None
    if checkpoint_format(path) in ("megatron_dist", "megatron_legacy"):
        return path
    megatron = _megatron_iteration_dir(path)
    try:
        iteration = read_latest(path)
    except ValueError as err:
        raise ValueError(f"{err}; {_newest_hint(path)}") from None
    if iteration is not None:
        directory = iteration_dir(path, iteration)
        if not os.path.isdir(directory):
            raise ValueError(f"{os.path.join(path, LATEST)} names iteration {iteration}, but {directory} does not "
                             f"exist; {_newest_hint(path)}")
        # A megalite run that resumed a Megatron-LM run saves into the same directory: the newer one wins.
        if megatron is None or iteration >= _megatron_iteration(megatron):
            return directory
    if megatron is not None:
        return megatron
    if os.path.lexists(os.path.join(path, MANIFEST)) or os.path.lexists(os.path.join(path, DCP_METADATA)):
        return path
    if _iterations(path):
        raise ValueError(f"{path} holds iteration directories but no {LATEST} pointer; {_newest_hint(path)}")
    found = sorted(name for name in os.listdir(path) if not is_run_file(name))
    if found:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise ValueError(f"{path} holds {shown}, but no checkpoint: neither a megalite checkpoint ('{LATEST}' or "
                         f"{MANIFEST}) nor a Megatron-LM one ({MEGATRON_TRACKER}, {MEGATRON_DIST_METADATA} or "
                         "mp_rank_XX directories)")
    return None


def _megatron_iteration(directory: str) -> int:
    """The iteration of a Megatron-LM iteration directory (``release`` is 0)."""
    found = _ITERATION_DIR.fullmatch(os.path.basename(directory))
    return int(found.group(1)) if found else 0


def resolve_directory(path: str) -> str:
    """The iteration directory of ``path``: a save directory (its ``latest``) or an iteration directory."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    directory = find_checkpoint(path)
    if directory is None:
        raise ValueError(f"{path} holds no checkpoint: it is empty")
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
