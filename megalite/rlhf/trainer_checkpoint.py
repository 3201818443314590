"""Checkpoint and resume of the whole RL state, in megalite's checkpoint format (so every model reshards).

``--save SAVE`` holds one megalite save directory per model: ``SAVE/actor`` (with its optimizer; its ``latest`` is
the run's commit point, written last), ``SAVE/critic`` (with its optimizer), ``SAVE/reference`` and
``SAVE/target_critic`` (the Polyak target's values); the guidance flow's guide adds ``SAVE/guide`` (with its
optimizer) and ``SAVE/guide_reference``.  The actor's JSON state adds the RL state (``rl``: algorithm,
iteration, policy version, environment, the actor's and critic's LR schedules, layout); each rank's adds its RNG
streams, its prompt stream's position and, with ``--partial-rollout-tokens``, its rows in flight and finished
rows waiting for a batch (tokens, per-token behaviour log-probs and policy versions: ``PartialRollouts.state``),
and with ``--max-staleness`` its rollouts drawn ahead of the update (``Rollout.state``, scored with the weights
of their time, with the scoring server's results for them), so a resume continues every one of them.

Under ``--lora-rank`` the base is frozen and is the reference: ``SAVE/reference`` holds it once (written at the run's
first save into ``SAVE``, in the training phase where the actor's weights are resident; ``rl["base"]`` is that
iteration), and ``SAVE/actor`` is an adapter checkpoint (``megalite.lora.state``: the adapters and their optimizer
state, reshardable) with the same RL state.

A resume (``--load SAVE``) reads every model at the actor's iteration, so a kill between two models' writes loads
the previous complete set.  The policy is a plain megalite checkpoint: ``tools/convert_checkpoint.py --from megalite
--to hf --input SAVE/actor`` exports it to Hugging Face (a LoRA policy: ``SAVE/reference`` is the base to convert,
and ``megalite.lora.peft`` exports ``SAVE/actor``'s adapters to PEFT).

RNG streams, prompt positions, partial rows and the lookahead are restored when the layout matches the saved one
(as in pretraining); after resharding the run's seeds apply and generation starts afresh.  A resharded resume
cannot equal the uninterrupted run: each DP rank draws its own prompts and samples from streams seeded by its DP
rank (another DP size splits the batch, and so the draws, differently), and another TP size changes the reduction
order of every matmul and so the sampled tokens.  The scoring server (``--use-scoring-server``) serves frozen
models; a save waits for the requests it prefetched and keeps their results with their rollouts.  Beside rollout ranks
(``--rollout-world-size``) every write and read here is collective over the trainer ranks' group only; the rollout
ranks' own state (prompt streams, rows in flight and the batches generated ahead, ``megalite.rlhf.rollout_ranks``)
is gathered to rank 0 at each save and kept in the RL state (``rl["rollout_ranks"]``), so any ``--max-staleness``
saves there too, ``--lora-rank`` included (a resume sends the rollout ranks the loaded base once, then the loaded
adapters, as a fresh run sends its warmed-up ones).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from types import SimpleNamespace

import torch.distributed as dist

from megalite.checkpoint import load_sharded, read_checkpoint_info, save_sharded
from megalite.checkpoint.files import iteration_dir, read_latest
from megalite.distributed.unwrap import unwrap
from megalite.lora import LoRAConfig
from megalite.lora.state import load_adapters, save_adapters
from megalite.rlhf.reference import ReferenceModel
from megalite.rlhf.rollout_batch import Rollout, tensors_from_state, tensors_state
from megalite.rlhf.scoring_server import Served
from megalite.training.checkpointing import get_rng_state, set_rng_state
from megalite.training.save_dir import checkpoint_bytes
from megalite.training.setup import claim_save_dir

ACTOR, CRITIC, REFERENCE, TARGET_CRITIC = "actor", "critic", "reference", "target_critic"
"""The models' save directories under ``--save``, in the order they are written (the actor last)."""
GUIDE, GUIDE_REFERENCE = "guide", "guide_reference"
"""The guidance flow's guide's save directories (written before the actor)."""


def rl_iteration(load_dir: str | None) -> int | None:
    """The iteration of the RL checkpoint in ``load_dir`` (None: ``load_dir`` holds none, e.g. a pretrained
    actor)."""
    if not load_dir or not os.path.isdir(os.path.join(load_dir, ACTOR)):
        return None
    return read_latest(os.path.join(load_dir, ACTOR))


