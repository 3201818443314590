"""Partial rollouts: long generations that continue across weight updates, each token keeping the behaviour log-prob
of the weights that sampled it.

With a bounded generation budget per iteration (Kimi k1.5's and verl's partial rollouts), a round decodes at most
``chunk_tokens`` more tokens of every unfinished row; the rows that end (end-of-document, or ``max_new_tokens``
in all) leave as a typed :class:`~megalite.rlhf.rollout_batch.Rollout`, the others wait for the next round, which
samples their continuation (prompt and tokens so far as its prefix) with the weights of that time.  A finished
row therefore mixes tokens of several policy versions: its ``behaviour_log_probs`` hold, per token, the log-prob
under the weights that sampled that token; ``token_versions`` (aligned like ``response_mask``, -1 off the
response) says which version that was, and ``version`` is the oldest, so that ``rl_update`` checks the
staleness bound (``--max-staleness``) against it and, with stale tokens, recomputes the old log-probs and weighs
each token by its own behaviour log-prob (``--rollout-is-*``).

Finished groups wait in order until a batch takes them (:meth:`PartialRollouts.take`).  The rows in flight and the
finished ones (tokens, per-token log-probs and versions) are plain JSON (:meth:`PartialRollouts.state`), which the RL
checkpoint stores per rank, so a resumed run continues every row where it stopped.

:class:`PartialEpisodes` does the same for multi-turn environment episodes (``megalite.rlhf.environment``): a round
grows every unfinished action by at most ``chunk_tokens`` tokens, an action that ends goes to its environment's
step (whose observation tokens keep loss mask 0 and version -1), and an episode paused mid-action continues after
the weight update.  Its state holds each episode's seed and tokens; a resume rebuilds an episode's environment by
``reset(seed)`` and replaying its finished actions' steps (environments are deterministic given both), or, for
an environment that holds another model's samples (the guidance flow's hint, itself written in rounds), by
restoring its own :meth:`~megalite.rlhf.environment.Environment.state`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megalite.rlhf.environment import Episode, EpisodeLimits, episodes_rollout, play_round, start_episode
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.rollout_batch import Rollout, left_pad, response_rows


@dataclass
class _Row:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class PartialRollouts:
    """Unfinished generations of one rank.  ``sample``: ``rollout_sampler``'s contract (weights updated in place
    between rounds); ``sampling.max_new_tokens``: the whole response budget of a row; ``chunk_tokens``: tokens a
    row may gain per :meth:`advance`; ``prompt_width``: every prompt's left-padded width in the rollouts;
    ``group_size``: rows are added and leave in groups of this many consecutive rows (a GRPO group leaves when
    its last row ends)."""

    def __init__(self, sample, sampling: SamplingConfig, chunk_tokens: int, prompt_width: int, group_size: int = 1):
        if not isinstance(chunk_tokens, int) or not 1 <= chunk_tokens <= sampling.max_new_tokens:
            raise ValueError(f"chunk_tokens must be an integer in [1, max_new_tokens={sampling.max_new_tokens}], "
                             f"got {chunk_tokens!r}")
        self.sample, self.sampling, self.chunk_tokens, self.prompt_width = sample, sampling, chunk_tokens, prompt_width
        self.group_size = group_size
        self.rows: list[_Row] = []
        self.finished: list[_Row] = []
        """Rows of finished groups that no batch has taken yet, in the order they finished."""

    def __len__(self) -> int:
        """The rows in flight."""
        return len(self.rows)

    def state(self) -> dict:
        """The rows in flight and the finished ones, as JSON: ``[prompt, tokens, log-probs, versions]`` each."""
        def rows(rows):
            return [[row.prompt, row.tokens, row.log_probs, row.versions] for row in rows]
        return {"rows": rows(self.rows), "finished": rows(self.finished)}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`'s rows (replacing this object's)."""
        self.rows = [_Row(*map(list, row)) for row in state["rows"]]
        self.finished = [_Row(*map(list, row)) for row in state["finished"]]

    def add(self, prompts: list[list[int]]) -> None:
        """New rows (prompt token ids, at most ``prompt_width`` each; whole groups) to generate, after the
        unfinished ones."""
        if len(prompts) % self.group_size:
            raise ValueError(f"{len(prompts)} rows are not whole groups of {self.group_size}")
        for prompt in prompts:
            if not 1 <= len(prompt) <= self.prompt_width:
                raise ValueError(f"a prompt of {len(prompt)} tokens does not fit prompt_width {self.prompt_width}")
        self.rows += [_Row(list(prompt)) for prompt in prompts]

    def _done(self, row: _Row) -> bool:
        return len(row.tokens) == self.sampling.max_new_tokens or (bool(row.tokens)
                                                                   and row.tokens[-1] == self.sampling.eos_id)

    def advance(self, version: int, generator: torch.Generator | None = None, device="cpu") -> Rollout | None:
        """One :meth:`round`; the finished groups leave, in their order, as a Rollout (None when none did)."""
        self.round(version, generator, device)
        finished, self.finished = self.finished, []
        return self.rollout(finished, device) if finished else None

    def take(self, groups: int, version: int, max_staleness: int, device="cpu") -> Rollout | None:
        """The first ``groups`` finished groups as a Rollout, once that many have finished (else None), after
        dropping those with a token more than ``max_staleness`` versions older than ``version``."""
        g = self.group_size
        waiting = [self.finished[i:i + g] for i in range(0, len(self.finished), g)]
        waiting = [group for group in waiting
                   if version - min(v for row in group for v in row.versions if v >= 0) <= max_staleness]
        self.finished = [row for group in waiting for row in group]
        if len(waiting) < groups:
            return None
        batch, self.finished = self.finished[:groups * g], self.finished[groups * g:]
        return self.rollout(batch, device)

    def next_batch(self, groups: int, new_rows, batch_rows: int, version: int, generator: torch.Generator | None,
                   max_staleness: int, trained_at: int | None = None, device="cpu") -> Rollout:
        """Rounds with policy ``version`` (adding ``new_rows()`` whenever fewer than ``batch_rows`` rows are in
        flight) until ``groups`` groups have finished: the first ones, as a Rollout (:meth:`take`; groups stale
        against ``trained_at``, the version that will train on them, default ``version``, are dropped)."""
        while True:
            rollout = self.take(groups, version if trained_at is None else trained_at, max_staleness, device)
            if rollout is not None:
                return rollout
            if len(self) < batch_rows:
                self.add(new_rows())
            self.round(version, generator, device)

    def round(self, version: int, generator: torch.Generator | None = None, device="cpu") -> None:
        """One round: every unfinished row samples up to ``chunk_tokens`` more tokens with the current weights
        (policy ``version``; one ``sample`` call per remaining budget); the groups whose rows have all ended join
        :attr:`finished`, in their order."""
        budgets = [0 if self._done(row) else min(self.chunk_tokens, self.sampling.max_new_tokens - len(row.tokens))
                   for row in self.rows]
        for budget in sorted(set(budgets) - {0}, reverse=True):
            index = [i for i, b in enumerate(budgets) if b == budget]
            prefixes = [self.rows[i].prompt + self.rows[i].tokens for i in index]
            width = max(len(p) for p in prefixes)
            ids, mask = left_pad(prefixes, self.sampling.pad_id, width)
            out = self.sample(ids.to(device), mask.to(device), replace(self.sampling, max_new_tokens=budget),
                              generator)
            for r, i in enumerate(index):
                tokens, log_probs = out.sampled(r, width)
                row = self.rows[i]
                row.tokens += tokens
                row.log_probs += log_probs
                row.versions += [version] * len(tokens)
        self._settle()

    def _settle(self) -> None:
        """The groups whose rows have all ended join :attr:`finished`, in their order."""
        g = self.group_size
        groups = [self.rows[i:i + g] for i in range(0, len(self.rows), g)]
        self.finished += [row for group in groups if all(map(self._done, group)) for row in group]
        self.rows = [row for group in groups if not all(map(self._done, group)) for row in group]

    def rollout(self, rows: list[_Row], device="cpu") -> Rollout:
        """``rows`` (finished) as a Rollout; its ``version`` is its oldest token's."""
        p = self.prompt_width
        input_ids, attention, response_mask, log_probs, versions = response_rows(
            [row.prompt for row in rows], [row.tokens for row in rows], self.sampling.pad_id, p,
            self.sampling.max_new_tokens, [row.log_probs for row in rows], versions=[row.versions for row in rows])
        return Rollout(input_ids.to(device), attention.to(device), response_mask.to(device), log_probs.to(device), p,
                       token_versions=versions.to(device), version=int(versions[versions >= 0].min()))


