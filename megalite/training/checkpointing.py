"""The trainer's checkpoints: megalite's resharding format plus LR schedule, RNG and data position.

Model and optimizer go through :mod:`megalite.checkpoint` as shards of layout-free global tensors
(torch.distributed.checkpoint), so ``--load`` works under any (tp, pp, vpp, dp, ep) layout,
whatever the layout of ``--save`` was.  Rank 0's JSON state adds the scheduler, the data position
(``consumed_samples``) and the flags; each rank's JSON state holds its RNG streams.

Writes are atomic and verified (a temporary directory, a manifest of content hashes, a rename,
then ``latest``), so a crash at any moment leaves the previous checkpoint intact.  With
``--async-save`` the write runs in the background (:class:`megalite.checkpoint.AsyncSaver`).
RNG states are restored only when the world size and layout match the saved ones; after
resharding, the seeds of the new run apply.

What the trainer's flags need from a checkpoint goes through three calls: :func:`checkpoint_info`
(iteration, layout, architecture and flags of the newest checkpoint, without reading tensors),
:func:`save_checkpoint` and :func:`load_checkpoint` with their boolean options
(``save_optimizer``/``save_rng``, ``load_optimizer``/``load_rng``/``finetune``).  Under ``--lora-rank``
the base comes from ``--load`` (weights only) and the run's own checkpoints hold the adapters:
:func:`save_adapter_checkpoint` and :func:`resume_adapters`.
"""

from __future__ import annotations

import base64
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megalite import checkpoint
from megalite.checkpoint.files import iteration_dir, read_latest
from megalite.checkpoint.locate import find_checkpoint
from megalite.checkpoint.megatron_optim import optimizer_warning
from megalite.distributed.unwrap import unwrap
from megalite.lora.state import load_adapters, save_adapters
from megalite.models.architecture import config_to_dict
from megalite.tensor_parallel import MODEL_PARALLEL_RNG, get_rng_tracker

__all__ = ["save_checkpoint", "load_checkpoint", "save_adapter_checkpoint", "resume_adapters", "checkpoint_info",
           "has_checkpoint", "read_latest", "iteration_dir",
           "get_rng_state", "set_rng_state", "set_megatron_rng_state", "LoadResult"]


class LoadResult(NamedTuple):
    """What :func:`load_checkpoint` restored: where training resumes, and what the checkpoint held."""

    iteration: int
    consumed_samples: int
    saved_iteration: int
    saved_layout: dict
    hf: dict | None = None
    """The Hugging Face origin (original config.json, generation config) of a converted checkpoint, carried
    into this run's saves so that exporting a fine-tuned model writes the original's files."""


def has_checkpoint(load_dir: str) -> bool:
    """Whether ``load_dir`` names a checkpoint: a save directory with a published one, or an iteration directory
    (:func:`megalite.checkpoint.locate.find_checkpoint`, the notion every entry point shares)."""
    return find_checkpoint(load_dir) is not None