def check_resume(args) -> int | None:
    """The iteration ``--load`` resumes from (None: no RL checkpoint there); ValueError when the checkpoint's
    algorithm, environment or LoRA settings differ from this run's (or a guidance run's ``--load`` is no RL
    checkpoint).  Reads JSON files only, so it runs before any collective."""
    iteration = rl_iteration(args.load)
    if iteration is None:
        if args.load and args.environment == "guidance":
            raise ValueError(f"--load {args.load} is not an RL checkpoint: --environment guidance warms up its "
                             f"policy and guide itself and loads only its own RL checkpoints")
        return None
    state = read_checkpoint_info(iteration_dir(os.path.join(args.load, ACTOR), iteration))["state"]
    rl = state.get("rl")
    if rl is None:
        raise ValueError(f"--load {args.load}: {ACTOR}/ is not an RL checkpoint (no RL state)")
    if rl["algorithm"] != args.advantage_estimator:
        raise ValueError(f"--load {args.load} was trained with --advantage-estimator {rl['algorithm']}; this run uses "
                         f"{args.advantage_estimator} (resume with the same algorithm, or start a new run)")
    if rl.get("environment") != args.environment:
        raise ValueError(f"--load {args.load} was trained with --environment {rl.get('environment')}; this run uses "
                         f"{args.environment} (resume with the same environment, or start a new run)")
    saved = LoRAConfig(**state["lora"]) if isinstance(state.get("lora"), dict) else None
    ours = args.lora
    if (saved is None) != (ours is None) or saved is not None and (
            (saved.rank, saved.alpha, tuple(saved.target_modules)) != (ours.rank, ours.alpha,
                                                                      tuple(ours.target_modules))):
        raise ValueError(f"--load {args.load} was trained with {_adapters(saved)}; this run uses {_adapters(ours)} "
                         f"(resume with the same adapters, or start a new run)")
    return iteration


def _adapters(config: LoRAConfig | None) -> str:
    """A run's LoRA flags, as an error message names them."""
    if config is None:
        return "no --lora-rank"
    return (f"--lora-rank {config.rank} --lora-alpha {config.alpha} "
            f"--lora-target-modules {','.join(config.target_modules)}")


def claim(args, actor_chunk, loaded_iteration: int, topo, group=None):
    """Pretraining's save-directory safety on ``--save`` (one writer, no silent overwrite, room for four models of
    the actor's size with optimizer state); rank 0's lock.  Collective over ``group``: the trainer ranks' beside
    rollout ranks, else (None) the world's, as every save and load here."""
    names = SimpleNamespace(save=os.path.join(args.save, ACTOR),
                            load=os.path.join(args.load, ACTOR) if args.load else None,
                            override_existing_checkpoints=args.override_existing_checkpoints)
    return claim_save_dir(names, loaded_iteration, 4 * checkpoint_bytes([actor_chunk], topo.dp.size, group), topo,
                          group=group)


