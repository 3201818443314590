"""Checkpoint and resume of the whole RL state, in megalite's checkpoint format (so every model reshards).

``--save SAVE`` holds one megalite save directory per model: ``SAVE/actor`` (with its optimizer; its ``latest`` is
the run's commit point, written last), ``SAVE/critic`` (with its optimizer), ``SAVE/reference`` and
``SAVE/target_critic`` (the Polyak target's values).  The actor's JSON state adds the RL state (``rl``: algorithm,
iteration, policy version, the actor's and critic's LR schedules, layout); each rank's adds its RNG streams and its prompt stream's position.  A resume
(``--load SAVE``) reads every model at the actor's iteration, so a kill between two models' writes loads the
previous complete set.  The policy is a plain megalite checkpoint: ``tools/convert_checkpoint.py --from megalite
--to hf --input SAVE/actor`` exports it to Hugging Face.

RNG streams and prompt positions are restored when the layout matches the saved one (as in pretraining); after
resharding the run's seeds apply.  The staleness buffer is empty by construction: saving needs an on-policy,
colocated run (``--max-staleness 0``, no rollout ranks, no scoring server; ``trainer_config.validate``).
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch.distributed as dist

from megalite.checkpoint import load_sharded, read_checkpoint_info, save_sharded
from megalite.checkpoint.files import iteration_dir, read_latest
from megalite.training.checkpointing import get_rng_state, set_rng_state
from megalite.training.save_dir import checkpoint_bytes
from megalite.training.setup import claim_save_dir

ACTOR, CRITIC, REFERENCE, TARGET_CRITIC = "actor", "critic", "reference", "target_critic"
"""The models' save directories under ``--save``, in the order they are written (the actor last)."""


def rl_iteration(load_dir: str | None) -> int | None:
    """The iteration of the RL checkpoint in ``load_dir`` (None: ``load_dir`` holds none, e.g. a pretrained
    actor)."""
    if not load_dir or not os.path.isdir(os.path.join(load_dir, ACTOR)):
        return None
    return read_latest(os.path.join(load_dir, ACTOR))


def check_resume(args) -> int | None:
    """The iteration ``--load`` resumes from (None: no RL checkpoint there); ValueError when the checkpoint's
    algorithm or critic differ from this run's.  Reads JSON files only, so it runs before any collective."""
    iteration = rl_iteration(args.load)
    if iteration is None:
        return None
    rl = read_checkpoint_info(iteration_dir(os.path.join(args.load, ACTOR), iteration))["state"].get("rl")
    if rl is None:
        raise ValueError(f"--load {args.load}: {ACTOR}/ is not an RL checkpoint (no RL state)")
    if rl["algorithm"] != args.advantage_estimator:
        raise ValueError(f"--load {args.load} was trained with --advantage-estimator {rl['algorithm']}; this run uses "
                         f"{args.advantage_estimator} (resume with the same algorithm, or start a new run)")
    return iteration


def claim(args, actor_chunk, loaded_iteration: int, topo):
    """Pretraining's save-directory safety on ``--save`` (one writer, no silent overwrite, room for four models of
    the actor's size with optimizer state); rank 0's lock.  Collective."""
    names = SimpleNamespace(save=os.path.join(args.save, ACTOR),
                            load=os.path.join(args.load, ACTOR) if args.load else None,
                            override_existing_checkpoints=args.override_existing_checkpoints)
    return claim_save_dir(names, loaded_iteration, 4 * checkpoint_bytes([actor_chunk], topo.dp.size), topo)


def _layout(topo) -> dict:
    return {"tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size}


def save_frozen(save_dir: str, iteration: int, reference, target) -> None:
    """The reference and the target critic (``(chunk, PolyakTarget)`` or None); call in the scoring phase, where
    both are resident."""
    save_sharded(os.path.join(save_dir, REFERENCE), iteration, [reference.module])
    if target is not None:
        target[1].load_into(target[0])
        save_sharded(os.path.join(save_dir, TARGET_CRITIC), iteration, [target[0]])


def save_trained(save_dir: str, iteration: int, args, topo, actor, critic, version: int, prompt_rng,
                 schedulers: dict) -> None:
    """The critic, then the actor with the RL state and the LR ``schedulers`` (name -> ``LRScheduler``; its
    ``latest`` commits the set); call in the training phase, where the optimizer state is resident."""
    if critic is not None:
        save_sharded(os.path.join(save_dir, CRITIC), iteration, [critic.chunk], critic.optimizer)
    rl = {"algorithm": args.advantage_estimator, "iteration": iteration, "version": version,
          "schedulers": {name: scheduler.state_dict() for name, scheduler in schedulers.items()}}
    version_, internal, gauss = prompt_rng.getstate()
    save_sharded(os.path.join(save_dir, ACTOR), iteration, [actor.chunk], actor.optimizer,
                 extra={"rl": rl}, rank_extra={"rng": get_rng_state(), "prompt_rng": [version_, list(internal), gauss]},
                 layout=_layout(topo))


def load_frozen(load_dir: str, iteration: int, reference, target) -> None:
    """The reference and the target critic at ``iteration`` (in the scoring phase)."""
    group = dist.group.WORLD
    load_sharded(iteration_dir(os.path.join(load_dir, REFERENCE), iteration), [reference.module], group=group)
    if target is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, TARGET_CRITIC), iteration), [target[0]], group=group)
        for name, param in target[0].named_parameters():
            target[1].params[name].copy_(param.detach())


def load_trained(load_dir: str, iteration: int, topo, actor, critic, prompt_rng: random.Random,
                 schedulers: dict) -> int:
    """The actor and critic with their optimizers and LR ``schedulers`` (name -> ``LRScheduler``; a schedule that
    differs from the saved one is a ValueError unless the run overrides it), and (same layout) this rank's RNG
    streams and prompt position; returns the policy version."""
    group = dist.group.WORLD
    if critic is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, CRITIC), iteration), [critic.chunk], critic.optimizer,
                     group=group)
    reader = load_sharded(iteration_dir(os.path.join(load_dir, ACTOR), iteration), [actor.chunk], actor.optimizer,
                          group=group)
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(reader.state["rl"]["schedulers"][name])
    if reader.world_size == dist.get_world_size() and reader.layout == _layout(topo):
        state = reader.rank_state(dist.get_rank())
        set_rng_state(state["rng"])
        version_, internal, gauss = state["prompt_rng"]
        prompt_rng.setstate((version_, tuple(internal), gauss))
    return reader.state["rl"]["version"]
