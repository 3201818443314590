"""Disaggregated rollouts: the loop of a rank that only generates (``--rollout-world-size``).

It receives the trainers' weights (``WeightSync``, in place, so one inference engine serves every iteration;
under ``--lora-rank`` the base once, then the adapters only, which the engine applies through their hooks),
generates the rollouts of the DP shards it serves with
:func:`megalite.rlhf.rollouts.sample_shard` and sends them to those shards' trainer ranks.  With
``--partial-rollout-tokens`` it keeps one :class:`~megalite.rlhf.partial_rollouts.PartialRollouts` per shard: the
rows in flight stay here across weight syncs and continue under the synced weights, and each batch goes out with
its per-token versions.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from megalite.lora import apply_lora
from megalite.models import GPTModel
from megalite.rlhf.arithmetic import TOKENIZER
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.partial_rollouts import PartialRollouts
from megalite.rlhf.rollouts import prompt_rows, rollout_sampler, sample_shard
from megalite.rlhf.weight_sync import ROLLOUT, SyncRole, WeightSync


def serve_rollouts(args, config, device, rollout_tp_group, trainer_dp: list[int]) -> None:
    """A rollout rank's loop: receive weights, generate its DP shards' rollouts, send them to the trainers.

    Iteration ``i`` is generated with the weights after update ``max(0, i - 1 - S)``, so up to S
    iterations are generated while the trainers train.  ``trainer_dp[r]`` is global rank r's trainer
    DP rank (-1 for rollout ranks)."""
    world = len(trainer_dp)
    first = world - args.rollout_world_size
    local = dist.get_rank() - first
    rtp = args.rollout_tensor_parallel_size
    replica, tp_rank = local // rtp, local % rtp
    replicas = args.rollout_world_size // rtp
    model = GPTModel(config, tp_group=rollout_tp_group).to(device)
    role = SyncRole(ROLLOUT, replica, tp_rank, rtp)
    sync = WeightSync(model, role)
    sync.sync()
    if args.lora is not None:  # the base came once; from now on only the adapters, hooked onto the model
        sync = WeightSync(apply_lora(model, args.lora).to(device), role)
        sync.sync()
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad,
                              temperature=args.temperature)
    shards = [d for d in range(args.dp) if d % replicas == replica]
    rngs = {d: random.Random(args.seed * 1000 + d) for d in shards}
    sample = rollout_sampler(model)
    partial = {d: PartialRollouts(sample, sampling, args.partial_rollout_tokens, args.prompt_width,
                                  args.n_samples_per_prompt) for d in shards} if args.partial_rollout_tokens else {}
    pending = []
    for iteration in range(1, args.train_iters + 1):
        if iteration > args.max_staleness + 1:
            sync.sync()  # the trainers' sync after update i - 1 - S, which they join having received up to it
            received = iteration - 1 - args.max_staleness  # later sends wait: waiting on them could deadlock
            for _, work, _ in (p for p in pending if p[0] <= received):
                work.wait()
            pending = [p for p in pending if p[0] > received]
        for shard in shards:
            if partial:  # the weights of update max(0, i - 1 - S); the trainers train on them at version i - 1
                batch = partial[shard].next_batch(
                    args.prompts_per_rank, lambda: prompt_rows(args, rngs[shard]),
                    args.prompts_per_rank * args.n_samples_per_prompt, max(0, iteration - 1 - args.max_staleness),
                    torch.Generator(device).manual_seed(args.seed + 7919 * iteration + shard), args.max_staleness,
                    trained_at=iteration - 1, device=device)
                tensors = batch.wire_tensors() + [batch.token_versions]
            else:
                tensors = sample_shard(sample, args, sampling, rngs[shard], iteration, 0, shard,
                                       device).wire_tensors()
            if tp_rank == 0:
                for dst in (r for r, d in enumerate(trainer_dp) if d == shard):
                    pending += [(iteration, dist.isend(t, dst), t) for t in tensors]
    for _, work, _ in pending:
        work.wait()
