"""RL (PPO, GRPO, RLOO, REINFORCE++) on single-digit additions with a tensor/pipeline/data-parallel GPT.

    torchrun --nproc_per_node 4 examples/rlhf_ppo.py             # TP2 x DP2, PPO with a critic (GAE)
    torchrun --nproc_per_node 4 examples/rlhf_ppo.py --advantage-estimator grpo --n-samples-per-prompt 4 \\
        --global-batch-size 32 --use-kl-loss                      # GRPO
    python examples/rlhf_ppo.py --tensor-model-parallel-size 1    # one process

The script first pretrains a small GPT on "a+b=c<eod>" problems just long
enough to learn the format and some of the sums (or loads it with ``--load``),
then runs RL: the actor samples ``--n-samples-per-prompt`` answers to each
"a+b=" prompt, a reward function (``--reward-fn module:function``, default the
arithmetic rule) scores them, the KL to the frozen reference model goes into
the per-token reward or, with ``--use-kl-loss``, into the loss, and
``--advantage-estimator`` turns rewards into advantages (gae trains a GPT
critic).  DAPO's pieces: ``--clip-ratio-low/--clip-ratio-high``,
``--dynamic-sampling`` (groups whose rewards are all equal are dropped and the
batch refilled) and ``--overlong-buffer-len`` shaping.

``--max-staleness S`` generates the rollouts of up to S later iterations ahead
of the update that trains on the current one; each rollout carries the policy
version that made it, the logged ``staleness`` never exceeds S, and a stale
rollout's loss is corrected by truncated importance sampling
(``--rollout-is-cap``).  S=0 is on-policy.  With ``--use-scoring-server``
the reward function runs on one rank only (``--scoring-server-rank``) and scores
the rollouts drawn ahead in the background; only token tensors travel.  With
``--distill-coef`` / ``--teacher-reward-coef`` that rank also holds a teacher
GPT whose full-vocabulary or top-k (``--teacher-topk K``) log-probs give a
forward-KL distillation loss and per-token log-prob rewards; the logged
``scorer_staleness`` counts teacher versions (0: the teacher is frozen).

Placement (megalite.rlhf.placement): rank 0 prints where each model's weights, grads and optimizer state
live in the generation, scoring and training phases.  ``--offload-frozen-models`` parks the reference,
reward model, teacher and target critic (``--target-critic-tau``: GAE on a Polyak-averaged copy of the
critic kept in host memory) in (pinned) host memory outside their phase; ``--offload-optimizer`` parks the
actor's and critic's optimizer state during generation and scoring.  The numbers do not change.  Each
iteration logs its per-phase memory (``mem_<phase>_device_bytes``, ``mem_<phase>_pool_bytes``, and
``mem_<phase>_peak_bytes`` on GPU).  Each iteration is printed and written to ``--metrics-file`` (JSON
lines) and TensorBoard.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint import load_sharded
from megalite.cli import run_cli
from megalite.data.synthetic import arithmetic_answer
from megalite.data.tokenizer import ByteTokenizer
from megalite.distributed import DDPConfig, DistributedDataParallel
from megalite.flags import ArgumentParser, Flag, FlagTable
from megalite.models import GPTConfig, GPTModel
from megalite.rlhf import (AdvantageConfig, CriticModel, LanguageModelObjective, PPOActorObjective, PPOConfig,
                           PPOCriticObjective, PolyakTarget, Prefetcher, ReferenceModel, SamplingConfig, ScoringServer,
                           TeacherOutput, TrainingBackend, compute_advantages, load_reward_fn, overlong_penalty,
                           pipeline_log_probs, pipeline_values, teacher_fn, teacher_rewards, token_rewards,
                           truncated_is_weights, varied_groups)
from megalite.rlhf.generation import engine_generate, engine_supports, generate
from megalite.rlhf.flags import RL_FLAGS
from megalite.rlhf.placement import OffloadConfig, Placement
from megalite.rlhf.weight_sync import ROLLOUT, TRAINER, SyncRole, WeightSync
from megalite.rlhf.reward_model import RewardModelScorer, check_reward_model
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.pipeline import build_chunks
from megalite.training.flags import FLAGS
from megalite.training.metrics import MetricsLogger


EXAMPLE_FLAGS = FlagTable((
    Flag("--pretrain-global-batch-size", "batches (global = over all data-parallel ranks)", default=64, type=int,
         help="sequences per pretraining step"),
    Flag("--max-operand", "pretraining", default=9, type=int, help="problems are a+b with 0 <= a, b <= this"),
    Flag("--pretrain-iters", "pretraining", default=80, type=int),
    Flag("--pretrain-lr", "pretraining", default=3e-3, type=float),
))
"""This example's own options (its arithmetic task and the short pretraining before RL)."""


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    FLAGS.add_to(p, ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--seed", "--hidden-size",
                     "--num-layers", "--num-attention-heads", "--global-batch-size", "--micro-batch-size",
                     "--train-iters", "--load", "--save", "--metrics-file", "--tensorboard-dir"],
                 defaults={"--tensor-model-parallel-size": 2, "--seed": 1234, "--hidden-size": 64, "--num-layers": 2,
                           "--global-batch-size": 128, "--micro-batch-size": 32, "--train-iters": 100,
                           "--tensorboard-dir": "runs/rlhf_ppo"},
                 helps={"--global-batch-size": "prompts per RL iteration over all data-parallel ranks",
                        "--micro-batch-size": "sequences per forward on one rank", "--train-iters": "RL iterations",
                        "--load": "directory of a pretrained actor saved with --save",
                        "--save": "save the pretrained actor here (before RL)"})
    EXAMPLE_FLAGS.add_to(p)
    RL_FLAGS.add_to(p)
    return p.parse_args(argv)


