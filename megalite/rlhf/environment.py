"""Multi-turn environments: the ``Environment`` API and the driver that plays episodes on a sampler into a ``Rollout``.

An environment speaks tokens both ways: :meth:`Environment.reset` gives the first observation (the prompt) and
:meth:`Environment.step` takes the exact token ids the policy sampled for one turn (its action) and answers with the
next observation's token ids, the turn's reward and whether the episode is over.  The driver
(:func:`run_episodes`) appends each action and each observation to the episode's token row as they are, so the
tokens trained on are exactly the sampled ones: no earlier turn is decoded and re-tokenised.  Actions carry a loss
mask of 1 and their behaviour log-probs; observations carry a loss mask of 0.

An episode ends when the environment says so, after ``max_turns`` actions, or when it would outgrow
``max_total_tokens`` (prompt, actions and observations together); the observation returned with ``done`` (or one
that no longer fits) is not appended, since no action follows it.  A ``step`` that raises (a tool call that fails)
ends that episode with ``error_reward`` and a logged reason; the other episodes go on.  An environment that returns
the wrong type is a programming error and raises a ``TypeError`` naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from megalite.rlhf.generation import GenerationOutput, SamplingConfig
from megalite.rlhf.rollout_batch import Rollout

log = logging.getLogger(__name__)

Sampler = Callable[[torch.Tensor, torch.Tensor, SamplingConfig, "torch.Generator | None"], GenerationOutput]
"""``sample(prompts, prompt_mask, sampling, generator)``: :class:`~megalite.rlhf.generation.RolloutEngine.generate`'s
contract (``megalite.rlhf.rollouts.rollout_sampler`` picks one)."""


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns: the next observation's token ids, the turn's reward, and ``done``."""

    observation: list[int]
    reward: float = 0.0
    done: bool = False
    branches: list = field(default_factory=list)
    """Further continuations of the episode from this turn, as ``(environment, observation)`` pairs: the driver
    plays each as a row of its own right after this one, sharing the tokens so far (several hints to one attempt,
    ``megalite.rlhf.env_tasks.GuidanceEnvironment``); each environment holds its branch's state from here on."""


class Environment:
    """One episode's world.  Subclasses implement :meth:`reset` and :meth:`step`; ``tokenizer`` (``tokenize``,
    ``detokenize``, ``eod``, ``pad``) is the policy's, which an environment uses to read actions and write
    observations."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def reset(self, seed: int) -> list[int]:
        """Start an episode (the same ``seed`` gives the same task) and return its prompt's token ids."""
        raise NotImplementedError

    def step(self, action: list[int]) -> StepResult:
        """Apply one turn's sampled token ids (ending in ``tokenizer.eod`` unless cut by a budget)."""
        raise NotImplementedError

    def demonstration(self) -> list[tuple[list[int], bool]]:
        """After :meth:`reset`, a good episode's turns after the prompt as ``(token ids, is an action)`` segments:
        warm-up documents for the policy (``megalite.rlhf.env_tasks.warmup_batch``)."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstration episodes")

    def action_text(self, action: list[int]) -> str:
        """The action as text, up to (without) end-of-document: for environments that parse what the model wrote."""
        if self.tokenizer.eod in action:
            action = action[:action.index(self.tokenizer.eod)]
        return self.tokenizer.detokenize(action)


@dataclass
class EpisodeLimits:
    """Per-episode limits of :func:`run_episodes`; ``error_reward`` is the final reward of an episode whose
    ``step`` raised."""

    max_turns: int = 3
    max_total_tokens: int = 48
    error_reward: float = -1.0

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


def _token_ids(value, env: Environment, what: str) -> list[int]:
    """``value`` as a list of ints, or a TypeError naming the environment and what it returned."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        return value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise TypeError(f"{type(env).__name__}.{what} must return token ids (a list of ints), got "
                    f"{type(value).__name__}: {value!r:.80}")


