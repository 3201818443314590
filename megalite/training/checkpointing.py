"""Atomic per-rank checkpoints: model, optimizer, LR schedule, RNG states and data position.

The optimizer is stored through its ``sharded_state_dict`` (entries tagged with
parameter names and offsets), which a later resharding format can reuse.

Layout under ``save_dir``::

    latest                  text file holding the newest complete iteration
    iter_0000100/rank_00000.pt ... one file per global rank

Every rank writes its file into ``iter_0000100.tmp`` and fsyncs it; after a
barrier rank 0 renames the directory into place, fsyncs the parent and then
replaces ``latest`` through a fsynced temporary file.  A crash at any moment
leaves the previous ``latest`` checkpoint intact.  Resuming needs the same
world size and layout; a later format will reshard.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

FORMAT_VERSION = 1
LATEST = "latest"


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def get_rng_state() -> dict:
    """Every random generator a training step can draw from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    tracker = _tp_rng_tracker()
    if tracker is not None:
        state["tp_tracker"] = tracker.get_states()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _tp_rng_tracker()
    if tracker is not None and "tp_tracker" in state:
        tracker.set_states(state["tp_tracker"])


def _tp_rng_tracker():
    """The tensor-parallel RNG tracker, when the tensor_parallel package provides one."""
    try:
        from megalite.tensor_parallel.random import get_rng_tracker
    except ImportError:
        return None
    return get_rng_tracker()


def save_checkpoint(save_dir: str, iteration: int, model_chunks, optimizer, scheduler, consumed_samples: int,
                    *, layout: dict | None = None, args=None) -> str:
    """Write this rank's state for ``iteration`` and publish it atomically; returns the directory.

    Collective over the default group (two barriers) when one exists.
    ``layout`` (e.g. tp/pp/dp sizes) is stored and checked on load.
    """
    rank, world = _rank_and_world()
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    state = {
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "world_size": world,
        "layout": layout or {},
        "model": [_unwrap(c).state_dict() for c in model_chunks],
        "optimizer": optimizer.sharded_state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": get_rng_state(),
        "args": vars(args) if args is not None else None,
    }
    path = _rank_file(tmp, rank)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier()
    if rank == 0:
        _publish(save_dir, tmp, final, iteration)
    _barrier()
    return final


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Move a complete temporary directory into place, then point ``latest`` at it."""
    _fsync_path(tmp)
    old = None
    if os.path.exists(final):
        old = final + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(save_dir)
    pointer = os.path.join(save_dir, LATEST)
    pointer_tmp = pointer + ".tmp"
    with open(pointer_tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, pointer)
    _fsync_path(save_dir)
    if old is not None:
        shutil.rmtree(old)


def read_latest(load_dir: str) -> int | None:
    """The iteration named by ``load_dir/latest``, or None when there is no checkpoint."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    text = open(pointer).read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint pointer {pointer} is corrupt: {text[:40]!r} is not an iteration number")
    return int(text)


def load_checkpoint(load_dir: str, model_chunks, optimizer, scheduler, *,
                    layout: dict | None = None) -> tuple[int, int]:
    """Restore the newest checkpoint in ``load_dir``; returns ``(iteration, consumed_samples)``.

    Returns ``(0, 0)`` and changes nothing when ``load_dir`` holds no
    checkpoint.  Raises ValueError when the checkpoint was written by a
    different world size or layout.
    """
    iteration = read_latest(load_dir)
    if iteration is None:
        return 0, 0
    rank, world = _rank_and_world()
    path = _rank_file(iteration_dir(load_dir, iteration), rank)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {iteration_dir(load_dir, iteration)} has no file for rank {rank}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["world_size"] != world or (layout is not None and state["layout"] != layout):
        raise ValueError(f"checkpoint at iteration {iteration} was saved with world size {state['world_size']} "
                         f"and layout {state['layout']}, but this run has world size {world} and layout {layout}")
    if len(state["model"]) != len(model_chunks):
        raise ValueError(f"checkpoint holds {len(state['model'])} model chunks, this rank has {len(model_chunks)}")
    for chunk, chunk_state in zip(model_chunks, state["model"]):
        _unwrap(chunk).load_state_dict(chunk_state)
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_sharded_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]