def validate(args, world_size: int) -> None:
    """Every size check before any collective; fills ``args.dp`` and the per-rank batch sizes."""
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    rollout, rollout_tp = args.rollout_world_size, args.rollout_tensor_parallel_size
    if rollout:
        if not 0 < rollout < world_size:
            raise ValueError(f"--rollout-world-size {rollout} leaves no trainer ranks in the world of {world_size}")
        if rollout_tp < 1 or rollout % rollout_tp:
            raise ValueError(f"--rollout-world-size {rollout} is not a multiple of --rollout-tensor-parallel-size "
                             f"{rollout_tp}")
        if args.use_scoring_server or args.dynamic_sampling:
            raise ValueError("--rollout-world-size runs with a local reward and without --dynamic-sampling")
    trainers = world_size - rollout
    if trainers % model_parallel:
        raise ValueError(f"{trainers} trainer ranks (world size {world_size} - --rollout-world-size {rollout}) are "
                         f"not divisible by tensor-model-parallel-size {args.tensor_model_parallel_size} x "
                         f"pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.dp = trainers // model_parallel
    for name in ("global_batch_size", "pretrain_global_batch_size"):
        if getattr(args, name) % args.dp:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is not divisible by the "
                             f"data-parallel size {args.dp}")
    args.prompts_per_rank = args.global_batch_size // args.dp
    args.pretrain_batch_per_rank = args.pretrain_global_batch_size // args.dp
    rows = args.prompts_per_rank * args.n_samples_per_prompt
    if rows % args.micro_batch_size:
        raise ValueError(f"{rows} sequences per DP rank ({args.prompts_per_rank} prompts x "
                         f"{args.n_samples_per_prompt} samples) are not divisible by --micro-batch-size "
                         f"{args.micro_batch_size}")
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {args.max_staleness}")
    if args.dynamic_sampling and (args.n_samples_per_prompt < 2 or args.use_scoring_server):
        raise ValueError(f"--dynamic-sampling needs --n-samples-per-prompt >= 2 (got {args.n_samples_per_prompt}) "
                         f"and a local reward (not --use-scoring-server)")
    if args.overlong_buffer_len > args.max_new_tokens:
        raise ValueError(f"--overlong-buffer-len {args.overlong_buffer_len} exceeds --max-new-tokens "
                         f"{args.max_new_tokens}")
    args.use_teacher = args.distill_coef > 0 or args.teacher_reward_coef > 0
    if (args.use_teacher or args.teacher_topk is not None) and not args.use_scoring_server:
        raise ValueError("--distill-coef, --teacher-reward-coef and --teacher-topk need --use-scoring-server")
    if args.teacher_topk is not None and not (args.use_teacher and 1 <= args.teacher_topk <= TOKENIZER.vocab_size):
        raise ValueError(f"--teacher-topk {args.teacher_topk} needs --distill-coef or --teacher-reward-coef > 0 and "
                         f"1 <= K <= the vocabulary size {TOKENIZER.vocab_size}")
    if not 0 <= args.scoring_server_rank < world_size:
        raise ValueError(f"--scoring-server-rank {args.scoring_server_rank} is outside the world of {world_size} ranks")
    if args.target_critic_tau is not None and not (args.advantage_estimator == "gae"
                                                   and 0.0 < args.target_critic_tau <= 1.0):
        raise ValueError(f"--target-critic-tau {args.target_critic_tau} needs --advantage-estimator gae (a critic) "
                         f"and a rate in (0, 1]")
    args.offload = OffloadConfig(**RL_FLAGS.config_values(args, "OffloadConfig"))
    args.advantage = AdvantageConfig(**RL_FLAGS.config_values(args, "AdvantageConfig"))
    args.ppo = PPOConfig(**RL_FLAGS.config_values(args, "PPOConfig"))
    if args.reward_model:
        check_reward_model(args.reward_model, TOKENIZER.vocab_size)
    else:
        args.reward = load_reward_fn(args.reward_fn)


