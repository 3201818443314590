"""The guidance flow's second trained model: the guide that writes :class:`~megalite.rlhf.env_tasks.GuidanceEnvironment`'s
hints, trained beside the policy.

The guide is a second actor, built like the policy (its own pipeline chunk, DDP, optimizer at ``--guide-lr`` and
frozen reference copy, all in the job's placement plan as ``guide`` and ``guide reference``) and updated by the
same :func:`~megalite.rlhf.update.rl_update`, with the same algorithm, on its own typed
:class:`~megalite.rlhf.rollout_batch.Rollout`: one row per episode, its prompt (question, attempt, answer) and the
hint it sampled, with the hint's behaviour log-probs.  Its reward is what the hint did for the policy: the
revision's reward minus the attempt's (0 when the episode ended before a revision).  Rows keep the episodes'
order, so a GRPO group of the policy (one question) is a group of the guide too.  With
``--guide-samples-per-attempt N`` > 1 each attempt gets N hints, each its own revision (a row of both models): the
guide's groups are the N hints to one attempt (``args.guide_advantage``), the policy's all revisions to one
question.
"""

from __future__ import annotations

import argparse
import time

import torch

from megalite.rlhf.actor import pipeline_log_probs
from megalite.rlhf.env_tasks import GuidanceEnvironment, HintWriter
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.rollout_batch import Rollout
from megalite.rlhf.rollouts import rollout_sampler
from megalite.rlhf.update import dp_mean, rl_update

GUIDE, GUIDE_REFERENCE = "guide", "guide reference"
"""The guide's names in the placement plan."""


def hint_writer(sample, sampling: SamplingConfig, generator: torch.Generator | None) -> HintWriter:
    """The environment's guide on ``sample`` (``rollout_sampler``'s contract): one prompt in, the sampled hint ids
    (up to ``sampling.max_new_tokens``, ending in end-of-document unless cut) and their log-probs out."""
    def write(prompt: list[int]) -> tuple[list[int], list[float]]:
        ids = torch.tensor([prompt])
        out = sample(ids, torch.ones_like(ids), sampling, generator)
        k = int(out.response_mask[0].sum())
        return out.tokens[0, len(prompt):len(prompt) + k].tolist(), out.log_probs[0, :k].tolist()
    return write


def guide_rollout(envs: list[GuidanceEnvironment], pad: int) -> Rollout:
    """The guide's rows of played episodes: each guide prompt left-padded to the longest, then the hint (padded
    after), with its behaviour log-probs; rewards are the revisions' improvements over the attempts.  An episode
    that ended before its hint (its step raised) gives a row without response tokens and reward 0."""
    turns = [env.guide_turn or (env.guide_prompt([]), [], []) for env in envs]
    p = max(len(prompt) for prompt, _, _ in turns)
    n = max(1, max(len(hint) for _, hint, _ in turns))
    b = len(envs)
    input_ids = torch.full((b, p + n), pad, dtype=torch.long)
    attention = torch.zeros(b, p + n, dtype=torch.long)
    response_mask = torch.zeros(b, p + n - 1)
    log_probs = torch.zeros(b, p + n - 1)
    for i, (prompt, hint, hint_log_probs) in enumerate(turns):
        input_ids[i, p - len(prompt):p + len(hint)] = torch.tensor(prompt + hint)
        attention[i, p - len(prompt):p + len(hint)] = 1
        response_mask[i, p - 1:p - 1 + len(hint)] = 1
        log_probs[i, p - 1:p - 1 + len(hint)] = torch.tensor(hint_log_probs)
    improvement = [0.0 if env.revision_reward is None else env.revision_reward - env.attempt_reward for env in envs]
    tokenizer = envs[0].tokenizer
    return Rollout(input_ids, attention, response_mask, log_probs, p,
                   prompts=[tokenizer.detokenize(prompt) for prompt, _, _ in turns],
                   responses=[tokenizer.detokenize(hint) for _, hint, _ in turns],
                   rewards=torch.tensor(improvement),
                   metadata={"attempt_rewards": [env.attempt_reward for env in envs]})


class Guide:
    """The guide's pieces on this rank: ``backend`` (a :class:`~megalite.rlhf.backend.TrainingBackend` with its
    own optimizer and the policy's objective), ``reference`` (its frozen warm-up copy) and one sampler built
    once on its chunk (its weights are updated in place)."""

    def __init__(self, backend, reference, args):
        self.backend, self.reference, self.args = backend, reference, args
        self.update_args = argparse.Namespace(**{**vars(args), "advantage": args.guide_advantage})
        self.sample = rollout_sampler(backend.chunk)

    def writer(self, sampling: SamplingConfig, generator: torch.Generator | None) -> HintWriter:
        return hint_writer(self.sample, sampling, generator)

    def rollout(self, envs: list[GuidanceEnvironment], policy: Rollout, device) -> Rollout:
        """The guide's rollout of the episodes behind ``policy`` (same iteration and version), with its reference
        log-probs (call in the scoring phase)."""
        start = time.monotonic()
        rollout = guide_rollout(envs, envs[0].tokenizer.pad)
        for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs", "rewards"):
            setattr(rollout, name, getattr(rollout, name).to(device))
        rollout.ref_log_probs = pipeline_log_probs(self.reference.module,
                                                   rollout.micro_batches(self.args.micro_batch_size),
                                                   self.args.temperature)[0].to(device)
        rollout.iteration, rollout.version = policy.iteration, policy.version
        rollout.metadata.update(kept_fraction=1.0, generate_s=0.0, log_probs_s=time.monotonic() - start)
        return rollout

    def update(self, rollout: Rollout, topo, device, version: int) -> dict:
        """One update of the guide on its rollout (training phase): ``rl_update``'s metrics prefixed ``guide_``
        (``guide_reward`` is the mean improvement), and ``attempt_reward``, the policy's first answers' mean."""
        metrics = rl_update(rollout, self.update_args, topo, self.backend, None, device, version)
        attempts = rollout.metadata["attempt_rewards"]
        return {"attempt_reward": dp_mean(sum(attempts) / len(attempts), topo, device),
                **{f"guide_{key}": value for key, value in metrics.items()
                   if key not in ("staleness", "kept_group_fraction", "time_generate_s")}}