def _checked(result, env: Environment) -> StepResult:
    if not isinstance(result, StepResult):
        raise TypeError(f"{type(env).__name__}.step must return a StepResult(observation, reward, done), got "
                        f"{type(result).__name__}: {result!r:.80}")
    if not isinstance(result.reward, (int, float)) or isinstance(result.reward, bool):
        raise TypeError(f"{type(env).__name__}.step returned a reward of type {type(result.reward).__name__}, "
                        f"not a number")
    branches = []
    for branch in result.branches:
        if not (isinstance(branch, tuple) and len(branch) == 2 and isinstance(branch[0], Environment)):
            raise TypeError(f"{type(env).__name__}.step returned a branch that is not an (Environment, observation) "
                            f"pair: {branch!r:.80}")
        branches.append((branch[0], _token_ids(branch[1], env, "step's branch observation")))
    return replace(result, observation=_token_ids(result.observation, env, "step's observation"),
                   reward=float(result.reward), done=bool(result.done), branches=branches)


@dataclass
class _Episode:
    env: Environment
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def append(self, ids: list[int], log_probs: list[float] | None) -> None:
        """Actions (with their behaviour log-probs, trained) or an observation (``None``: not trained)."""
        self.tokens += ids
        self.trained += [1.0 if log_probs is not None else 0.0] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def branch(self, env: Environment) -> "_Episode":
        """A copy of this episode so far that continues in ``env``."""
        return _Episode(env, list(self.prompt), list(self.tokens), list(self.trained), list(self.log_probs),
                        list(self.spans), list(self.turn_rewards))

    def observe(self, observation: list[int], done: bool, limits: "EpisodeLimits") -> None:
        """After a turn's step: the episode ends (``done``, out of turns, or the observation does not fit), or the
        observation is appended for the next action."""
        fits = self.length + len(observation) < limits.max_total_tokens
        self.done = done or len(self.spans) >= limits.max_turns or not fits
        if not self.done:
            self.append(observation, None)


def _sample_actions(live: list[_Episode], sample: Sampler, sampling: SamplingConfig, limits: EpisodeLimits,
                    generator, pad_id: int) -> list[tuple[list[int], list[float]]]:
    """Each live episode's next action and its log-probs: one batched ``sample`` call per token budget (an episode
    near ``max_total_tokens`` may sample fewer tokens than ``sampling.max_new_tokens``, and no row may ask for more
    than it has room for)."""
    budgets = [min(sampling.max_new_tokens, limits.max_total_tokens - e.length) for e in live]
    actions: list = [None] * len(live)
    for budget in sorted(set(budgets), reverse=True):
        index = [i for i, b in enumerate(budgets) if b == budget]
        rows = [live[i].prompt + live[i].tokens for i in index]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = sample(ids, mask, replace(sampling, max_new_tokens=budget), generator)
        for row, i in enumerate(index):
            k = int(out.response_mask[row].sum())
            actions[i] = (out.tokens[row, width:width + k].tolist(), out.log_probs[row, :k].tolist())
    return actions


def _play_turn(episodes: list[_Episode], sample: Sampler, sampling: SamplingConfig, limits: EpisodeLimits,
               generator, pad_id: int) -> list[_Episode]:
    """One action of every live episode, then each environment's step; the episodes after it, each followed by the
    branches its step opened."""
    live = [e for e in episodes if not e.done]
    branches: dict[int, list[_Episode]] = {}
    for episode, (action, log_probs) in zip(live, _sample_actions(live, sample, sampling, limits, generator,
                                                                   pad_id)):
        start = episode.length
        episode.append(action, log_probs)
        episode.spans.append((start, episode.length))
        try:
            result = episode.env.step(list(action))
        except Exception as error:  # a failed tool call ends this episode, not the run
            episode.error = f"{type(error).__name__}: {error}"
            log.warning("episode ended by %s.step raising %s", type(episode.env).__name__, episode.error)
            episode.turn_rewards.append(limits.error_reward)
            episode.done = True
            continue
        result = _checked(result, episode.env)
        episode.turn_rewards.append(result.reward)
        branches[id(episode)] = [episode.branch(env) for env, _ in result.branches]
        for played, (_, observation) in zip([episode] + branches[id(episode)],
                                            [(episode.env, result.observation)] + result.branches):
            played.observe(observation, result.done, limits)
    return [e for episode in episodes for e in [episode] + branches.get(id(episode), [])]