TOKENIZER = ByteTokenizer()
ACTOR, CRITIC, REFERENCE, REWARD_MODEL, TEACHER, TARGET_CRITIC = (
    "actor", "critic", "reference", "reward model", "teacher", "target critic")


def reward_function(args, build: bool, single_group, device):
    """The ``(prompt, response) -> float`` reward on this rank (None where ``build`` is False).

    A reward model runs unsharded, in ``single_group`` (a one-rank group).
    """
    if not build:
        return None
    if not args.reward_model:
        return args.reward
    return RewardModelScorer(args.reward_model, TOKENIZER.tokenize, TOKENIZER.eod, TOKENIZER.vocab_size,
                             single_group, device)


def problem(rng: random.Random, max_operand: int) -> str:
    return f"{rng.randint(0, max_operand)}+{rng.randint(0, max_operand)}="


def response_text(response_ids: list[int]) -> str:
    """The response up to (without) end-of-document."""
    if TOKENIZER.eod in response_ids:
        response_ids = response_ids[:response_ids.index(TOKENIZER.eod)]
    return TOKENIZER.detokenize(response_ids)


def score_batches(reward, per_rank: list) -> list:
    """Scores every rank's (prompts, responses)."""
    return [torch.tensor([reward(p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
            for prompts, responses in per_rank]


def served_scores(reward, teacher, width: int, placement):
    """The owner's function for every rank's rollouts ``ids``/``attention mask`` ``[N, P + n]``: reward scores
    ``[N]`` (the text is decoded here, so only token tensors travel), then the teacher's outputs, if any.
    It runs on the owner's serving thread, so the reward model and teacher move in per request
    (``placement.using``)."""
    def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        prompts = [TOKENIZER.detokenize(row) for row in ids[:, :width].tolist()]
        responses = [response_text([t for t, m in zip(row, keep) if m])
                     for row, keep in zip(ids[:, width:].tolist(), mask[:, width:].tolist())]
        with placement.using(REWARD_MODEL) if isinstance(reward, RewardModelScorer) else nullcontext():
            scores = score_batches(reward, [(prompts, responses)])[0].to(ids.device)
        if teacher is None:
            return (scores,)
        with placement.using(TEACHER):
            return (scores,) + teacher(ids, mask)
    return run


def left_pad(rows: list[list[int]], pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pretrain_batch(rng: random.Random, args) -> dict:
    """Right-padded "a+b=c<eod>" sequences; the loss covers the answer and end-of-document."""
    rows, answer_starts = [], []
    for _ in range(args.pretrain_batch_per_rank):
        prompt = problem(rng, args.max_operand)
        rows.append(TOKENIZER.tokenize(prompt + arithmetic_answer(prompt)) + [TOKENIZER.eod])
        answer_starts.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [TOKENIZER.pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (row, start) in enumerate(zip(rows, answer_starts)):
        loss_mask[i, start - 1:len(row) - 1] = 1
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def pipeline_chunk(model_cls, config, topo, device):
    """This rank's (unwrapped) pipeline chunk of ``model_cls``, built by ``pipeline.build_chunks``."""
    [module] = build_chunks(lambda **where: model_cls(config, **where), config.num_layers, topo.pp.group)
    return module.to(device)


def build(model_cls, config, topo, lr, device):
    """This rank's DDP-wrapped pipeline chunk of ``model_cls`` and its optimizer."""
    chunk = DistributedDataParallel(pipeline_chunk(model_cls, config, topo, device), DDPConfig(), topo.dp.group,
                                    topo.expert_dp.group)
    return chunk, get_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), [chunk])


def generate_rollouts(model, prompts, prompt_mask, sampling, generator):
    """The one call that samples responses: the inference engine where it runs the model (pp=1), else the
    static pipelined decoder."""
    if engine_supports(model):
        return engine_generate(model, prompts, prompt_mask, sampling, generator)
    return generate(model, prompts, prompt_mask, sampling, generator)


def sample_shard(model, args, sampling, rng: random.Random, iteration: int, attempt: int, shard: int, device):
    """One generation round of DP shard ``shard``: prompts x n samples, padded to a fixed width
    ``[b, P + N]`` so rounds concatenate and the tensors can be sent: (tokens, attention mask,
    response mask and rollout log-probs, the last two aligned with ``tokens[:, 1:]``)."""
    n, width, new = args.n_samples_per_prompt, prompt_width(args), args.max_new_tokens
    prompts = [p for p in (problem(rng, args.max_operand) for _ in range(args.prompts_per_rank)) for _ in range(n)]
    ids, mask = left_pad([TOKENIZER.tokenize(p) for p in prompts], TOKENIZER.pad, width)
    generator = torch.Generator(device).manual_seed(args.seed + 7919 * iteration + 104729 * attempt + shard)
    out = generate_rollouts(model, ids.to(device), mask.to(device), sampling, generator)
    b, fill = len(prompts), new - out.response_mask.shape[1]
    tokens = torch.cat([out.tokens, out.tokens.new_full((b, fill), TOKENIZER.pad)], dim=1)
    attention = torch.cat([out.attention_mask, out.attention_mask.new_zeros(b, fill)], dim=1)
    response_mask = torch.cat([out.response_mask.new_zeros(b, width - 1), out.response_mask,
                               out.response_mask.new_zeros(b, fill)], dim=1)
    log_probs = torch.cat([out.log_probs.new_zeros(b, width - 1), out.log_probs, out.log_probs.new_zeros(b, fill)],
                          dim=1)
    return tokens.long(), attention.long(), response_mask.float(), log_probs.float()


def prompt_width(args) -> int:
    return len(f"{args.max_operand}+{args.max_operand}=")


def shard_shapes(args) -> list[tuple[tuple[int, int], torch.dtype]]:
    """Shapes and dtypes of :func:`sample_shard`'s tensors, known to sender and receiver alike."""
    b, width = args.prompts_per_rank * args.n_samples_per_prompt, prompt_width(args) + args.max_new_tokens
    return [((b, width), torch.long), ((b, width), torch.long), ((b, width - 1), torch.float32),
            ((b, width - 1), torch.float32)]


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
    sync = WeightSync(model, SyncRole(ROLLOUT, replica, tp_rank, rtp))
    sync.sync()
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod, pad_id=TOKENIZER.pad,
                              temperature=args.temperature)
    shards = [d for d in range(args.dp) if d % replicas == replica]
    rngs = {d: random.Random(args.seed * 1000 + d) for d in shards}
    pending = []
    for iteration in range(1, args.train_iters + 1):
        if iteration > args.max_staleness + 1:
            sync.sync()
            for work, _ in pending:
                work.wait()
            pending = []
        for shard in shards:
            tensors = sample_shard(model, args, sampling, rngs[shard], iteration, 0, shard, device)
            if tp_rank == 0:
                for dst in (r for r, d in enumerate(trainer_dp) if d == shard):
                    pending += [(dist.isend(t, dst), t) for t in tensors]
    for work, _ in pending:
        work.wait()


def lookahead(items, depth: int):
    """Yield ``items`` in order, drawing up to ``depth`` later ones before handing each out (0: lazily)."""
    pending: deque = deque()
    for item in items:
        pending.append(item)
        if len(pending) > depth:
            yield pending.popleft()
    yield from pending


class Rollouts:
    """Draws prompts, samples groups of responses (the generation phase), scores them (local reward) and
    computes reference log-probs and values (the scoring phase); every rollout records the policy version
    (``self.version``) that made it.  ``value_model``: the critic chunk, or the target critic's."""

    def __init__(self, args, topo, actor, reference, value_model, device, reward, placement):
        self.args, self.topo, self.actor, self.reference = args, topo, actor, reference
        self.value_model, self.reward, self.placement = value_model, reward, placement
        self.rollout_source = None
        if args.rollout_world_size:
            replicas = args.rollout_world_size // args.rollout_tensor_parallel_size
            self.rollout_source = topo.world_size + topo.dp.rank % replicas * args.rollout_tensor_parallel_size
        self.device = device
        self.version = 0
        self.rng = random.Random(args.seed * 1000 + topo.dp.rank)
        self.sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, eos_id=TOKENIZER.eod,
                                       pad_id=TOKENIZER.pad, temperature=args.temperature)

    def __iter__(self):
        for iteration in range(1, self.args.train_iters + 1):
            yield self.rollout(iteration)

    def _micro_batches(self, ids, mask):
        mb = self.args.micro_batch_size
        return [{"input_ids": ids[i:i + mb], "attention_mask": mask[i:i + mb]} for i in range(0, len(ids), mb)]

    def _sample(self, iteration: int, attempt: int) -> dict:
        """One generation round of this DP rank, generated here or received from its rollout rank."""
        with self.placement.phase("generation"):
            if self.rollout_source is None:
                tensors = sample_shard(self.actor.chunk, self.args, self.sampling, self.rng, iteration, attempt,
                                       self.topo.dp.rank, self.device)
            else:
                tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in shard_shapes(self.args)]
                for t in tensors:
                    dist.recv(t, src=self.rollout_source)
                tensors = [t.to(self.device) for t in tensors]
        tokens, attention, response_mask, log_probs = tensors
        width = prompt_width(self.args)
        prompts = [TOKENIZER.detokenize(row) for row in tokens[:, :width].tolist()]
        responses = [response_text([int(t) for t, m in zip(row, keep) if m])
                     for row, keep in zip(tokens[:, width:], response_mask[:, width - 1:])]
        rollout = {"prompts": prompts, "responses": responses, "input_ids": tokens, "attention_mask": attention,
                   "response_mask": response_mask, "rollout_log_probs": log_probs}
        if not self.args.use_scoring_server:
            with self.placement.phase("scoring"):
                rollout["scores"] = score_batches(self.reward, [(prompts, responses)])[0].to(self.device)
        return rollout

    def rollout(self, iteration: int) -> dict:
        start = time.monotonic()
        rollout = self._sample(iteration, 0)
        kept_fraction = 1.0
        if self.args.dynamic_sampling:
            rollout, kept_fraction = self._refill(rollout, iteration)
        generate_s = time.monotonic() - start
        micro_batches = self._micro_batches(rollout["input_ids"], rollout["attention_mask"])
        with self.placement.phase("scoring"):
            ref_log_probs, _ = pipeline_log_probs(self.reference.module, micro_batches, self.args.temperature)
            if self.value_model is not None:
                rollout["old_values"] = pipeline_values(self.value_model, micro_batches).to(self.device)[:, :-1]
        version = self.version if self.rollout_source is None else max(0, iteration - 1 - self.args.max_staleness)
        rollout.update(iteration=iteration, version=version, ref_log_probs=ref_log_probs.to(self.device),
                       kept_fraction=kept_fraction, generate_s=generate_s)
        rollout["log_probs_s"] = time.monotonic() - start - generate_s
        return rollout

    def _refill(self, first: dict, iteration: int) -> tuple[dict, float]:
        """DAPO dynamic sampling: keep groups whose shaped scores vary; generate more rounds until the batch
        is full or ``--max-num-gen-batches`` rounds ran, then fill up with dropped groups."""
        n, need = self.args.n_samples_per_prompt, self.args.prompts_per_rank
        kept, dropped, seen = [], [], 0
        rollout, attempt = first, 0
        while True:
            varied = varied_groups(shaped_scores(rollout["scores"], rollout["response_mask"], self.args), n)
            for group, keep in enumerate(varied.tolist()):
                (kept if keep else dropped).append(_rows(rollout, group * n, group * n + n))
            seen += len(varied)
            attempt += 1
            if len(kept) >= need or attempt >= self.args.max_num_gen_batches:
                break
            rollout = self._sample(iteration, attempt)
        fraction = min(len(kept), need) / need
        return _concat((kept + dropped)[:need]), fraction