def checkpoint_info(load_dir: str) -> dict | None:
    """``{"iteration", "layout", "config", "args", "lora"}`` of the checkpoint ``load_dir`` names (a save
    directory's newest, or an iteration directory); None without one.

    ``config`` is the saved GPTConfig as a dict (None if absent); ``args`` the saved flags (None for a
    converted model); ``lora`` the LoRA settings of an adapter checkpoint (else None).  No tensor is read.
    """
    if not has_checkpoint(load_dir):
        return None
    info = checkpoint.read_checkpoint_info(load_dir)
    config = info["config"]
    return {"iteration": info["iteration"], "layout": dict(info["layout"]),
            "config": config_to_dict(config) if config is not None else None, "args": info["state"].get("args"),
            "lora": info["state"].get("lora")}


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _bytes_to_text(tensor: torch.Tensor | None) -> str | None:
    return None if tensor is None else base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _text_to_bytes(text: str | None) -> torch.Tensor | None:
    return None if text is None else torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def get_rng_state() -> dict:
    """Every random generator a training step can draw from, as plain JSON data."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "cpu": _bytes_to_text(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    state["tp_tracker"] = {name: [_bytes_to_text(cpu), _bytes_to_text(cuda)]
                           for name, (cpu, cuda) in get_rng_tracker().get_states().items()}
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_text_to_bytes(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])
    get_rng_tracker().set_states({name: (_text_to_bytes(cpu), _text_to_bytes(cuda))
                                  for name, (cpu, cuda) in state["tp_tracker"].items()})


MEGATRON_TRACKER_NAMES = {"model-parallel-rng": MODEL_PARALLEL_RNG}
"""Megatron-LM's tensor-parallel RNG tracker names with a megalite counterpart (its data- and expert-parallel
states have none: megalite draws those from the default generator)."""


def set_megatron_rng_state(state: dict) -> str | None:
    """Restore the generators a Megatron-LM checkpoint saved for this rank
    (:func:`megalite.checkpoint.megatron_rng.read_rng_state`): Python's, NumPy's, torch's CPU one and, on a GPU,
    the current CUDA one and the CUDA half of the tracker states that megalite has
    (:data:`MEGATRON_TRACKER_NAMES`).  Returns the warning line naming what was saved but not restored (CUDA
    states on a run without a CUDA generator, tracker states megalite has no counterpart of), or None."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    cuda = torch.cuda.is_available()
    tracker = state.get("tracker") or {}
    if not cuda:
        skipped = (["the current CUDA generator"] if state["cuda"] is not None else []) + \
            [f"tracker state {name!r}" for name in sorted(tracker)]
        reason = "CUDA generator states, and this run has no CUDA generator"
    else:
        if state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"])
        mine = get_rng_tracker().get_states()
        skipped = []
        for name in sorted(tracker):
            ours = MEGATRON_TRACKER_NAMES.get(name)
            if ours in mine:
                mine[ours] = (mine[ours][0], tracker[name])
            else:
                skipped.append(f"tracker state {name!r}")
        get_rng_tracker().set_states(mine)
        reason = "megalite has no tracker state of that name"
    if not skipped:
        return None
    return (f"warning: Megatron-LM's saved RNG states {', '.join(skipped)} are not restored ({reason}): "
            "what they would draw comes from this run's seeded generators")


def _jsonable_args(args) -> dict | None:
    """The flags as JSON data (values of other types are stored as their text)."""
    if args is None:
        return None
    plain = (str, int, float, bool, type(None))
    return {k: v if isinstance(v, plain) or (isinstance(v, list) and all(isinstance(x, plain) for x in v))
            else str(v) for k, v in vars(args).items()}


def save_checkpoint(save_dir: str, iteration: int, model_chunks, optimizer, scheduler, consumed_samples: int,
                    *, layout: dict | None = None, args=None, save_optimizer: bool = True, save_rng: bool = True,
                    saver: checkpoint.AsyncSaver | None = None, hf: dict | None = None) -> str:
    """Write this rank's state for ``iteration`` and publish it atomically; returns the directory.

    Collective over the default group when one exists.  ``layout`` (e.g. tp/pp/dp sizes) is
    stored; a load under another layout reshards.  ``save_optimizer``/``save_rng`` False leave
    those out.  With ``saver`` the write runs in the background (the next save waits for it).
    ``hf``: the loaded checkpoint's Hugging Face origin (:attr:`LoadResult.hf`), kept for export.
    """
    extra = {"consumed_samples": consumed_samples,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "args": _jsonable_args(args)}
    if hf is not None:
        extra["hf"] = hf
    rank_extra = {"rng": get_rng_state()} if save_rng else {}
    return checkpoint.save_sharded(save_dir, iteration, model_chunks, optimizer if save_optimizer else None,
                                   extra=extra, rank_extra=rank_extra, layout=layout, saver=saver)


def _refresh_main_params(optimizer) -> None:
    """Copy freshly loaded low-precision weights into the optimizer's fp32 main copies (fp32 ones are views)."""
    with torch.no_grad():
        for shard in getattr(optimizer, "shards", ()):
            flat = shard.param.detach().view(-1)[shard.lo:shard.hi]
            if flat.data_ptr() != shard.main.data_ptr():
                shard.main.copy_(flat)


