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
from megalite.rlhf.rollout_batch import Rollout, left_pad, response_rows

log = logging.getLogger(__name__)

Sampler = Callable[[torch.Tensor, torch.Tensor, SamplingConfig, "torch.Generator | None"], GenerationOutput]
"""``sample(prompts, prompt_mask, sampling, generator)``: :class:`~megalite.rlhf.generation.RolloutEngine.generate`'s
contract (``megalite.rlhf.rollouts.rollout_sampler`` picks one)."""


class StepPending(Exception):
    """Raised by :meth:`Environment.step` while the step waits on another model's generation (partial rollouts): the
    driver calls the same step with the same action again in its next round, so the step must be safe to repeat."""


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

    def state(self) -> dict | None:
        """JSON of what this episode's world holds beyond its seed and the actions played (another model's
        samples, which a replay could not redraw), for partial rollouts' checkpoint; None (the default): replaying
        ``reset(seed)`` and the finished actions' steps rebuilds it."""
        return None

    def load_state(self, state: dict) -> None:
        """After ``reset(seed)``, restore :meth:`state` (environments whose ``state`` is not None)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state beyond its seed and actions")

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
class Episode:
    """One episode being played: its environment, prompt and the tokens after it (actions and observations), with
    per token whether it is trained (actions), its behaviour log-prob and the policy version that sampled it (-1 on
    observations); ``spans`` the finished actions' columns, ``turn_rewards`` one per finished action.  While an
    action is being sampled (partial rollouts pause it between rounds) ``turn_start`` is where it began in
    ``tokens`` and ``turn_budget`` the tokens it may take; both are None between turns.  ``pending``: the last
    finished action's step raised :class:`StepPending` and is called again next round.  ``seed`` reset ``env``."""

    env: Environment
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    trained: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    turn_start: int | None = None
    turn_budget: int | None = None
    pending: bool = False
    seed: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def append(self, ids: list[int], log_probs: list[float] | None, version: int = -1) -> None:
        """Action tokens (with their behaviour log-probs and policy ``version``, trained) or an observation
        (``None``: not trained)."""
        self.tokens += ids
        self.trained += [1.0 if log_probs is not None else 0.0] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += [version if log_probs is not None else -1] * len(ids)

    def branch(self, env: Environment) -> "Episode":
        """A copy of this episode so far (between turns) that continues in ``env``."""
        return Episode(env, list(self.prompt), list(self.tokens), list(self.trained), list(self.log_probs),
                       list(self.versions), list(self.spans), list(self.turn_rewards), seed=self.seed)

    def observe(self, observation: list[int], done: bool, limits: "EpisodeLimits") -> None:
        """After a turn's step: the episode ends (``done``, out of turns, or the observation does not fit), or the
        observation is appended for the next action."""
        fits = self.length + len(observation) < limits.max_total_tokens
        self.done = done or len(self.spans) >= limits.max_turns or not fits
        if not self.done:
            self.append(observation, None)


def start_episode(env: Environment, seed: int, limits: EpisodeLimits) -> Episode:
    """``env.reset(seed)``'s episode, its prompt checked."""
    episode = Episode(env, _token_ids(env.reset(seed), env, "reset"), seed=seed)
    if not episode.prompt or len(episode.prompt) >= limits.max_total_tokens:
        raise ValueError(f"{type(env).__name__}.reset gave a prompt of {len(episode.prompt)} tokens; it needs "
                         f"between 1 and max_total_tokens - 1 = {limits.max_total_tokens - 1}")
    return episode


def _sample_chunks(live: list[Episode], sample: Sampler, sampling: SamplingConfig, limits: EpisodeLimits,
                   generator, pad_id: int, chunk: int | None, version: int) -> None:
    """Each live episode's action grows by up to ``chunk`` tokens (None: to its end), sampled with policy
    ``version``: one batched ``sample`` call per token budget.  A new action may take ``sampling.max_new_tokens``,
    fewer near ``max_total_tokens`` (no row may ask for more than it has room for)."""
    for e in live:
        if e.turn_start is None:
            e.turn_start, e.turn_budget = len(e.tokens), min(sampling.max_new_tokens,
                                                             limits.max_total_tokens - e.length)
    budgets = [e.turn_budget - (len(e.tokens) - e.turn_start) for e in live]
    budgets = budgets if chunk is None else [min(chunk, b) for b in budgets]
    for budget in sorted(set(budgets), reverse=True):
        index = [i for i, b in enumerate(budgets) if b == budget]
        rows = [live[i].prompt + live[i].tokens for i in index]
        width = max(len(r) for r in rows)
        out = sample(*left_pad(rows, pad_id, width), replace(sampling, max_new_tokens=budget), generator)
        for row, i in enumerate(index):
            live[i].append(*out.sampled(row, width), version)