def _rows(rollout: dict, start: int, end: int) -> dict:
    return {k: v[start:end] for k, v in rollout.items()}


def _concat(parts: list[dict]) -> dict:
    return {k: (torch.cat([p[k] for p in parts]) if isinstance(parts[0][k], torch.Tensor)
                else [x for p in parts for x in p[k]]) for k in parts[0]}


def shaped_scores(scores: torch.Tensor, response_mask: torch.Tensor, args) -> torch.Tensor:
    """The reward plus DAPO's overlong penalty (when ``--overlong-buffer-len`` > 0)."""
    if not args.overlong_buffer_len:
        return scores
    lengths = response_mask.sum(dim=1)
    return scores + overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer_len,
                                     args.overlong_penalty_factor).to(scores.device)


def dp_mean(value: float, topo, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=topo.dp.group)
    return float(t) / topo.dp.size


def rl_update(rollout: dict, raw_scores: torch.Tensor, args, topo, actor, critic, device, version: int,
              teacher: TeacherOutput | None = None, value_model=None) -> dict:
    """One RL iteration on ``rollout``, made by policy ``rollout["version"]`` while the actor is at ``version``;
    ``teacher``'s outputs (when served) add log-prob rewards and the distillation loss.  ``value_model`` (the
    critic's chunk or the target critic's, with ``critic``) recomputes a stale rollout's values."""
    staleness = version - rollout["version"]
    if not 0 <= staleness <= args.max_staleness:
        raise RuntimeError(f"rollout of policy version {rollout['version']} is {staleness} updates old at version "
                           f"{version}; --max-staleness is {args.max_staleness}")
    start = time.monotonic()
    ppo, mask = args.ppo, rollout["response_mask"]
    old_log_probs, old_values = rollout["rollout_log_probs"], rollout.get("old_values")
    batch = {k: rollout[k] for k in ("input_ids", "attention_mask", "response_mask")}
    if staleness:
        micro_batches = [{"input_ids": rollout["input_ids"][i:i + args.micro_batch_size],
                          "attention_mask": rollout["attention_mask"][i:i + args.micro_batch_size]}
                         for i in range(0, len(mask), args.micro_batch_size)]
        old_log_probs = pipeline_log_probs(actor.chunk, micro_batches, args.temperature)[0].to(device) * mask
        batch["is_weights"] = truncated_is_weights(old_log_probs, rollout["rollout_log_probs"], ppo.rollout_is_cap)
        if critic is not None:
            old_values = pipeline_values(value_model, micro_batches).to(device)[:, :-1]
    scores = shaped_scores(raw_scores.to(device), mask, args)
    rewards, kl = token_rewards(scores, mask, old_log_probs, rollout["ref_log_probs"],
                                0.0 if ppo.use_kl_loss else ppo.kl_coef, ppo.kl_estimator, ppo.kl_clamp)
    if teacher is not None:
        rewards = rewards + teacher_rewards(teacher, mask, args.teacher_reward_coef)
        batch["teacher_log_probs"] = teacher.log_probs.to(device)
        if teacher.indices is not None:
            batch["teacher_indices"] = teacher.indices.to(device)
    advantages, returns = compute_advantages(args.advantage, rewards, mask, old_values, topo.dp.group)
    batch.update(old_log_probs=old_log_probs, advantages=advantages)
    if ppo.use_kl_loss:
        batch["ref_log_probs"] = rollout["ref_log_probs"]
    log_probs_s = time.monotonic() - start
    critic_batch = None
    if critic is not None:
        critic_batch = {**{k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")},
                        "old_values": old_values, "returns": returns}
    for _ in range(args.ppo_epochs):
        actor_metrics = actor.forward_backward(batch)
        actor.optim_step()
        if critic is not None:
            critic_metrics = critic.forward_backward(critic_batch)
            critic.optim_step()
    metrics = {"reward": dp_mean(float(raw_scores.mean()), topo, device),
               "kl": dp_mean(float(kl.sum() / mask.sum().clamp(min=1)), topo, device),
               "policy_loss": actor_metrics["policy_loss"], "clip_fraction": actor_metrics["clip_fraction"],
               "response_length": dp_mean(float(mask.sum(dim=1).mean()), topo, device),
               "staleness": float(staleness), "kept_group_fraction": dp_mean(rollout["kept_fraction"], topo, device),
               "time_generate_s": rollout["generate_s"],
               "time_log_probs_s": rollout["log_probs_s"] + log_probs_s,
               "time_train_s": time.monotonic() - start - log_probs_s}
    if critic is not None:
        metrics["value_loss"] = critic_metrics["value_loss"]
    if ppo.use_kl_loss:
        metrics["kl_loss"] = actor_metrics["kl_loss"]
    if teacher is not None:
        metrics["teacher_log_prob"] = dp_mean(float((teacher.token_log_probs[:, :-1].to(device) * mask).sum()
                                                    / mask.sum().clamp(min=1)), topo, device)
        if args.distill_coef > 0:
            metrics["distill_kl"] = actor_metrics["distill_kl"]
    return metrics


def build_teacher(args, config, single_group, device):
    """The owner's teacher: an unsharded GPT (``--teacher-load``, else initialized from ``--seed`` + 1) and its
    served function (top-k with ``--teacher-topk``)."""
    torch.manual_seed(args.seed + 1)
    model = GPTModel(replace(config, seed=args.seed + 1), tp_group=single_group).to(device).eval()
    if args.teacher_load:
        load_sharded(args.teacher_load, [model], tp_group=single_group)
    return model, teacher_fn(model, args.teacher_topk)


def build_placement(args, device, actor, critic, reference, reward, teacher_model, target) -> Placement:
    """This rank's models in the placement plan: the trained actor (and critic), the reference, the reward
    model and teacher where this rank holds them (moved per request on the scoring-server rank) and the target
    critic (also used in training when stale rollouts recompute their values)."""
    placement = Placement(args.offload, device)
    placement.add_trained(ACTOR, actor.chunk, actor.optimizer)
    if critic is not None:
        placement.add_trained(CRITIC, critic.chunk, critic.optimizer)
    placement.add_frozen(REFERENCE, reference.module)
    if isinstance(reward, RewardModelScorer):
        placement.add_frozen(REWARD_MODEL, reward.model, on_demand=args.use_scoring_server)
    if teacher_model is not None:
        placement.add_frozen(TEACHER, teacher_model, on_demand=True)
    if target is not None:
        placement.add_target(TARGET_CRITIC, *target, phases=("scoring", "training") if args.max_staleness
                             else ("scoring",))
    return placement


def pretrain(args, topo, config, device) -> DistributedDataParallel:
    """The actor chunk, pretrained here or loaded from ``--load``."""
    chunk, optimizer = build(GPTModel, config, topo, args.pretrain_lr, device)
    backend = TrainingBackend(chunk, optimizer, LanguageModelObjective(), args.micro_batch_size, topo)
    if args.load:
        backend.load(args.load)
        return chunk
    rng = random.Random(args.seed + 17 * topo.dp.rank)
    for step in range(1, args.pretrain_iters + 1):
        batch = {k: v.to(device) for k, v in pretrain_batch(rng, args).items()}
        metrics = backend.forward_backward(batch)
        backend.optim_step()
        if topo.global_rank == 0 and (step % 20 == 0 or step == args.pretrain_iters):
            print(f"pretrain step {step}/{args.pretrain_iters} | lm_loss {metrics['lm_loss']:.4f}", flush=True)
    if args.save:
        backend.save(args.save)
    return chunk


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size)
    torch.set_num_threads(1)
    owns_process_group = not dist.is_initialized()
    trainers = world_size - args.rollout_world_size
    topo = topology.initialize(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                               ranks=list(range(trainers)))
    device = topology.device()
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=16,
                       make_vocab_size_divisible_by=8, seed=args.seed)
    single_group = dist.new_subgroups(group_size=1)[0] if args.reward_model or args.use_teacher else None
    sync = None
    if args.rollout_world_size:
        rtp = args.rollout_tensor_parallel_size
        rollout_tp_groups = {start: dist.new_group(list(range(start, start + rtp)))
                             for start in range(trainers, world_size, rtp)}
        trainer_dp = [None] * world_size
        dist.all_gather_object(trainer_dp, topo.dp.rank if topo.global_rank < trainers else -1)
        if topo.global_rank >= trainers:
            start = trainers + (topo.global_rank - trainers) // rtp * rtp
            serve_rollouts(args, config, device, rollout_tp_groups[start], trainer_dp)
            if owns_process_group:
                topology.destroy()
            return 0
    start = time.monotonic()
    actor_chunk = pretrain(args, topo, config, device)
    reference = ReferenceModel(pipeline_chunk(GPTModel, config, topo, device), source=actor_chunk)
    if args.rollout_world_size:
        sync = WeightSync(actor_chunk, SyncRole(TRAINER, topo.dp.rank, topo.tp.rank, topo.tp.size))
        sync.sync()
    actor = TrainingBackend(actor_chunk, get_optimizer(OptimizerConfig(lr=args.actor_lr, weight_decay=0.0,
                                                                       clip_grad=1.0), [actor_chunk]),
                            PPOActorObjective(args.ppo, args.temperature, distill_coef=args.distill_coef),
                            args.micro_batch_size, topo)
    critic = critic_chunk = target = None
    if args.advantage.needs_critic:
        critic_chunk, critic_optimizer = build(CriticModel, config, topo, args.critic_lr, device)
        critic = TrainingBackend(critic_chunk, critic_optimizer, PPOCriticObjective(args.ppo), args.micro_batch_size,
                                 topo)
        if args.target_critic_tau is not None:
            target = (pipeline_chunk(CriticModel, config, topo, device),
                      PolyakTarget(critic_chunk.module, args.target_critic_tau))
    owner = topo.global_rank == args.scoring_server_rank
    reward = reward_function(args, owner or not args.use_scoring_server, single_group, device)
    teacher_model = teacher = None
    if args.use_scoring_server and owner and args.use_teacher:
        teacher_model, teacher = build_teacher(args, config, single_group, device)
    placement = build_placement(args, device, actor, critic, reference, reward, teacher_model, target)
    if topo.global_rank == 0 or (owner and args.use_scoring_server):
        print(f"rank {topo.global_rank} {placement.table()}", flush=True)
    value_model = target[0] if target is not None else critic_chunk
    rollouts = Rollouts(args, topo, actor, reference, value_model, device, reward, placement)
    reward_model = None
    if args.use_scoring_server:
        per_token = (False,) + ((True,) * (2 if args.teacher_topk is None else 3) if args.use_teacher else ())
        serve = served_scores(reward, teacher, prompt_width(args), placement) if owner else None
        reward_model = ScoringServer(serve, owner=args.scoring_server_rank, per_token=per_token, device=device)
        stream = Prefetcher(reward_model, rollouts, args.max_staleness,
                            inputs_of=lambda r: (r["input_ids"], r["attention_mask"]))
    else:
        stream = ((r, (r["scores"],)) for r in lookahead(rollouts, 0 if sync else args.max_staleness))
    logger = MetricsLogger(topo.global_rank == 0, args.metrics_file, args.tensorboard_dir, args.train_iters,
                           stream=open(os.devnull, "w"))
    last = time.monotonic()
    for rollout, served in stream:
        teacher = TeacherOutput.from_outputs(served[1:]) if args.use_teacher else None
        with placement.phase("training"):
            metrics = rl_update(rollout, served[0], args, topo, actor, critic, device, rollouts.version, teacher,
                                value_model)
            if target is not None:
                placement.update_target(TARGET_CRITIC, critic_chunk.module)
        metrics.update(placement.take_metrics())
        if args.use_scoring_server:
            metrics["scorer_staleness"] = float(stream.staleness[-1])
        rollouts.version += 1
        if sync is not None and rollout["iteration"] <= args.train_iters - args.max_staleness - 1:
            start_sync, sent = time.monotonic(), sync.bytes_sent
            sync.sync()
            metrics.update(time_sync_s=time.monotonic() - start_sync, sync_bytes_sent=float(sync.bytes_sent - sent))
        metrics["time_iteration_s"], last = time.monotonic() - last, time.monotonic()
        logger.log(rollout["iteration"], metrics)
        if topo.global_rank == 0:
            print(f"rl iteration {rollout['iteration']}/{args.train_iters} | "
                  + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                  + f" | elapsed {time.monotonic() - start:.0f}s", flush=True)
    if reward_model is not None:
        reward_model.close()
    logger.close()
    if owns_process_group:
        topology.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
