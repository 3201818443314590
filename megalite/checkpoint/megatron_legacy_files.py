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

import torch

from megalite.checkpoint.locate import MEGATRON_LEGACY_RANK_DIR as RANK_DIR
from megalite.checkpoint.locate import MEGATRON_TRACKER as TRACKER

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_FILE = "distrib_optim.pt"
"""A distributed optimizer's state beside each rank's MODEL_FILE (Megatron-Core's ``save_parameter_state``)."""


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


def _coordinates(rank: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """Megatron-Core's ranks of global ``rank`` in each parallel dimension, ``order`` fastest first (its
    ``RankGenerator``: a global rank is a mixed-radix number whose digits are these ranks)."""
    found = {}
    for name in order.split("-"):
        found[name] = rank % sizes[name]
        rank //= sizes[name]
    return found


def written_ranks(args, tp: int, pp: int, ep: int, etp: int) -> dict[tuple[int, int, int], int]:
    """``{(tensor rank, pipeline rank, expert rank) of each rank file: the expert tensor-parallel rank of its
    experts}`` of a run with the saved ``args``.  Megatron-LM's legacy save writes from the first rank of each
    expert data-parallel group, into the file of its (dense) tensor and pipeline rank and its expert rank: with
    ``etp`` = ``tp`` that is every combination, each file's experts cut as its tensor rank; otherwise which global
    ranks write which file follows Megatron-Core's rank order (``tp-cp-ep-dp-pp``, ``tp-cp-ep-pp-dp`` with
    ``--use-tp-pp-dp-mapping``) over ``args.world_size``.  ValueError when the args lack the world size or two
    ranks with different expert shards write one file (the format kept only one of them)."""
    if etp == tp:
        return {(t, p, e): t for p in range(pp) for t in range(tp) for e in range(ep)}
    world = int(getattr(args, "world_size", 0) or 0)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if world < 1 or world % (tp * cp * pp) or world % (etp * ep * pp):
        raise ValueError(f"the saved args' world_size {world or None} does not give the ranks of tensor_model_parallel"
                         f"_size {tp} x context_parallel_size {cp} x pipeline_model_parallel_size {pp} and of "
                         f"expert_tensor_parallel_size {etp} x expert_model_parallel_size {ep}, which a legacy save "
                         "with expert_tensor_parallel_size other than tp needs to place its files")
    order = "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"
    dense = dict(tp=tp, cp=cp, ep=1, dp=world // (tp * cp * pp), pp=pp)
    expert = dict(tp=etp, cp=1, ep=ep, dp=world // (etp * ep * pp), pp=pp)
    files = {}
    for rank in range(world):
        ours, theirs = _coordinates(rank, dense, order), _coordinates(rank, expert, order)
        if theirs["dp"] > 0:
            continue  # not the first rank of its expert data-parallel group: it writes nothing
        key = (ours["tp"], ours["pp"], theirs["ep"])
        if files.setdefault(key, theirs["tp"]) != theirs["tp"]:
            raise ValueError(f"Megatron-LM's legacy save of this run (tensor_model_parallel_size {tp}, "
                             f"expert_tensor_parallel_size {etp}, world_size {world}) writes the experts of expert "
                             f"tensor ranks {files[key]} and {theirs['tp']} into one file, "
                             f"{os.path.dirname(rank_file('', key[0], key[1], pp, key[2], ep))}: "
                             "only one of them is on disk")
    return files


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
