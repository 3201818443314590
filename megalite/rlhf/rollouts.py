"""Rollouts: prompts drawn per DP rank, groups of sampled responses (the generation phase), their scores (a local
reward), reference log-probs and values (the scoring phase), and DAPO's dynamic-sampling refill, each round a
typed :class:`~megalite.rlhf.rollout_batch.Rollout`.  With ``--environment`` a round is one episode per sample,
played by ``megalite.rlhf.environment.run_episodes`` and rewarded by the environment; the guidance flow's episodes
also give the guide's rollout (``megalite.rlhf.guidance``), in ``metadata["guide"]``.

Each rollout records the policy version that made it; :func:`lookahead` draws up to ``--max-staleness`` later
rollouts ahead of the update that trains on the current one.  With ``--partial-rollout-tokens`` generations are
instead cut into rounds that continue across updates (``megalite.rlhf.partial_rollouts``; environment episodes
too, paused mid-action, and the guidance flow's hints, written in rounds by the guide's weights of the time).
With ``--rollout-world-size`` the rollouts are
generated on the rollout ranks (``megalite.rlhf.rollout_ranks``) and received here as tensors of fixed shapes
(:func:`shard_shapes`).
"""

from __future__ import annotations

import random
import time
from collections import deque

import torch
import torch.distributed as dist

from megalite.rlhf.actor import pipeline_log_probs
from megalite.rlhf.arithmetic import TOKENIZER, problem, response_text
from megalite.rlhf.critic import pipeline_values
from megalite.rlhf.env_tasks import make_environment
from megalite.rlhf.environment import EpisodeLimits, run_episodes
from megalite.rlhf.flags import RL_FLAGS
from megalite.rlhf.generation import RolloutEngine, SamplingConfig, engine_supports, generate
from megalite.rlhf.partial_rollouts import PartialEpisodes, PartialRollouts
from megalite.rlhf.rewards import varied_groups
from megalite.rlhf.rollout_batch import Rollout, left_pad
from megalite.rlhf.scoring import score_batches, shaped_scores
from megalite.rlhf.shared_groups import pack_micro_batches, row_group


def rollout_sampler(model):
    """The one switch between engines: ``sample(prompts, prompt_mask, sampling, generator)`` on one
    :class:`RolloutEngine` built for ``model`` and reused (weights updated in place) where the engine runs it
    (pp=1), else on the static pipelined decoder."""
    if engine_supports(model):
        return RolloutEngine(model).generate
    return lambda prompts, prompt_mask, sampling, generator: generate(model, prompts, prompt_mask, sampling,
                                                                      generator)


def draw_prompts(args, rng: random.Random) -> list[str]:
    """One DP rank's ``--global-batch-size`` share of prompts: from ``--prompt-data``, else "a+b=" problems."""
    if args.prompt_set is not None:
        return args.prompt_set.draw(rng, args.prompts_per_rank)
    return [problem(rng, args.max_operand) for _ in range(args.prompts_per_rank)]


def prompt_rows(args, rng: random.Random) -> list[list[int]]:
    """A batch of prompt token rows for partial rollouts: :func:`draw_prompts`, each ``--n-samples-per-prompt``
    times."""
    return [TOKENIZER.tokenize(p) for p in draw_prompts(args, rng) for _ in range(args.n_samples_per_prompt)]