def _layout(topo) -> dict:
    return {"tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size}


def save_frozen(save_dir: str, iteration: int, reference, target, guide=None, group=None) -> None:
    """The reference (not a LoRA policy's base: :func:`save_trained`), the target critic (``(chunk, PolyakTarget)``
    or None) and the guide's reference (``guide``: the guidance flow's ``Guide``, or None); call in the scoring
    phase, where they are resident."""
    if isinstance(reference, ReferenceModel):
        save_sharded(os.path.join(save_dir, REFERENCE), iteration, [reference.module], group=group)
    if guide is not None:
        save_sharded(os.path.join(save_dir, GUIDE_REFERENCE), iteration, [guide.reference.module], group=group)
    if target is not None:
        target[1].load_into(target[0])
        save_sharded(os.path.join(save_dir, TARGET_CRITIC), iteration, [target[0]], group=group)


def save_trained(save_dir: str, iteration: int, args, topo, actor, critic, rollouts, schedulers: dict,
                 base: int | None = None, guide=None, group=None, rollout_ranks: dict | None = None) -> int | None:
    """The critic and the guide (``Guide`` or None) with their optimizers, then the actor with the RL state,
    ``rollouts``' and the LR ``schedulers`` (name -> ``LRScheduler``; its ``latest`` commits the set); call in the
    training phase, where the optimizer state is resident.  A LoRA actor (``args.lora``): its base first unless
    ``base`` (the iteration ``SAVE/reference`` already holds it at), then its adapters; returns the base's iteration
    (None without LoRA).  ``rollout_ranks``: the rollout ranks' states (``rollout_ranks.exchange_state``, on
    rank 0), kept in the RL state."""
    if args.lora is not None and base is None:
        save_sharded(os.path.join(save_dir, REFERENCE), iteration, [actor.chunk], group=group)
        base = iteration
    if critic is not None:
        save_sharded(os.path.join(save_dir, CRITIC), iteration, [critic.chunk], critic.optimizer, group=group)
    if guide is not None:
        save_sharded(os.path.join(save_dir, GUIDE), iteration, [guide.backend.chunk], guide.backend.optimizer,
                     group=group)
    rl = {"algorithm": args.advantage_estimator, "iteration": iteration, "version": rollouts.version, "base": base,
          "environment": args.environment,
          "schedulers": {name: scheduler.state_dict() for name, scheduler in schedulers.items()}}
    if rollout_ranks is not None:
        rl["rollout_ranks"] = rollout_ranks
    version_, internal, gauss = rollouts.rng.getstate()
    rank_extra = {"rng": get_rng_state(), "prompt_rng": [version_, list(internal), gauss]}
    if rollouts.partial is not None:
        rank_extra["partial_rollouts"] = rollouts.partial.state()
    if rollouts.ahead:
        rank_extra["ahead"] = [_ahead_state(item) for item in rollouts.ahead]
    if args.lora is not None:
        save_adapters(os.path.join(save_dir, ACTOR), iteration, unwrap(actor.trained[0]), optimizer=actor.optimizer,
                      extra={"rl": rl, "layout": _layout(topo)}, rank_extra=rank_extra, group=group)
    else:
        save_sharded(os.path.join(save_dir, ACTOR), iteration, [actor.chunk], actor.optimizer, extra={"rl": rl},
                     rank_extra=rank_extra, layout=_layout(topo), group=group)
    return base


def _ahead_state(item) -> dict:
    """A rollout drawn ahead of the update as JSON, with the scoring server's results for it (waited for) when it
    was issued there."""
    if isinstance(item, Rollout):
        return {"rollout": item.state()}
    rollout, future = item
    served = future.result()
    return {"rollout": rollout.state(), "served": {"version": served.version,
                                                   "outputs": tensors_state(list(served.outputs))}}


def _ahead_item(saved: dict, device):
    """:func:`_ahead_state`'s item again (the served results as a finished future)."""
    rollout = Rollout.from_state(saved["rollout"], device)
    if "served" not in saved:
        return rollout
    future = Future()
    future.set_result(Served(tuple(tensors_from_state(saved["served"]["outputs"], device)),
                             saved["served"]["version"]))
    return rollout, future


def load_frozen(load_dir: str, iteration: int, reference, target, guide=None, group=None) -> None:
    """The reference (not a LoRA policy's base: :func:`load_trained`), the target critic and the guide's reference
    at ``iteration`` (in the scoring phase), collectively over ``group`` (None: the world)."""
    group = group or dist.group.WORLD
    if isinstance(reference, ReferenceModel):
        load_sharded(iteration_dir(os.path.join(load_dir, REFERENCE), iteration), [reference.module], group=group)
    if guide is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, GUIDE_REFERENCE), iteration), [guide.reference.module],
                     group=group)
    if target is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, TARGET_CRITIC), iteration), [target[0]], group=group)
        for name, param in target[0].named_parameters():
            target[1].params[name].copy_(param.detach())


def load_trained(load_dir: str, iteration: int, args, topo, actor, critic, rollouts, schedulers: dict,
                 guide=None, group=None) -> dict:
    """The actor (a LoRA actor: its base and adapters), critic and guide with their optimizers, the LR
    ``schedulers`` (name -> ``LRScheduler``; a schedule that differs from the saved one is a ValueError unless the
    run overrides it), and (same layout) this rank's RNG streams, prompt position and partial rows into
    ``rollouts`` (and its policy version); returns the RL state (``rl``).  Collective over ``group`` (None: the
    world)."""
    group = group or dist.group.WORLD
    if critic is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, CRITIC), iteration), [critic.chunk], critic.optimizer,
                     group=group)
    if guide is not None:
        load_sharded(iteration_dir(os.path.join(load_dir, GUIDE), iteration), [guide.backend.chunk],
                     guide.backend.optimizer, group=group)
    path = iteration_dir(os.path.join(load_dir, ACTOR), iteration)
    if args.lora is not None:
        reader = load_adapters(path, unwrap(actor.trained[0]), optimizer=actor.optimizer)
        load_sharded(iteration_dir(os.path.join(load_dir, REFERENCE), reader.state["rl"]["base"]), [actor.chunk],
                     group=group)
    else:
        reader = load_sharded(path, [actor.chunk], actor.optimizer, group=group)
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(reader.state["rl"]["schedulers"][name])
    if reader.world_size == dist.get_world_size(group) and reader.layout == _layout(topo):
        state = reader.rank_state(dist.get_rank())
        set_rng_state(state["rng"])
        version_, internal, gauss = state["prompt_rng"]
        rollouts.rng.setstate((version_, tuple(internal), gauss))
        if rollouts.partial is not None and "partial_rollouts" in state:
            rollouts.partial.load_state(state["partial_rollouts"])
        rollouts.ahead.extend(_ahead_item(saved, rollouts.device) for saved in state.get("ahead", []))
    rollouts.version = reader.state["rl"]["version"]
    return reader.state["rl"]
