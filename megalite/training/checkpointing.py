"""The trainer's checkpoints: megalite's resharding format plus LR schedule, RNG and data position.

Model and optimizer go through :mod:`megalite.checkpoint` as pieces of layout-free global
tensors, so ``--load`` works under any (tp, pp, vpp, dp, ep) layout, whatever the layout of
``--save`` was.  Each rank file also carries the scheduler state, the data position
(``consumed_samples``), the rank's RNG states and the flags.

Layout under ``save_dir``::

    latest                         the newest complete iteration
    iter_0000100/rank_00000.pt ... one file per global rank

Writes are atomic (a temporary directory renamed into place, then ``latest`` replaced), so a
crash at any moment leaves the previous checkpoint intact.  RNG states are restored only when the
world size and layout match the saved ones; after resharding, the seeds of the new run apply.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megalite import checkpoint
from megalite.checkpoint.format import iteration_dir, read_latest
from megalite.tensor_parallel import get_rng_tracker

__all__ = ["save_checkpoint", "load_checkpoint", "read_latest", "iteration_dir", "get_rng_state", "set_rng_state"]


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def get_rng_state() -> dict:
    """Every random generator a training step can draw from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["tp_tracker"] = get_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tp_tracker"])


def save_checkpoint(save_dir: str, iteration: int, model_chunks, optimizer, scheduler, consumed_samples: int,
                    *, layout: dict | None = None, args=None) -> str:
    """Write this rank's state for ``iteration`` and publish it atomically; returns the directory.

    Collective over the default group when one exists.  ``layout`` (e.g. tp/pp/dp sizes) is
    stored; a load under another layout reshards.
    """
    extra = {"consumed_samples": consumed_samples,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": get_rng_state(), "args": vars(args) if args is not None else None}
    return checkpoint.save_checkpoint(save_dir, iteration, model_chunks, optimizer, extra=extra, layout=layout)


def load_checkpoint(load_dir: str, model_chunks, optimizer, scheduler, *,
                    layout: dict | None = None) -> tuple[int, int]:
    """Restore the newest checkpoint in ``load_dir``; returns ``(iteration, consumed_samples)``.

    Returns ``(0, 0)`` and changes nothing when ``load_dir`` holds no checkpoint.  Loads under
    any layout; raises ValueError on missing or truncated files or another architecture.
    """
    if not os.path.isdir(load_dir) or read_latest(load_dir) is None:
        return 0, 0
    rank, world = _rank_and_world()
    reader = checkpoint.load_checkpoint(load_dir, model_chunks, optimizer)
    same_layout = reader.world_size == world and (layout is None or reader.layout == layout)
    state = reader.rank_state(rank if same_layout else 0)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if same_layout and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return reader.iteration, state.get("consumed_samples", 0)
