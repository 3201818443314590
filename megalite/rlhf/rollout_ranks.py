"""Disaggregated rollouts: the loop of a rank that only generates (``--rollout-world-size``).

It receives the trainers' weights (``WeightSync``, in place, so one inference engine serves every iteration;
under ``--lora-rank`` the base once, then the adapters only, which the engine applies through their hooks),
generates the rollouts of the DP shards it serves with
:func:`megalite.rlhf.rollouts.sample_shard` and sends them to those shards' trainer ranks.  With
``--partial-rollout-tokens`` it keeps one :class:`~megalite.rlhf.partial_rollouts.PartialRollouts` per shard: the
rows in flight stay here across weight syncs and continue under the synced weights, and each batch goes out with
its per-token versions.

With ``--save`` a rollout rank's state joins the RL checkpoint (:func:`exchange_state`, a gather to trainer rank 0
at each save, stored with the actor's RL state): its shards' prompt streams, their partial rows, and the batches
it generated ahead that the trainers have not received yet (up to ``--max-staleness`` iterations, made with
older weights).  A resume (:func:`saved_state`) sends those batches again and continues from the rest, so the run
equals an uninterrupted one; under another rollout layout the rollout ranks start afresh from the run's seeds.  The
weights come once the trainers hold their final ones (warmed up, or loaded by a resume): the model's, or under
``--lora-rank`` the base's and then the adapters'.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from megalite.checkpoint import read_checkpoint_info
from megalite.checkpoint.files import iteration_dir
from megalite.lora import apply_lora
from megalite.models import GPTModel
from megalite.rlhf.arithmetic import TOKENIZER
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.partial_rollouts import PartialRollouts
from megalite.rlhf.rollout_batch import tensors_from_state, tensors_state
from megalite.rlhf.rollouts import prompt_rows, rollout_sampler, sample_shard
from megalite.rlhf.trainer_checkpoint import ACTOR
from megalite.rlhf.weight_sync import ROLLOUT, SyncRole, WeightSync


def saves_at(args, iteration: int) -> bool:
    """Whether the trainers save after ``iteration`` (``--save``, ``--save-interval``, the last iteration)."""
    return bool(args.save) and (iteration == args.train_iters
                                or bool(args.save_interval) and iteration % args.save_interval == 0)


def exchange_state(state: dict | None) -> list | None:
    """Every rank's ``state`` gathered on rank 0 (the trainers pass None): collective over the world, called at
    each save by trainers and rollout ranks alike.  Rank 0 gets the list, the others None."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def rollout_layout(args) -> dict:
    """What a saved rollout-rank state is valid for."""
    return {"rollout_world_size": args.rollout_world_size, "rollout_tp": args.rollout_tensor_parallel_size,
            "dp": args.dp, "partial_rollout_tokens": args.partial_rollout_tokens,
            "max_staleness": args.max_staleness}


def saved_state(args, iteration: int, local: int) -> dict | None:
    """Rollout rank ``local``'s state in ``--load``'s checkpoint at ``iteration``; None when it holds none for
    this layout (the rollout ranks start afresh)."""
    rl = read_checkpoint_info(iteration_dir(os.path.join(args.load, ACTOR), iteration))["state"]["rl"]
    saved = rl.get("rollout_ranks")
    if not saved or saved["layout"] != rollout_layout(args):
        return None
    return saved["ranks"][local]