def load_checkpoint(load_dir: str, model_chunks, optimizer, scheduler, *, layout: dict | None = None,
                    load_optimizer: bool = True, load_rng: bool = True, finetune: bool = False) -> LoadResult:
    """Restore the checkpoint ``load_dir`` names: a save directory's newest, or an iteration directory's.

    Returns iteration 0 and changes nothing when ``load_dir`` holds no checkpoint.  Loads under
    any layout; raises ValueError on missing, truncated or altered files or another architecture.
    ``finetune`` loads the model weights only and starts at iteration 0 with the optimizer and
    schedule as built; ``load_optimizer=False`` skips the optimizer state (the schedule and data
    position still resume); ``load_rng=False`` keeps this run's RNG states.
    """
    if not has_checkpoint(load_dir):
        return LoadResult(0, 0, 0, {})
    rank, world = _rank_and_world()
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    keep_optimizer = load_optimizer and not finetune
    reader = checkpoint.load_sharded(load_dir, model_chunks, optimizer if keep_optimizer else None, group=group)
    if optimizer is not None and not keep_optimizer:
        _refresh_main_params(optimizer)
    elif optimizer is not None and reader.state.get("optimizer_note") and rank == 0:
        print(optimizer_warning(reader.state["optimizer_note"]), flush=True)
    if finetune:
        return LoadResult(0, 0, reader.iteration, dict(reader.layout), reader.state.get("hf"))
    state = reader.state
    same_layout = reader.world_size == world and (layout is None or reader.layout == layout)
    problem = None
    saved_schedule = state.get("scheduler")
    if scheduler is not None and state.get("megatron_scheduler") is not None:
        # Megatron-LM's OptimizerParamScheduler counts samples as megalite's does; its settings are checked
        # (or taken, or overridden) like megalite's own, and the ones it lacks are this run's.
        current = scheduler.state_dict()
        saved_schedule = {**current, **{k: v for k, v in state["megatron_scheduler"].items() if k in current}}
    try:
        if scheduler is not None and saved_schedule is not None:
            scheduler.load_state_dict(saved_schedule)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        problem = reader.field_error("scheduler", f"is not this run's scheduler state: {type(err).__name__}: {err}")
    try:
        saved = reader.rank_state(rank) if problem is None and load_rng and same_layout else {}
        if saved.get("rng") is not None:
            set_rng_state(saved["rng"])
        elif saved.get("megatron_rng") is not None:
            skipped = set_megatron_rng_state(saved["megatron_rng"])
            if skipped and rank == 0:
                print(skipped, flush=True)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as err:
        problem = reader.field_error("rng", f"is not a set of RNG states: {type(err).__name__}: {err}", rank)
    reader.agree(problem)  # a bad rank file fails every rank, not one while the others train on
    return LoadResult(reader.iteration, state.get("consumed_samples", 0), reader.iteration, dict(reader.layout),
                      state.get("hf"))


def save_adapter_checkpoint(save_dir: str, iteration: int, adapters, optimizer, scheduler, consumed_samples: int, *,
                            args=None, save_optimizer: bool = True, save_rng: bool = True) -> str:
    """:func:`save_checkpoint` for a LoRA run: the adapters (``DistributedDataParallel(LoRAModel)``) and their
    optimizer state only, in :func:`megalite.lora.state.save_adapters`' format, with the same trainer state."""
    extra = {"consumed_samples": consumed_samples,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "args": _jsonable_args(args)}
    return save_adapters(save_dir, iteration, unwrap(adapters), optimizer=optimizer if save_optimizer else None,
                         extra=extra, rank_extra={"rng": get_rng_state()} if save_rng else None)


def resume_adapters(save_dir: str, adapters, optimizer, scheduler, *, load_optimizer: bool = True) -> LoadResult:
    """Continue a LoRA run from the newest adapter checkpoint in ``save_dir`` (iteration 0 without one): the
    adapters, their optimizer state, the schedule and the data position (RNG states when the world matches)."""
    if not has_checkpoint(save_dir):
        return LoadResult(0, 0, 0, {})
    path = find_checkpoint(save_dir)
    reader = load_adapters(path, unwrap(adapters), optimizer=optimizer if load_optimizer else None)
    state = reader.state
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    rank, world = _rank_and_world()
    rng = reader.rank_state(rank).get("rng") if reader.world_size == world else None
    if rng is not None:
        set_rng_state(rng)
    return LoadResult(reader.iteration, state.get("consumed_samples", 0), reader.iteration, dict(reader.layout))
