"""Megatron-LM legacy checkpoints (``--ckpt-format torch``) on disk: where each rank's file lies, and unpickling it.

Megatron-LM's ``training/checkpointing.py`` writes::

    SAVE/latest_checkpointed_iteration.txt         the iteration, or "release"
    SAVE/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt      (``release/`` for a release)

one ``torch.save`` file per tensor rank ``TT``, pipeline rank ``PPP`` (the suffix only when pp > 1) and expert rank
``EEE`` (only when ep > 1), holding ``args`` (the parsed command line), ``iteration``, ``model`` (``model0``,
``model1``, ... per virtual stage), and optionally ``optimizer``, ``opt_param_scheduler`` and ``rng_state``; a
distributed optimizer's state lies beside it in ``distrib_optim.pt``.  These files are pickles, and unpickling runs
code the file names: the readers here are called only behind the converter's explicit opt-in
(:func:`megalite.checkpoint.megatron_legacy.read_megatron_legacy`).
"""

from __future__ import annotations

import os
import re

import torch

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_FILE = "distrib_optim.pt"
"""A distributed optimizer's state beside each rank's MODEL_FILE (Megatron-Core's ``save_parameter_state``)."""
RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")


def legacy_directory(path: str) -> str | None:
    """The iteration directory of a Megatron-LM legacy checkpoint that ``path`` names, or None (nothing unpickled).

    ``path`` is a save directory (its ``latest_checkpointed_iteration.txt`` names ``iter_XXXXXXX`` or
    ``release``) or an iteration directory holding ``mp_rank_*`` directories.
    """
    if not os.path.isdir(path):
        return None
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(path, "release")
        if not text.isdigit():
            raise ValueError(f"{tracker} holds {text[:40]!r}, neither an iteration number nor 'release'")
        directory = os.path.join(path, f"iter_{int(text):07d}")
        if not os.path.isdir(directory):
            raise ValueError(f"{tracker} names iteration {int(text)}, but {directory} does not exist")
        return directory
    if any(RANK_DIR.fullmatch(name) for name in os.listdir(path)):
        return path
    return None


def rank_file(directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Megatron-LM's file of tensor rank ``tp_rank``, pipeline rank ``pp_rank`` and expert rank ``ep_rank`` in an
    iteration directory."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "") + \
        (f"_{ep_rank:03d}" if ep_size > 1 else "")
    return os.path.join(directory, name, MODEL_FILE)


def unpickle(path: str) -> dict:
    """One rank file, memory-mapped (tensors are read when placed) unless torch < 1.6 wrote it (no zip archive)."""
    state = load_pickle(path)
    if not isinstance(state, dict) or "args" not in state:
        raise ValueError(f"{path} holds no Megatron-LM checkpoint (no 'args' entry)")
    return state


def load_pickle(path: str):
    """A pickle file of the checkpoint (behind the opt-in), memory-mapped unless torch < 1.6 wrote it."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a damaged zip or pickle raises many types
        raise ValueError(f"{path} is not a readable Megatron-LM checkpoint file: {type(err).__name__}: {err}") from None
    return state


def model_chunks(state: dict, path: str) -> list[dict]:
    """The model state dicts of one rank file, one per virtual pipeline stage."""
    if "model" in state:
        return [state["model"]]
    chunks = [state[f"model{v}"] for v in range(len(state)) if f"model{v}" in state]
    if not chunks:
        raise ValueError(f"{path} holds no 'model' entry")
    return chunks