def serve_rollouts(args, config, device, rollout_tp_group, trainer_dp: list[int], resume: int | None = None) -> None:
    """A rollout rank's loop: receive weights, generate its DP shards' rollouts, send them to the trainers.

    Iteration ``i`` is generated with the weights after update ``max(0, i - 1 - S)``, so up to S
    iterations are generated while the trainers train.  ``trainer_dp[r]`` is global rank r's trainer
    DP rank (-1 for rollout ranks); ``resume``: the iteration the trainers resumed after (``--load``)."""
    world = len(trainer_dp)
    first = world - args.rollout_world_size
    local = dist.get_rank() - first
    rtp = args.rollout_tensor_parallel_size
    replica, tp_rank = local // rtp, local % rtp
    replicas = args.rollout_world_size // rtp
    model = GPTModel(config, tp_group=rollout_tp_group).to(device)
    role = SyncRole(ROLLOUT, replica, tp_rank, rtp)
    sync = WeightSync(model, role)
    if args.lora is not None:  # the base comes once; from then on only the adapters, hooked onto the model
        base_sync, sync = sync, WeightSync(apply_lora(model, args.lora).to(device), role)
        base_sync.sync()
    sync.sync()  # the trainers' warmed-up weights, or those a resume loaded
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad,
                              temperature=args.temperature)
    shards = [d for d in range(args.dp) if d % replicas == replica]
    rngs = {d: random.Random(args.seed * 1000 + d) for d in shards}
    sample = rollout_sampler(model)
    partial = {d: PartialRollouts(sample, sampling, args.partial_rollout_tokens, args.prompt_width,
                                  args.n_samples_per_prompt) for d in shards} if args.partial_rollout_tokens else {}
    ahead: dict[tuple[int, int], list[torch.Tensor]] = {}  # (iteration, shard): batches the trainers may lack
    saved = saved_state(args, resume, local) if resume is not None else None
    if saved is not None:
        for shard, (version_, internal, gauss) in zip(shards, saved["rngs"]):
            rngs[shard].setstate((version_, tuple(internal), gauss))
        for shard, rows in zip(shards, saved["partial"] or []):
            partial[shard].load_state(rows)
        ahead = {(iteration, shard): tensors_from_state(tensors, device)
                 for iteration, shard, tensors in saved["ahead"]}

    def state(received: int) -> dict:
        """This rank's state once the trainers have received iteration ``received``."""
        return {"rngs": [[version_, list(internal), gauss] for version_, internal, gauss in
                         (rngs[d].getstate() for d in shards)],
                "partial": [partial[d].state() for d in shards] if partial else None,
                "ahead": [[i, d, tensors_state(tensors)] for (i, d), tensors in sorted(ahead.items()) if i > received]}

    pending = []
    for iteration in range((resume or 0) + 1, args.train_iters + 1):
        received = iteration - 1 - args.max_staleness  # the trainers' last update, which they sync here
        if received > (resume or 0):  # (a resume's weights came at the start)
            sync.sync()
            for _, work, _ in (p for p in pending if p[0] <= received):  # later sends wait: could deadlock
                work.wait()
            pending = [p for p in pending if p[0] > received]
            ahead = {key: tensors for key, tensors in ahead.items() if key[0] > received}
            if saves_at(args, received):
                exchange_state(state(received))
        for shard in shards:
            if (iteration, shard) in ahead:  # generated before the save resumed from, with older weights
                tensors = ahead[iteration, shard]
            elif partial:  # the weights of update max(0, i - 1 - S); the trainers train on them at version i - 1
                batch = partial[shard].next_batch(
                    args.prompts_per_rank, lambda: prompt_rows(args, rngs[shard]),
                    args.prompts_per_rank * args.n_samples_per_prompt, max(0, iteration - 1 - args.max_staleness),
                    torch.Generator(device).manual_seed(args.seed + 7919 * iteration + shard), args.max_staleness,
                    trained_at=iteration - 1, device=device)
                tensors = batch.wire_tensors() + [batch.token_versions]
            else:
                tensors = sample_shard(sample, args, sampling, rngs[shard], iteration, 0, shard,
                                       device).wire_tensors()
            if args.save:
                ahead[iteration, shard] = tensors
            if tp_rank == 0:
                for dst in (r for r, d in enumerate(trainer_dp) if d == shard):
                    pending += [(iteration, dist.isend(t, dst), t) for t in tensors]
    for received in range(max(args.train_iters - args.max_staleness, (resume or 0) + 1), args.train_iters + 1):
        if saves_at(args, received):  # the trainers' saves after their last sync
            exchange_state(state(received))
    for _, work, _ in pending:
        work.wait()
