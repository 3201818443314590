"""One RL update on a batch of rollouts: staleness check and importance weights, shaped per-token rewards with the
KL to the reference (and the teacher's log-prob rewards), advantages, ``--ppo-epochs`` passes of the actor (and
critic) objectives, and the iteration's metrics averaged over data-parallel ranks (``entropy`` is the Monte-Carlo
estimate of the sampling policy's entropy: the mean negative log-prob of the sampled response tokens; environment
episodes add ``turns``, the mean actions per episode, and ``episode_errors``, the fraction ended by a raising step).
When the old log-probs are recomputed by the actor (stale rollouts, ``--recompute-old-log-probs``) the metrics add
the train/inference gap ``log_prob_gap`` (mean) and ``log_prob_gap_max`` of ``|old - behaviour|`` over response
tokens, and ``is_weight_mean``, the mean TIS/MIS weight (``--rollout-is-*``).  With ``--balance-dp-tokens`` the
rows are redistributed over the DP ranks by token count before the passes (``megalite.rlhf.dp_balance``; the same
global mean) and ``dp_tokens_max_over_min`` logs the ranks' token spread after it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megalite.rlhf.actor import pipeline_log_probs
from megalite.rlhf.advantages import compute_advantages
from megalite.rlhf.critic import pipeline_values
from megalite.rlhf.distillation import TeacherOutput, teacher_rewards
from megalite.rlhf.dp_balance import balance_batches
from megalite.rlhf.ppo import rollout_is_weights
from megalite.rlhf.rewards import token_rewards
from megalite.rlhf.rollout_batch import Rollout
from megalite.rlhf.scoring import shaped_scores
from megalite.rlhf.shared_groups import pack_micro_batches, row_group


def dp_mean(value: float, topo, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=topo.dp.group)
    return float(t) / topo.dp.size


def dp_max(value: float, topo, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=topo.dp.group)
    return float(t)


def rl_update(rollout: Rollout, args, topo, actor, critic, device, version: int,
              teacher: TeacherOutput | None = None, value_model=None) -> dict:
    """One RL iteration on ``rollout`` (scored: its ``rewards`` set), made by policy ``rollout.version`` while the
    actor is at ``version``;
    ``teacher``'s outputs (when served) add log-prob rewards and the distillation loss.  ``value_model`` (the
    critic's chunk or the target critic's, with ``critic``) recomputes a stale rollout's values."""
    staleness = version - rollout.version
    if not 0 <= staleness <= args.max_staleness:
        raise RuntimeError(f"rollout of policy version {rollout.version} is {staleness} updates old at version "
                           f"{version}; --max-staleness is {args.max_staleness}")
    start = time.monotonic()
    ppo, mask, raw_scores = args.ppo, rollout.response_mask, rollout.rewards
    old_log_probs, old_values = rollout.behaviour_log_probs, rollout.old_values
    batch = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask, "response_mask": mask}
    gap = None
    if rollout.packing is None:  # a rollout scoring did not pack (the guide's): packed here, once
        rollout.packing = pack_micro_batches(rollout.micro_batches(args.micro_batch_size), row_group(args),
                                             actor.chunk)
    if staleness or args.recompute_old_log_probs:
        micro_batches = rollout.micro_batches(args.micro_batch_size)
        old_log_probs = pipeline_log_probs(actor.chunk, micro_batches, args.temperature)[0].to(device) * mask
        gap = (old_log_probs - rollout.behaviour_log_probs).abs() * mask
        if ppo.rollout_is_cap is not None:
            batch["is_weights"] = rollout_is_weights(old_log_probs, rollout.behaviour_log_probs, mask,
                                                     ppo.rollout_is_cap, ppo.rollout_is_mode, ppo.rollout_is_level)
        if critic is not None and staleness:
            old_values = pipeline_values(value_model, micro_batches).to(device)[:, :-1]
    scores = shaped_scores(raw_scores.to(device), mask, args)
    rewards, kl = token_rewards(scores, mask, old_log_probs, rollout.ref_log_probs,
                                0.0 if ppo.use_kl_loss else ppo.kl_coef, ppo.kl_estimator, ppo.kl_clamp)
    if teacher is not None:
        rewards = rewards + teacher_rewards(teacher, mask, args.teacher_reward_coef)
        batch["teacher_log_probs"] = teacher.log_probs.to(device)
        if teacher.indices is not None:
            batch["teacher_indices"] = teacher.indices.to(device)
    advantages, returns = compute_advantages(args.advantage, rewards, mask, old_values, topo.dp.group)
    batch.update(old_log_probs=old_log_probs, advantages=advantages)
    if ppo.use_kl_loss:
        batch["ref_log_probs"] = rollout.ref_log_probs
    log_probs_s = time.monotonic() - start
    critic_batch = None
    if critic is not None:
        critic_batch = {**{k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")},
                        "old_values": old_values, "returns": returns}
    dp_tokens, packing = None, rollout.packing
    if args.balance_dp_tokens and topo.dp.size > 1:  # after the advantages: GRPO groups are one rank's rows
        balanced, dp_tokens = balance_batches([batch] + ([critic_batch] if critic is not None else []),
                                              batch["attention_mask"], topo.dp.group)
        batch, critic_batch = balanced[0], balanced[-1] if critic is not None else None
    if dp_tokens is not None or args.micro_batch_tokens is not None:  # other rows than scoring's micro-batches
        packing = pack_micro_batches(actor.micro_batches(batch), row_group(args), actor.chunk)
    for _ in range(args.ppo_epochs):
        actor_metrics = actor.forward_backward(batch, packing)
        actor.optim_step()
        if critic is not None:
            critic_metrics = critic.forward_backward(critic_batch)
            critic.optim_step()
    reward_mean = dp_mean(float(raw_scores.mean()), topo, device)
    reward_square = dp_mean(float((raw_scores.float() ** 2).mean()), topo, device)
    metrics = {"reward": reward_mean, "reward_std": max(reward_square - reward_mean ** 2, 0.0) ** 0.5,
               "entropy": dp_mean(float(-(rollout.behaviour_log_probs * mask).sum() / mask.sum().clamp(min=1)),
                                  topo, device),
               "kl": dp_mean(float(kl.sum() / mask.sum().clamp(min=1)), topo, device),
               "policy_loss": actor_metrics["policy_loss"], "clip_fraction": actor_metrics["clip_fraction"],
               "response_length": dp_mean(float(mask.sum(dim=1).mean()), topo, device),
               "staleness": float(staleness),
               "kept_group_fraction": dp_mean(rollout.metadata["kept_fraction"], topo, device),
               "time_generate_s": rollout.metadata["generate_s"],
               "time_log_probs_s": rollout.metadata["log_probs_s"] + log_probs_s,
               "time_train_s": time.monotonic() - start - log_probs_s}
    if critic is not None:
        metrics["value_loss"] = critic_metrics["value_loss"]
    if dp_tokens is not None:
        metrics["dp_tokens_max_over_min"] = max(dp_tokens) / max(min(dp_tokens), 1)
    if gap is not None:  # the trainer's old log-probs against the engine's, over response tokens
        metrics["log_prob_gap"] = dp_mean(float(gap.sum() / mask.sum().clamp(min=1)), topo, device)
        metrics["log_prob_gap_max"] = dp_max(float(gap.max()), topo, device)
        if "is_weights" in batch:
            metrics["is_weight_mean"] = dp_mean(float((batch["is_weights"] * mask).sum() / mask.sum().clamp(min=1)),
                                                topo, device)
    if "turns" in rollout.metadata:  # environment episodes (megalite.rlhf.environment.run_episodes)
        turns, errors = rollout.metadata["turns"], rollout.metadata["errors"]
        metrics["turns"] = dp_mean(sum(turns) / len(turns), topo, device)
        metrics["episode_errors"] = dp_mean(sum(e is not None for e in errors) / len(errors), topo, device)
    if ppo.use_kl_loss:
        metrics["kl_loss"] = actor_metrics["kl_loss"]
    if teacher is not None:
        metrics["teacher_log_prob"] = dp_mean(float((teacher.token_log_probs[:, :-1].to(device) * mask).sum()
                                                    / mask.sum().clamp(min=1)), topo, device)
        if args.distill_coef > 0:
            metrics["distill_kl"] = actor_metrics["distill_kl"]
    return metrics