def run_episodes(envs: list[Environment], seeds: list[int], sample: Sampler, sampling: SamplingConfig,
                 limits: EpisodeLimits, generator: torch.Generator | None = None,
                 prompt_width: int | None = None, response_width: int | None = None) -> Rollout:
    """Play one episode per environment (``envs[i].reset(seeds[i])``; equal seeds give a GRPO group the same task)
    to the end and return them as a :class:`Rollout`: each prompt left-padded to ``prompt_width`` (default: the
    longest), then actions and observations in order, padded after to ``response_width`` columns (default: the
    longest).  ``prompts``/``responses`` are decoded once, for logs (special ids dropped).  ``turn_spans`` hold
    the action columns; ``rewards`` each episode's summed turn rewards; metadata
    ``turn_rewards`` (per row, one per action), ``errors`` (per row, the reason a step raised, else None),
    ``turns`` and ``environments`` (per row).  A step's branches (:attr:`StepResult.branches`) add rows: each
    follows the row it branched from."""
    if len(envs) != len(seeds) or not envs:
        raise ValueError(f"run_episodes needs one seed per environment, got {len(envs)} environments and "
                         f"{len(seeds)} seeds")
    episodes = [_Episode(env, _token_ids(env.reset(seed), env, "reset")) for env, seed in zip(envs, seeds)]
    for e in episodes:
        if not e.prompt or len(e.prompt) >= limits.max_total_tokens:
            raise ValueError(f"{type(e.env).__name__}.reset gave a prompt of {len(e.prompt)} tokens; it needs "
                             f"between 1 and max_total_tokens - 1 = {limits.max_total_tokens - 1}")
    pad = sampling.pad_id
    while any(not e.done for e in episodes):
        episodes = _play_turn(episodes, sample, sampling, limits, generator, pad)
    p = prompt_width or max(len(e.prompt) for e in episodes)
    n = response_width or max(len(e.tokens) for e in episodes)
    if p < max(len(e.prompt) for e in episodes) or n < max(len(e.tokens) for e in episodes):
        raise ValueError(f"prompt_width {p} / response_width {n} are narrower than the episodes played")
    b = len(episodes)
    input_ids = torch.full((b, p + n), pad, dtype=torch.long)
    attention = torch.zeros(b, p + n, dtype=torch.long)
    trained = torch.zeros(b, p + n - 1)
    log_probs = torch.zeros(b, p + n - 1)
    spans = []
    for i, e in enumerate(episodes):
        start, end = p - len(e.prompt), p + len(e.tokens)
        input_ids[i, start:end] = torch.tensor(e.prompt + e.tokens)
        attention[i, start:end] = 1
        trained[i, p - 1:end - 1] = torch.tensor(e.trained)
        log_probs[i, p - 1:end - 1] = torch.tensor(e.log_probs)
        shift = p - len(e.prompt)
        spans.append([(s + shift, t + shift) for s, t in e.spans])
    rollout = Rollout(input_ids, attention, trained, log_probs, p, turn_spans=spans,
                      prompts=[e.env.tokenizer.detokenize(e.prompt) for e in episodes],
                      responses=[e.env.tokenizer.detokenize(e.tokens) for e in episodes],
                      rewards=torch.tensor([sum(e.turn_rewards) for e in episodes]))
    rollout.metadata.update(turn_rewards=[e.turn_rewards for e in episodes], errors=[e.error for e in episodes],
                            turns=[len(e.spans) for e in episodes], environments=[e.env for e in episodes])
    return rollout