def sample_shard(sample, args, sampling, rng: random.Random, iteration: int, attempt: int, shard: int,
                 device, prompts: list[str] | None = None, n: int | None = None) -> Rollout:
    """One generation round of DP shard ``shard`` with ``sample`` (:func:`rollout_sampler`): prompts (drawn with
    ``rng`` unless given) x ``n`` samples (default ``--n-samples-per-prompt``), padded to a fixed width
    ``[b, P + N]`` so rounds concatenate and the tensors can be sent."""
    n = args.n_samples_per_prompt if n is None else n
    width, new = args.prompt_width, args.max_new_tokens
    prompts = draw_prompts(args, rng) if prompts is None else prompts
    rows = [TOKENIZER.tokenize(p) for p in prompts]  # each prompt once, then its n samples' rows
    ids, mask = left_pad([row for row in rows for _ in range(n)], TOKENIZER.pad, width)
    generator = torch.Generator(device).manual_seed(args.seed + 7919 * iteration + 104729 * attempt + shard)
    out = sample(ids.to(device), mask.to(device), sampling, generator)
    b, fill = len(prompts) * n, new - out.response_mask.shape[1]
    tokens = torch.cat([out.tokens, out.tokens.new_full((b, fill), TOKENIZER.pad)], dim=1)
    attention = torch.cat([out.attention_mask, out.attention_mask.new_zeros(b, fill)], dim=1)
    response_mask = torch.cat([out.response_mask.new_zeros(b, width - 1), out.response_mask,
                               out.response_mask.new_zeros(b, fill)], dim=1)
    log_probs = torch.cat([out.log_probs.new_zeros(b, width - 1), out.log_probs, out.log_probs.new_zeros(b, fill)],
                          dim=1)
    return Rollout(tokens.long(), attention.long(), response_mask.float(), log_probs.float(), width)


def decode(rollout: Rollout) -> Rollout:
    """``rollout`` with its prompt and response text (the response up to end-of-document)."""
    width = rollout.prompt_width
    rollout.prompts = [TOKENIZER.detokenize(row) for row in rollout.prompt_ids.tolist()]
    rollout.responses = [response_text([t for t, m in zip(row, keep) if m]) for row, keep in
                         zip(rollout.response_ids.tolist(), rollout.response_mask[:, width - 1:].tolist())]
    return rollout


def shard_shapes(args) -> list[tuple[tuple[int, int], torch.dtype]]:
    """Shapes and dtypes of :func:`sample_shard`'s wire tensors, known to sender and receiver alike; partial
    rollouts add their per-token versions."""
    b, width = args.prompts_per_rank * args.n_samples_per_prompt, args.prompt_width + args.max_new_tokens
    return [((b, width), torch.long), ((b, width), torch.long), ((b, width - 1), torch.float32),
            ((b, width - 1), torch.float32)] + ([((b, width - 1), torch.long)] if args.partial_rollout_tokens else [])


def lookahead(items, depth: int, pending: deque | None = None):
    """Yield ``items`` in order, drawing up to ``depth`` later ones before handing each out (0: lazily);
    ``pending`` (default: a fresh deque) holds those drawn and not yet handed out, for a checkpoint to read."""
    pending = deque() if pending is None else pending
    for item in items:
        pending.append(item)
        if len(pending) > depth:
            yield pending.popleft()
    yield from pending