class PartialEpisodes(PartialRollouts):
    """Unfinished environment episodes of one rank (rows are :class:`~megalite.rlhf.environment.Episode`):
    ``make_env()`` makes a fresh environment, :meth:`add` takes seeds (whole groups), ``limits`` bound each
    episode; ``sampling.max_new_tokens`` is an action's budget and ``chunk_tokens`` what it may gain per round."""

    _FIELDS = ("seed", "prompt", "tokens", "trained", "log_probs", "versions", "spans", "turn_rewards", "done",
               "error", "turn_start", "turn_budget", "pending")

    def __init__(self, sample, sampling: SamplingConfig, chunk_tokens: int, limits: EpisodeLimits, make_env,
                 group_size: int = 1):
        super().__init__(sample, sampling, chunk_tokens, limits.max_total_tokens, group_size)
        self.limits, self.make_env = limits, make_env

    def add(self, seeds: list[int]) -> None:
        """New episodes (``make_env().reset(seed)`` each; whole groups) after the unfinished ones."""
        if len(seeds) % self.group_size:
            raise ValueError(f"{len(seeds)} episodes are not whole groups of {self.group_size}")
        self.rows += [start_episode(self.make_env(), seed, self.limits) for seed in seeds]

    def _done(self, row: Episode) -> bool:
        return row.done

    def round(self, version: int, generator: torch.Generator | None = None, device="cpu") -> None:
        """One round: every unfinished action grows by up to ``chunk_tokens`` tokens with policy ``version``, the
        ended ones are stepped; the groups whose episodes all ended join :attr:`finished`."""
        self.rows = play_round(self.rows, self.sample, self.sampling, self.limits, generator, self.chunk_tokens,
                               version)
        if len(self.rows) % self.group_size:
            raise ValueError("an environment branched an episode under partial rollouts, which keep whole groups")
        self._settle()

    def rollout(self, rows: list[Episode], device="cpu") -> Rollout:
        """``rows`` (finished) as a Rollout with each token's version; metadata ``environments`` holds the rows'
        environments."""
        rollout = episodes_rollout(rows, self.sampling.pad_id, token_versions=True)
        for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs", "rewards",
                     "token_versions"):
            setattr(rollout, name, getattr(rollout, name).to(device))
        return rollout

    def state(self) -> dict:
        """Every episode in flight and finished as JSON: its seed, tokens, per-token flags, log-probs, versions,
        finished actions' spans and rewards, the action in progress and its environment's own state (None for
        one a replay rebuilds)."""
        def rows(rows):
            return [{**{name: getattr(row, name) for name in self._FIELDS}, "env": row.env.state()} for row in rows]
        return {"rows": rows(self.rows), "finished": rows(self.finished)}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`'s episodes: each environment is reset with its seed and restores its own state, or
        replays its finished actions' steps."""
        def episode(saved: dict) -> Episode:
            env = self.make_env()
            env.reset(saved["seed"])
            env_state = saved.get("env")
            row = Episode(env, **{**{name: saved[name] for name in self._FIELDS if name in saved},
                                  "spans": [tuple(span) for span in saved["spans"]]})
            if env_state is not None:
                env.load_state(env_state)
            elif not row.done:
                ids = row.prompt + row.tokens
                for start, end in row.spans:
                    env.step(ids[start:end])
            return row
        self.rows = [episode(saved) for saved in state["rows"]]
        self.finished = [episode(saved) for saved in state["finished"]]
