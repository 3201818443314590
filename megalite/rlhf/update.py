"""One RL update on a batch of rollouts: staleness check and importance weights, shaped per-token rewards with the
KL to the reference (and the teacher's log-prob rewards), advantages, ``--ppo-epochs`` passes of the actor (and
critic) objectives, and the iteration's metrics averaged over data-parallel ranks (``entropy`` is the Monte-Carlo
estimate of the sampling policy's entropy: the mean negative log-prob of the sampled response tokens; environment
episodes add ``turns``, the mean actions per episode, and ``episode_errors``, the fraction ended by a raising step).
When the old log-probs are recomputed by the actor (stale rollouts, ``--recompute-old-log-probs``) the metrics add
the train/inference gap ``log_prob_gap`` (mean) and ``log_prob_gap_max`` of ``|old - behaviour|`` over response
tokens, and ``is_weight_mean``, the mean TIS/MIS weight (``--rollout-is-*``).  With ``--balance-dp-tokens`` the
rows are redistributed over the DP ranks by token count before the passes (``megalite.rlhf.dp_balance``; the same
global mean) and ``dp_tokens_max_over_min`` logs the ranks' token spread after it.  Every forward of the rows runs
the rollout's one prefix-shared packing (``Rollout.packing``; packed here once where scoring made none, and for the
update once more only where balancing or ``--micro-batch-tokens`` cut other micro-batches).
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


def dp_means(values: dict[str, float], topo, device) -> dict[str, float]:
    """Each of ``values`` averaged over the data-parallel ranks (in float64), all in one all-reduce (none on
    one rank)."""
    sums = list(values.values())
    if topo.dp.size > 1:
        t = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=topo.dp.group)
        sums = t.tolist()
    return {key: total / topo.dp.size for key, total in zip(values, sums)}


def dp_mean(value: float, topo, device) -> float:
    return dp_means({"value": value}, topo, device)["value"]


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
    if rollout.packing is None:  # none made when scoring (the guide's rollout): packed here, once (None: unshared)
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
    tokens = mask.sum().clamp(min=1)
    local = {"reward": float(raw_scores.mean()), "reward_square": float((raw_scores.float() ** 2).mean()),
             "entropy": float(-(rollout.behaviour_log_probs * mask).sum() / tokens),
             "kl": float(kl.sum() / tokens), "response_length": float(mask.sum(dim=1).mean()),
             "kept_group_fraction": rollout.metadata["kept_fraction"]}
    if gap is not None:  # the trainer's old log-probs against the engine's, over response tokens
        local["log_prob_gap"] = float(gap.sum() / tokens)
        if "is_weights" in batch:
            local["is_weight_mean"] = float((batch["is_weights"] * mask).sum() / tokens)
    if "turns" in rollout.metadata:  # environment episodes (megalite.rlhf.environment.run_episodes)
        turns, errors = rollout.metadata["turns"], rollout.metadata["errors"]
        local.update(turns=sum(turns) / len(turns), episode_errors=sum(e is not None for e in errors) / len(errors))
    if teacher is not None:
        local["teacher_log_prob"] = float((teacher.token_log_probs[:, :-1].to(device) * mask).sum() / tokens)
    means = dp_means(local, topo, device)
    reward_mean, reward_square = means.pop("reward"), means.pop("reward_square")
    metrics = {"reward": reward_mean, "reward_std": max(reward_square - reward_mean ** 2, 0.0) ** 0.5,
               "entropy": means.pop("entropy"), "kl": means.pop("kl"),
               "policy_loss": actor_metrics["policy_loss"], "clip_fraction": actor_metrics["clip_fraction"],
               "response_length": means.pop("response_length"),
               "staleness": float(staleness),
               "kept_group_fraction": means.pop("kept_group_fraction"),
               "time_generate_s": rollout.metadata["generate_s"],
               "time_log_probs_s": rollout.metadata["log_probs_s"] + log_probs_s,
               "time_train_s": time.monotonic() - start - log_probs_s}
    if critic is not None:
        metrics["value_loss"] = critic_metrics["value_loss"]
    if dp_tokens is not None:
        metrics["dp_tokens_max_over_min"] = max(dp_tokens) / max(min(dp_tokens), 1)
    if gap is not None:
        metrics["log_prob_gap"] = means.pop("log_prob_gap")
        metrics["log_prob_gap_max"] = dp_max(float(gap.max()), topo, device)
        if "is_weights" in batch:
            metrics["is_weight_mean"] = means.pop("is_weight_mean")
    if "turns" in rollout.metadata:
        metrics.update(turns=means.pop("turns"), episode_errors=means.pop("episode_errors"))
    if ppo.use_kl_loss:
        metrics["kl_loss"] = actor_metrics["kl_loss"]
    if teacher is not None:
        metrics["teacher_log_prob"] = means.pop("teacher_log_prob")
        if args.distill_coef > 0:
            metrics["distill_kl"] = actor_metrics["distill_kl"]
    return metrics