class Rollouts:
    """Draws prompts, samples groups of responses (the generation phase), scores them (local reward) and
    computes reference log-probs and values (the scoring phase); every rollout records the policy version
    (``self.version``) that made it.  ``value_model``: the critic chunk, or the target critic's; ``guide``: the
    guidance flow's :class:`~megalite.rlhf.guidance.Guide` (``--environment guidance``), else None."""

    def __init__(self, args, topo, actor, reference, value_model, device, reward, placement, guide=None):
        self.args, self.topo, self.actor, self.reference, self.guide = args, topo, actor, reference, guide
        self.value_model, self.reward, self.placement = value_model, reward, placement
        self.rollout_source = None
        if args.rollout_world_size:
            replicas = args.rollout_world_size // args.rollout_tensor_parallel_size
            self.rollout_source = topo.world_size + topo.dp.rank % replicas * args.rollout_tensor_parallel_size
        self.device = device
        self.version, self.start = 0, 1
        self.ahead: deque = deque()  # drawn ahead of the update (--max-staleness): rollouts, or (rollout, future)
        # pairs the scoring server's Prefetcher issued; a resume refills it from the checkpoint
        self.rng = random.Random(args.seed * 1000 + topo.dp.rank)
        self.sample = rollout_sampler(actor.chunk) if self.rollout_source is None else None
        self.sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod,
                                       pad_id=TOKENIZER.pad, temperature=args.temperature)
        self.limits = EpisodeLimits(**RL_FLAGS.config_values(args, "EpisodeLimits"))
        # --partial-rollout-tokens: rows in flight and finished groups waiting (rollout ranks hold their own)
        self.partial = None
        if args.partial_rollout_tokens and self.rollout_source is None:
            self.partial = PartialEpisodes(self.sample, self.sampling, args.partial_rollout_tokens, self.limits,
                                           lambda: make_environment(args, guide and guide.partial_writer(
                                               self.sampling)), args.n_samples_per_prompt) \
                if args.environment else PartialRollouts(self.sample, self.sampling, args.partial_rollout_tokens,
                                                         args.prompt_width, args.n_samples_per_prompt)

    def __iter__(self):
        for iteration in range(self.start, self.args.train_iters + 1):
            yield self.rollout(iteration)

    def _play(self, iteration: int) -> Rollout:
        """One round of ``--environment`` episodes of this DP rank: ``--n-samples-per-prompt`` episodes per task
        (equal seeds), rewarded by the environment."""
        args = self.args
        seeds = self._seeds()
        generator = torch.Generator(self.device).manual_seed(args.seed + 7919 * iteration + self.topo.dp.rank)
        guide = None
        if self.guide is not None:  # the guide samples its hints from a stream of its own
            guide = self.guide.writer(self.sampling, torch.Generator(self.device).manual_seed(
                args.seed + 7919 * iteration + self.topo.dp.rank + 104723))
        envs = [make_environment(args, guide) for _ in seeds]
        with self.placement.phase("generation"):
            rollout = run_episodes(envs, seeds, self.sample, self.sampling, self.limits, generator)
        for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs", "rewards"):
            setattr(rollout, name, getattr(rollout, name).to(self.device))
        return self._episodes(rollout)

    def _episodes(self, rollout: Rollout) -> Rollout:
        """An episodes' rollout with its environments (one per row: a guide's several hints branch episodes) kept
        as metadata ``episodes`` for the guide's rollout (the guidance flow), else dropped."""
        envs = rollout.metadata.pop("environments")
        if self.guide is not None:
            rollout.metadata["episodes"] = envs
        return rollout

    def _seeds(self) -> list[int]:
        """A batch of ``--environment`` tasks of this DP rank: ``--n-samples-per-prompt`` equal seeds per task."""
        return [s for s in (self.rng.randrange(2 ** 31) for _ in range(self.args.prompts_per_rank))
                for _ in range(self.args.n_samples_per_prompt)]

    def _continue(self, iteration: int, attempt: int, groups: int) -> Rollout:
        """Partial rollouts: rounds of at most ``--partial-rollout-tokens`` tokens per row with the current weights
        (adding a batch of new prompts whenever fewer rows than a batch are in flight) until ``groups`` groups
        have finished; the first finished groups make the batch, the rest wait, unfinished rows continue under the
        next weights.  Groups with a token more than ``--max-staleness`` updates old are dropped.  ``attempt``
        (dynamic sampling's refill round) picks the sampling stream."""
        args, n, need = self.args, self.args.n_samples_per_prompt, self.args.prompts_per_rank
        generator = torch.Generator(self.device).manual_seed(args.seed + 7919 * iteration + 104729 * attempt
                                                             + self.topo.dp.rank)

        if self.guide is not None:  # the hints written in these rounds: the guide's weights now, its own stream
            self.guide.clock.version = self.version
            self.guide.clock.generator = torch.Generator(self.device).manual_seed(
                args.seed + 7919 * iteration + 104729 * attempt + self.topo.dp.rank + 104723)

        def new_rows():
            return self._seeds() if args.environment else prompt_rows(args, self.rng)
        return self.partial.next_batch(groups, new_rows, need * n, self.version, generator, args.max_staleness,
                                       device=self.device)

    def _sample(self, iteration: int, attempt: int, groups: int | None = None) -> Rollout:
        """One generation round of this DP rank, generated here or received from its rollout rank; partial
        rollouts finish ``groups`` groups (default: a batch), the others a whole batch."""
        if self.args.environment and self.partial is None:
            return self._play(iteration)
        with self.placement.phase("generation"):
            if self.partial is not None:
                rollout = self._continue(iteration, attempt, groups or self.args.prompts_per_rank)
            elif self.rollout_source is None:
                rollout = sample_shard(self.sample, self.args, self.sampling, self.rng, iteration, attempt,
                                       self.topo.dp.rank, self.device)
            else:
                tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in shard_shapes(self.args)]
                for t in tensors:
                    dist.recv(t, src=self.rollout_source)
                tensors = [t.to(self.device) for t in tensors]
                rollout = Rollout.from_wire(tensors[:4], self.args.prompt_width)
                if len(tensors) > 4:  # partial rollouts: each token's version; the batch's is the oldest
                    rollout.token_versions, rollout.version = tensors[4], int(tensors[4][tensors[4] >= 0].min())
        if self.args.environment:  # partial episodes, rewarded by their environments
            return self._episodes(rollout)
        decode(rollout)
        if not self.args.use_scoring_server:
            with self.placement.phase("scoring"):
                rollout.rewards = score_batches(self.reward, [(rollout.prompts, rollout.responses)])[0].to(self.device)
        return rollout

    def rollout(self, iteration: int) -> Rollout:
        start = time.monotonic()
        rollout = self._sample(iteration, 0)
        kept_fraction = 1.0
        if self.args.dynamic_sampling:
            rollout, kept_fraction = self._refill(rollout, iteration)
        generate_s = time.monotonic() - start
        # The iteration's one packing of its rows: the reference's forward, the old log-probs and the update's run it.
        rollout.packing = pack_micro_batches(rollout.micro_batches(self.args.micro_batch_size),
                                             row_group(self.args), self.actor.chunk)
        micro_batches = rollout.micro_batches(self.args.micro_batch_size)
        rollout.iteration = iteration
        if rollout.token_versions is None:  # a partial rollout's version is its oldest token's
            rollout.version = self.version if self.rollout_source is None else max(0, iteration - 1
                                                                                     - self.args.max_staleness)
        with self.placement.phase("scoring"):
            with self.reference.on_device() as reference:
                ref_log_probs, _ = pipeline_log_probs(reference, micro_batches, self.args.temperature)
            rollout.ref_log_probs = ref_log_probs.to(self.device)
            if self.value_model is not None:
                rollout.old_values = pipeline_values(self.value_model, micro_batches).to(self.device)[:, :-1]
            if self.guide is not None:
                rollout.metadata["guide"] = self.guide.rollout(rollout.metadata.pop("episodes"), rollout, self.device)
        rollout.metadata.update(kept_fraction=kept_fraction, generate_s=generate_s,
                                log_probs_s=time.monotonic() - start - generate_s)
        return rollout

    def _refill(self, first: Rollout, iteration: int) -> tuple[Rollout, float]:
        """DAPO dynamic sampling: keep groups whose shaped rewards vary; generate more rounds until the batch
        is full or ``--max-num-gen-batches`` rounds ran, then fill up with dropped groups.  Partial rollouts filter
        groups once complete and ask each later round for only the groups still missing, so no kept group is
        thrown away and the rows in flight carry over to the next iteration."""
        n, need = self.args.n_samples_per_prompt, self.args.prompts_per_rank
        kept, dropped = [], []
        rollout, attempt = first, 0
        while True:
            varied = varied_groups(shaped_scores(rollout.rewards, rollout.response_mask, self.args), n)
            for group, keep in enumerate(varied.tolist()):
                (kept if keep else dropped).append(rollout.rows(group * n, group * n + n))
            attempt += 1
            if len(kept) >= need or attempt >= self.args.max_num_gen_batches:
                break
            rollout = self._sample(iteration, attempt, need - len(kept))
        fraction = min(len(kept), need) / need
        return Rollout.concat((kept + dropped)[:need]), fraction