def play_round(episodes: list[Episode], sample: Sampler, sampling: SamplingConfig, limits: EpisodeLimits,
               generator=None, chunk: int | None = None, version: int = 0) -> list[Episode]:
    """Every live episode's action grows by up to ``chunk`` tokens (None: a whole action) with policy ``version``;
    each action that ended (end-of-document or its budget) goes to its environment's step, and each step that was
    pending (:class:`StepPending`) is called again instead of sampling.  Returns the episodes, each followed by the
    branches its step opened."""
    live = [e for e in episodes if not e.done]
    _sample_chunks([e for e in live if not e.pending], sample, sampling, limits, generator, sampling.pad_id, chunk,
                   version)
    branches: dict[int, list[Episode]] = {}
    for episode in live:
        if not episode.pending:
            action = episode.tokens[episode.turn_start:]
            if action[-1] != sampling.eos_id and len(action) < episode.turn_budget:
                continue  # paused mid-action: the next round continues it
            episode.spans.append((len(episode.prompt) + episode.turn_start, episode.length))
            episode.turn_start = episode.turn_budget = None
        start, end = episode.spans[-1]
        action = (episode.prompt + episode.tokens)[start:end]
        try:
            result = episode.env.step(action)
        except StepPending:  # the step waits on another model: called again next round
            episode.pending = True
            continue
        except Exception as error:  # a failed tool call ends this episode, not the run
            episode.error = f"{type(error).__name__}: {error}"
            log.warning("episode ended by %s.step raising %s", type(episode.env).__name__, episode.error)
            episode.turn_rewards.append(limits.error_reward)
            episode.done, episode.pending = True, False
            continue
        episode.pending = False
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
    to the end and return them as a :class:`Rollout` (:func:`episodes_rollout`)."""
    if len(envs) != len(seeds) or not envs:
        raise ValueError(f"run_episodes needs one seed per environment, got {len(envs)} environments and "
                         f"{len(seeds)} seeds")
    episodes = [start_episode(env, seed, limits) for env, seed in zip(envs, seeds)]
    while any(not e.done for e in episodes):
        episodes = play_round(episodes, sample, sampling, limits, generator)
    return episodes_rollout(episodes, sampling.pad_id, prompt_width, response_width)


def episodes_rollout(episodes: list[Episode], pad: int, prompt_width: int | None = None,
                     response_width: int | None = None, token_versions: bool = False) -> Rollout:
    """Finished episodes as a :class:`Rollout`: each prompt left-padded to ``prompt_width`` (default: the
    longest), then actions and observations in order, padded after to ``response_width`` columns (default: the
    longest).  ``prompts``/``responses`` are decoded once, for logs (special ids dropped).  ``turn_spans`` hold
    the action columns; ``rewards`` each episode's summed turn rewards; metadata
    ``turn_rewards`` (per row, one per action), ``errors`` (per row, the reason a step raised, else None),
    ``turns`` and ``environments`` (per row).  A step's branches (:attr:`StepResult.branches`) add rows: each
    follows the row it branched from.  With ``token_versions`` (partial rollouts) the rollout holds each token's
    policy version, and its ``version`` is the oldest."""
    p = prompt_width or max(len(e.prompt) for e in episodes)
    n = response_width or max(len(e.tokens) for e in episodes)
    if p < max(len(e.prompt) for e in episodes) or n < max(len(e.tokens) for e in episodes):
        raise ValueError(f"prompt_width {p} / response_width {n} are narrower than the episodes played")
    input_ids, attention, trained, log_probs, versions = response_rows(
        [e.prompt for e in episodes], [e.tokens for e in episodes], pad, p, n, [e.log_probs for e in episodes],
        trained=[e.trained for e in episodes], versions=[e.versions for e in episodes])
    spans = [[(s + p - len(e.prompt), t + p - len(e.prompt)) for s, t in e.spans] for e in episodes]
    rollout = Rollout(input_ids, attention, trained, log_probs, p, turn_spans=spans,
                      prompts=[e.env.tokenizer.detokenize(e.prompt) for e in episodes],
                      responses=[e.env.tokenizer.detokenize(e.tokens) for e in episodes],
                      rewards=torch.tensor([sum(e.turn_rewards) for e in episodes]))
    if token_versions:
        rollout.token_versions, rollout.version = versions, int(versions[versions >= 0].min())
    rollout.metadata.update(turn_rewards=[e.turn_rewards for e in episodes], errors=[e.error for e in episodes],
                            turns=[len(e.spans) for e in episodes], environments=[e.env for e in episodes])
    return rollout
