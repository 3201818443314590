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

Under partial rollouts (``--partial-rollout-tokens``) the hint is written in rounds too: a
:class:`PartialHintWriter` samples at most that many hint tokens per round with the guide's weights of the time
(each token keeping its log-prob and guide version) and holds the episode's step
(:class:`~megalite.rlhf.environment.StepPending`) until the hint ends, so an episode may pause in its attempt, its
hint or its revision and continue after a weight update of either model.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from megalite.rlhf.actor import pipeline_log_probs
from megalite.rlhf.env_tasks import GuidanceEnvironment, HintWriter
from megalite.rlhf.environment import StepPending
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.rollout_batch import Rollout, response_rows
from megalite.rlhf.rollouts import rollout_sampler
from megalite.rlhf.update import dp_mean, rl_update

GUIDE, GUIDE_REFERENCE = "guide", "guide reference"
"""The guide's names in the placement plan."""


def hint_writer(sample, sampling: SamplingConfig, generator: torch.Generator | None) -> HintWriter:
    """The environment's guide on ``sample`` (``rollout_sampler``'s contract): one prompt in, the sampled hint ids
    (up to ``sampling.max_new_tokens``, ending in end-of-document unless cut) and their log-probs out."""
    def write(prompt: list[int]) -> tuple[list[int], list[float]]:
        ids = torch.tensor([prompt])
        return sample(ids, torch.ones_like(ids), sampling, generator).sampled(0, len(prompt))
    return write


@dataclass
class GuideClock:
    """What the guide samples with in the current rounds: its weights' ``version`` and the ``generator`` (set by the
    rollouts before each batch of rounds)."""

    version: int = 0
    generator: torch.Generator | None = None


class PartialHintWriter:
    """One episode's guide under partial rollouts: each call samples at most ``chunk_tokens`` more tokens of the
    hint to ``prompt`` (up to ``sampling.max_new_tokens`` in all) with ``sample`` at ``clock``'s version and
    generator, and raises :class:`StepPending` until the hint ends; then it returns the hint ids, their log-probs
    and each token's guide version (``HintWriter``'s contract).  :meth:`state` is the hint so far, as JSON."""

    def __init__(self, sample, sampling: SamplingConfig, chunk_tokens: int, clock: GuideClock):
        self.sample, self.sampling, self.chunk_tokens, self.clock = sample, sampling, chunk_tokens, clock
        self.hint: dict | None = None

    def _done(self) -> bool:
        tokens = self.hint["tokens"]
        return len(tokens) == self.sampling.max_new_tokens or bool(tokens) and tokens[-1] == self.sampling.eos_id

    def __call__(self, prompt: list[int]) -> tuple[list[int], list[float], list[int]]:
        if self.hint is None or self.hint["prompt"] != prompt:
            self.hint = {"prompt": list(prompt), "tokens": [], "log_probs": [], "versions": []}
        hint = self.hint
        if not self._done():
            budget = min(self.chunk_tokens, self.sampling.max_new_tokens - len(hint["tokens"]))
            ids = torch.tensor([prompt + hint["tokens"]])
            out = self.sample(ids, torch.ones_like(ids), replace(self.sampling, max_new_tokens=budget),
                              self.clock.generator)
            tokens, log_probs = out.sampled(0, ids.shape[1])
            hint["tokens"] += tokens
            hint["log_probs"] += log_probs
            hint["versions"] += [self.clock.version] * len(tokens)
            if not self._done():
                raise StepPending(f"the guide's hint has {len(hint['tokens'])} tokens so far")
        return list(hint["tokens"]), list(hint["log_probs"]), list(hint["versions"])

    def state(self) -> dict | None:
        return self.hint

    def load_state(self, state: dict) -> None:
        self.hint = {name: list(value) for name, value in state.items()}


def guide_rollout(envs: list[GuidanceEnvironment], pad: int) -> Rollout:
    """The guide's rows of played episodes: each guide prompt left-padded to the longest, then the hint (padded
    after), with its behaviour log-probs; rewards are the revisions' improvements over the attempts.  An episode
    that ended before its hint (its step raised) gives a row without response tokens and reward 0.  When the hints
    carry their guide versions (partial rollouts) the rollout holds them per token (``token_versions``) and its
    ``version`` is the oldest."""
    turns = [env.guide_turn or (env.guide_prompt([]), [], []) for env in envs]
    p = max(len(prompt) for prompt, _, _ in turns)
    n = max(1, max(len(hint) for _, hint, _ in turns))
    input_ids, attention, response_mask, log_probs, versions = response_rows(
        [prompt for prompt, _, _ in turns], [hint for _, hint, _ in turns], pad, p, n,
        [hint_log_probs for _, _, hint_log_probs in turns], versions=[env.guide_versions or None for env in envs])
    improvement = [0.0 if env.revision_reward is None else env.revision_reward - env.attempt_reward for env in envs]
    tokenizer = envs[0].tokenizer
    rollout = Rollout(input_ids, attention, response_mask, log_probs, p,
                      prompts=[tokenizer.detokenize(prompt) for prompt, _, _ in turns],
                      responses=[tokenizer.detokenize(hint) for _, hint, _ in turns],
                      rewards=torch.tensor(improvement),
                      metadata={"attempt_rewards": [env.attempt_reward for env in envs]})
    if any(env.guide_versions for env in envs):
        rollout.token_versions, rollout.version = versions, int(versions[versions >= 0].min())
    return rollout


class Guide:
    """The guide's pieces on this rank: ``backend`` (a :class:`~megalite.rlhf.backend.TrainingBackend` with its
    own optimizer and the policy's objective), ``reference`` (its frozen warm-up copy) and one sampler built
    once on its chunk (its weights are updated in place); ``clock``: what partial rollouts' hint writers sample
    with."""

    def __init__(self, backend, reference, args):
        self.backend, self.reference, self.args = backend, reference, args
        self.update_args = argparse.Namespace(**{**vars(args), "advantage": args.guide_advantage})
        self.sample = rollout_sampler(backend.chunk)
        self.clock = GuideClock()

    def writer(self, sampling: SamplingConfig, generator: torch.Generator | None) -> HintWriter:
        return hint_writer(self.sample, sampling, generator)

    def partial_writer(self, sampling: SamplingConfig) -> PartialHintWriter:
        """A fresh episode's hint writer under ``--partial-rollout-tokens`` (on :attr:`clock`)."""
        return PartialHintWriter(self.sample, sampling, self.args.partial_rollout_tokens, self.clock)

    def rollout(self, envs: list[GuidanceEnvironment], policy: Rollout, device) -> Rollout:
        """The guide's rollout of the episodes behind ``policy`` (same iteration; the same version, or under
        partial rollouts its oldest hint token's), with its reference log-probs (call in the scoring phase)."""
        start = time.monotonic()
        rollout = guide_rollout(envs, envs[0].tokenizer.pad)
        for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs", "rewards",
                     "token_versions"):
            if getattr(rollout, name) is not None:
                setattr(rollout, name, getattr(rollout, name).to(device))
        rollout.ref_log_probs = pipeline_log_probs(self.reference.module,
                                                   rollout.micro_batches(self.args.micro_batch_size),
                                                   self.args.temperature)[0].to(device)
        rollout.iteration = policy.iteration
        if rollout.token_versions is None:
            rollout.version = policy.version
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
