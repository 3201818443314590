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

What the trainer's flags need from a checkpoint goes through three calls, independent of how
the files are laid out: :func:`checkpoint_info` (iteration, layout, architecture and flags of
the newest checkpoint, without loading tensors), :func:`save_checkpoint` and
:func:`load_checkpoint` with their boolean options (``save_optim``/``save_rng``,
``load_optim``/``load_rng``/``finetune``).
"""

from __future__ import annotations

import os
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megalite import checkpoint
from megalite.checkpoint.format import CheckpointReader, iteration_dir, read_latest
from megalite.tensor_parallel import get_rng_tracker

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_info", "has_checkpoint", "read_latest", "iteration_dir",
           "get_rng_state", "set_rng_state", "LoadResult"]


class LoadResult(NamedTuple):
    """What :func:`load_checkpoint` restored: where training resumes, and what the checkpoint held."""

    iteration: int
    consumed_samples: int
    saved_iteration: int
    saved_layout: dict


def has_checkpoint(load_dir: str) -> bool:
    """Whether ``load_dir`` holds a published checkpoint."""
    return os.path.isdir(load_dir) and read_latest(load_dir) is not None


def checkpoint_info(load_dir: str) -> dict | None:
    """``{"iteration", "layout", "config", "args"}`` of the newest checkpoint in ``load_dir``; None without one.

    ``config`` is the saved GPTConfig as a dict (None if absent); ``args`` the saved flags (None for a
    converted model).  No tensor is read.
    """
    if not has_checkpoint(load_dir):
        return None
    reader = CheckpointReader(load_dir)
    return {"iteration": reader.iteration, "layout": dict(reader.layout), "config": reader.config_dict,
            "args": reader.rank_state(0).get("args")}


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
                    *, layout: dict | None = None, args=None, save_optim: bool = True,
                    save_rng: bool = True) -> str:
    """Write this rank's state for ``iteration`` and publish it atomically; returns the directory.

    Collective over the default group when one exists.  ``layout`` (e.g. tp/pp/dp sizes) is
    stored; a load under another layout reshards.  ``save_optim``/``save_rng`` False leave the
    optimizer state or the RNG states out (Megatron's --no-save-optim/--no-save-rng).
    """
    extra = {"consumed_samples": consumed_samples,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "rng": get_rng_state() if save_rng else None, "args": vars(args) if args is not None else None}
    return checkpoint.save_checkpoint(save_dir, iteration, model_chunks, optimizer if save_optim else None,
                                      extra=extra, layout=layout)


def _refresh_main_params(optimizer) -> None:
    """Copy freshly loaded low-precision weights into the optimizer's fp32 main copies (fp32 ones are views)."""
    with torch.no_grad():
        for shard in getattr(optimizer, "shards", ()):
            flat = shard.param.detach().view(-1)[shard.lo:shard.hi]
            if flat.data_ptr() != shard.main.data_ptr():
                shard.main.copy_(flat)


def load_checkpoint(load_dir: str, model_chunks, optimizer, scheduler, *, layout: dict | None = None,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False) -> LoadResult:
    """Restore the newest checkpoint in ``load_dir``.

    Returns iteration 0 and changes nothing when ``load_dir`` holds no checkpoint.  Loads under
    any layout; raises ValueError on missing or truncated files or another architecture.
    ``finetune`` loads the model weights only and starts at iteration 0 with the optimizer and
    schedule as built; ``load_optim=False`` skips the optimizer state (the schedule and data
    position still resume); ``load_rng=False`` keeps this run's RNG states.
    """
    if not has_checkpoint(load_dir):
        return LoadResult(0, 0, 0, {})
    rank, world = _rank_and_world()
    keep_optimizer = load_optim and not finetune
    reader = checkpoint.load_checkpoint(load_dir, model_chunks, optimizer if keep_optimizer else None)
    if optimizer is not None and not keep_optimizer:
        _refresh_main_params(optimizer)
    if finetune:
        return LoadResult(0, 0, reader.iteration, dict(reader.layout))
    same_layout = reader.world_size == world and (layout is None or reader.layout == layout)
    state = reader.rank_state(rank if same_layout else 0)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if load_rng and same_layout and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return LoadResult(reader.iteration, state.get("consumed_samples", 0), reader.iteration, dict(reader.layout))
