"""``RLTrainer``: RL (PPO, GRPO, RLOO, REINFORCE++, DAPO's pieces) on megalite's tensor/pipeline/data-parallel GPT.

One config (``megalite.rlhf.trainer_config``: pretraining's and RL's flag rows, one default each) drives the loop:
generation -> scoring (reward, reference, critic, teacher) -> advantages -> updates -> weight sync, colocated or
disaggregated (``--rollout-world-size``), on-policy or bounded-staleness (``--max-staleness``).

    trainer = RLTrainer(parse_args(argv))
    trainer.train()

The actor is first warmed up on the arithmetic task, or by SFT on ``--prompt-data``'s completions
(``megalite.rlhf.prompt_data``), or loaded with ``--load``; rollouts, scoring and the update
live in ``rollouts``, ``scoring`` and ``update``.  With ``--use-scoring-server`` the reward (and a teacher) run on
one rank; the placement plan (``megalite.rlhf.placement``) parks models and optimizer state between phases.
Under ``--lora-rank`` the warmed-up (or loaded) actor is frozen and only LoRA adapters train
(``trainer_models.attach_adapters``); the reference is that frozen base with the adapters off (no copy), and weight
sync sends the adapters alone.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.models import GPTModel
from megalite.optim import OptimizerConfig, get_optimizer
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.critic import CriticModel
from megalite.rlhf.distillation import TeacherOutput
from megalite.rlhf.guidance import GUIDE, GUIDE_REFERENCE, Guide
from megalite.rlhf.objectives import PPOActorObjective, PPOCriticObjective
from megalite.rlhf.placement import Placement
from megalite.rlhf.reference import LoRABaseReference, ReferenceModel
from megalite.rlhf.reward_model import RewardModelScorer
from megalite.rlhf.rollout_ranks import exchange_state, rollout_layout, saves_at, serve_rollouts
from megalite.rlhf.rollouts import Rollouts, lookahead, rollout_sampler
from megalite.rlhf.scoring import REWARD_MODEL, TEACHER, reward_function, served_scores
from megalite.rlhf.scoring_server import Prefetcher, ScoringServer
from megalite.rlhf.target import PolyakTarget
from megalite.rlhf.trainer_checkpoint import check_resume, claim, load_frozen, load_trained, save_frozen, save_trained
from megalite.rlhf.trainer_config import actor_config, validate
from megalite.rlhf.trainer_log import eval_line, evaluate, iteration_line, sample_lines
from megalite.rlhf.trainer_models import attach_adapters, build, build_teacher, pipeline_chunk, pretrain
from megalite.rlhf.update import rl_update
from megalite.rlhf.weight_sync import TRAINER, SyncRole, WeightSync
from megalite.training.lr_schedule import LRScheduler
from megalite.training.metrics import MetricsLogger

ACTOR, CRITIC, REFERENCE, TARGET_CRITIC = "actor", "critic", "reference", "target critic"
"""The trained and frozen models' names in the placement plan (the guide's are ``guidance.GUIDE``,
``GUIDE_REFERENCE``)."""


class RLTrainer:
    """The RL loop of one rank.  ``args`` is the config from ``trainer_config.parse_args``; it is validated here
    (before any collective) against ``world_size`` (default: the running world, else ``$WORLD_SIZE``)."""

    def __init__(self, args: argparse.Namespace, world_size: int | None = None):
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        validate(args, world_size)
        self.resume = check_resume(args)
        self.args, self.world_size = args, world_size

    def build_placement(self, device, actor, critic, reference, reward, teacher_model, target,
                        guide: Guide | None = None) -> Placement:
        """This rank's models in the placement plan: the trained actor (and critic, and the guidance flow's
        guide), the references, the reward model and teacher where this rank holds them (moved per request on the
        scoring-server rank) and the target critic (also used in training when stale rollouts recompute their
        values)."""
        args = self.args
        placement = Placement(args.offload, device)
        placement.add_trained(ACTOR, actor.chunk, actor.optimizer)
        if critic is not None:
            placement.add_trained(CRITIC, critic.chunk, critic.optimizer)
        if isinstance(reference, ReferenceModel):  # not a LoRA policy's base, which is the actor's own weights
            placement.add_frozen(REFERENCE, reference.module)
        if guide is not None:
            placement.add_trained(GUIDE, guide.backend.chunk, guide.backend.optimizer)
            placement.add_frozen(GUIDE_REFERENCE, guide.reference.module)
        if isinstance(reward, RewardModelScorer):
            placement.add_frozen(REWARD_MODEL, reward.model, on_demand=args.use_scoring_server)
        if teacher_model is not None:
            placement.add_frozen(TEACHER, teacher_model, on_demand=True)
        if target is not None:
            placement.add_target(TARGET_CRITIC, *target, phases=("scoring", "training") if args.max_staleness
                                 else ("scoring",))
        return placement

    def _policy_backend(self, chunk, lr: float, trained: list | None = None) -> TrainingBackend:
        """A policy's (the actor's, the guide's) training backend: its own optimizer at ``lr`` over ``trained``
        (default ``[chunk]``; LoRA: the adapters), the PPO objective."""
        args, trained = self.args, trained or [chunk]
        optimizer = get_optimizer(OptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0), trained)
        return TrainingBackend(chunk, optimizer, PPOActorObjective(args.ppo, args.temperature,
                                                                   distill_coef=args.distill_coef),
                               args.micro_batch_size, self.topo, trained, micro_batch_tokens=args.micro_batch_tokens)

    def train(self) -> int:
        """Runs the whole job on this rank (a rollout rank serves rollouts instead); 0 when done.  Afterwards
        ``self.actor`` (and ``self.critic``, ``self.guide``) hold the trained models."""
        owns_process_group = not dist.is_initialized()
        if self._setup():
            self._loop()
        if owns_process_group:
            topology.destroy()
        return 0

    def _setup(self) -> bool:
        """Topology, models, placement and the rollout stream; False on a rollout rank (it served rollouts)."""
        args, world_size = self.args, self.world_size
        torch.set_num_threads(1)
        trainers = world_size - args.rollout_world_size
        self.topo = topo = topology.initialize(tp=args.tensor_model_parallel_size,
                                               pp=args.pipeline_model_parallel_size, ranks=list(range(trainers)))
        self.device = device = topology.device()
        torch.manual_seed(args.seed)
        config = actor_config(args)
        single_group = dist.new_subgroups(group_size=1)[0] if args.reward_model or args.use_teacher else None
        self.sync = self.group = None  # group: the trainer ranks' (None: the world's) for checkpoints
        if args.rollout_world_size:
            self.group = dist.new_group(list(range(trainers)))
            rtp = args.rollout_tensor_parallel_size
            rollout_tp_groups = {start: dist.new_group(list(range(start, start + rtp)))
                                 for start in range(trainers, world_size, rtp)}
            trainer_dp = [None] * world_size
            dist.all_gather_object(trainer_dp, topo.dp.rank if topo.global_rank < trainers else -1)
            if topo.global_rank >= trainers:
                start = trainers + (topo.global_rank - trainers) // rtp * rtp
                serve_rollouts(args, config, device, rollout_tp_groups[start], trainer_dp, self.resume)
                return False
        actor_chunk = pretrain(args, topo, config, device, resume=self.resume is not None)
        self.lock = claim(args, actor_chunk, self.resume or 0, topo, self.group) if args.save else None
        role = SyncRole(TRAINER, topo.dp.rank, topo.tp.rank, topo.tp.size)
        if args.rollout_world_size:  # the plans now; the weights go once they are final (after a resume's load)
            self.sync = base_sync = WeightSync(actor_chunk, role)
        trained = [actor_chunk]
        if args.lora is None:
            self.reference = ReferenceModel(pipeline_chunk(GPTModel, config, topo, device), source=actor_chunk)
        else:  # the base is frozen from here on (and is the reference); the engines apply the adapters unmerged
            actor_chunk, adapters = attach_adapters(args, actor_chunk, topo, device)
            self.reference, trained = LoRABaseReference(actor_chunk), [adapters]
            if self.sync is not None:  # the base goes once, then every sync moves the adapters alone
                self.sync = WeightSync(adapters, role)
        self.actor = self._policy_backend(actor_chunk, args.actor_lr, trained)
        self.guide = None
        if args.environment == "guidance":  # a second actor: its own warm-up, optimizer and reference
            guide_chunk = pretrain(args, topo, config, device, resume=self.resume is not None, guide=True)
            self.guide = Guide(self._policy_backend(guide_chunk, args.guide_lr),
                               ReferenceModel(pipeline_chunk(GPTModel, config, topo, device), source=guide_chunk),
                               args)
        self.critic = critic_chunk = self.target = None
        if args.advantage.needs_critic:
            critic_chunk, critic_optimizer = build(CriticModel, config, topo, args.critic_lr, device)
            self.critic = TrainingBackend(critic_chunk, critic_optimizer, PPOCriticObjective(args.ppo),
                                          args.micro_batch_size, topo, micro_batch_tokens=args.micro_batch_tokens)
            if args.target_critic_tau is not None:
                self.target = (pipeline_chunk(CriticModel, config, topo, device),
                               PolyakTarget(critic_chunk.module, args.target_critic_tau))
        self.schedulers = {name: LRScheduler(backend.optimizer, settings,
                                             override_opt_param_scheduler=args.override_opt_param_scheduler,
                                             use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler)
                           for name, backend, settings in ((ACTOR, self.actor, args.actor_schedule),
                                                           (CRITIC, self.critic, args.critic_schedule))
                           if backend is not None}
        owner = topo.global_rank == args.scoring_server_rank
        self.reward = reward_function(args, owner or not args.use_scoring_server, single_group, device)
        teacher_model = teacher = None
        if args.use_scoring_server and owner and args.use_teacher:
            teacher_model, teacher = build_teacher(args, config, single_group, device)
        self.placement = self.build_placement(device, self.actor, self.critic, self.reference, self.reward,
                                              teacher_model, self.target, self.guide)
        if topo.global_rank == 0 or (owner and args.use_scoring_server):
            print(f"rank {topo.global_rank} {self.placement.table()}", flush=True)
        self.value_model = self.target[0] if self.target is not None else critic_chunk
        self.rollouts = Rollouts(args, topo, self.actor, self.reference, self.value_model, device, self.reward,
                                 self.placement, self.guide)
        self.base = None  # a LoRA run: the iteration --save holds its base at
        if self.resume is not None:
            self._load()
        if self.sync is not None:  # the rollout ranks generate with the warmed-up or loaded weights: the base, then
            if base_sync is not self.sync:  # a LoRA run's adapters (rollout_ranks.serve_rollouts receives them so)
                base_sync.sync()
            self.sync.sync()
        self.scoring_server = None
        if args.use_scoring_server:
            per_token = (False,) + ((True,) * (2 if args.teacher_topk is None else 3) if args.use_teacher else ())
            serve = served_scores(self.reward, teacher, args.prompt_width, self.placement) if owner \
                else None
            self.scoring_server = ScoringServer(serve, owner=args.scoring_server_rank, per_token=per_token,
                                                device=device)
            self.stream = Prefetcher(self.scoring_server, self.rollouts,  # partial rollouts: made in rounds
                                     0 if args.partial_rollout_tokens else args.max_staleness,
                                     inputs_of=lambda r: (r.input_ids, r.attention_mask), pending=self.rollouts.ahead)
        else:
            depth = 0 if self.sync or args.partial_rollout_tokens else args.max_staleness  # partial: made in rounds
            self.stream = ((r, (r.rewards,)) for r in lookahead(self.rollouts, depth, self.rollouts.ahead))
        self.eval_sample = (self.rollouts.sample or rollout_sampler(actor_chunk)) if args.eval_interval else None
        return True

    def _loop(self) -> None:
        """Update on each scored rollout, sync the weights, log, evaluate and save."""
        args, topo, placement = self.args, self.topo, self.placement
        logger = MetricsLogger(topo.global_rank == 0, args.metrics_file, args.tensorboard_dir, args.train_iters,
                               stream=open(os.devnull, "w"))
        if args.eval_interval and self.resume is None:
            self._evaluate(0, logger)
        last, last_cpu = time.monotonic(), time.process_time()  # wall and this process's CPU time per iteration
        for rollout, served in self.stream:
            teacher = TeacherOutput.from_outputs(served[1:]) if args.use_teacher else None
            rollout.rewards = served[0]
            with placement.phase("training"):
                metrics = rl_update(rollout, args, topo, self.actor, self.critic, self.device, self.rollouts.version,
                                    teacher, self.value_model)
                if self.target is not None:
                    placement.update_target(TARGET_CRITIC, self.critic.chunk.module)
                if self.guide is not None:
                    metrics.update(self.guide.update(rollout.metadata["guide"], topo, self.device,
                                                     self.rollouts.version))
            for name, scheduler in self.schedulers.items():  # the LR this iteration ran at, then the next one's
                metrics[f"{name}_lr"] = scheduler.get_lr()
                scheduler.step(args.global_batch_size)
            metrics.update(placement.take_metrics())
            if args.use_scoring_server:
                metrics["scorer_staleness"] = float(self.stream.staleness[-1])
            self.rollouts.version += 1
            if self.sync is not None and rollout.iteration <= args.train_iters - args.max_staleness - 1:
                start_sync, sent = time.monotonic(), self.sync.bytes_sent
                self.sync.sync()
                metrics.update(time_sync_s=time.monotonic() - start_sync,
                               sync_bytes_sent=float(self.sync.bytes_sent - sent))
            metrics["time_iteration_s"], last = time.monotonic() - last, time.monotonic()
            metrics["time_iteration_cpu_s"], last_cpu = time.process_time() - last_cpu, time.process_time()
            metrics["samples_per_s"] = (args.global_batch_size * args.n_samples_per_prompt
                                        * args.guide_samples_per_attempt / metrics["time_iteration_s"])
            logger.log(rollout.iteration, metrics)
            if topo.global_rank == 0:
                print(iteration_line(rollout.iteration, args.train_iters, metrics), flush=True)
                if args.sample_interval and rollout.iteration % args.sample_interval == 0:
                    print("\n".join(sample_lines(rollout)), flush=True)
            if args.eval_interval and rollout.iteration % args.eval_interval == 0:
                self._evaluate(rollout.iteration, logger)
            if saves_at(args, rollout.iteration):
                self._save(rollout.iteration)
        if self.scoring_server is not None:
            self.scoring_server.close()
        logger.close()
        if self.lock is not None:
            self.lock.release()

    def _evaluate(self, iteration: int, logger: MetricsLogger) -> None:
        """Greedy evaluation (``trainer_log.evaluate``) after ``iteration`` updates (0: the warmed-up or loaded
        actor, before RL), logged and printed."""
        with self.placement.phase("generation"):
            valid = evaluate(self.eval_sample, self.args, self.rollouts.sampling, self.reward, self.topo,
                             self.device, iteration)
        logger.log(iteration, valid)
        if self.topo.global_rank == 0:
            print(eval_line(iteration, valid), flush=True)

    def _save(self, iteration: int) -> None:
        """The whole RL state (``trainer_checkpoint``; the rollout ranks' gathered on rank 0), each model in the
        phase where it is resident."""
        rollout_ranks = None
        if self.args.rollout_world_size:
            gathered = exchange_state(None)
            rollout_ranks = gathered and {"layout": rollout_layout(self.args),
                                          "ranks": gathered[self.world_size - self.args.rollout_world_size:]}
        with self.placement.phase("scoring"):
            save_frozen(self.args.save, iteration, self.reference, self.target, self.guide, self.group)
        with self.placement.phase("training"):
            self.base = save_trained(self.args.save, iteration, self.args, self.topo, self.actor, self.critic,
                                     self.rollouts, self.schedulers, self.base, self.guide, self.group,
                                     rollout_ranks)

    def _load(self) -> None:
        """The RL state of ``--load`` at iteration ``self.resume``; the rollouts continue after it."""
        with self.placement.phase("scoring"):
            load_frozen(self.args.load, self.resume, self.reference, self.target, self.guide, self.group)
        with self.placement.phase("training"):
            rl = load_trained(self.args.load, self.resume, self.args, self.topo, self.actor, self.critic,
                              self.rollouts, self.schedulers, self.guide, self.group)
        if self.args.save and os.path.realpath(self.args.save) == os.path.realpath(self.args.load):
            self.base = rl.get("base")  # a LoRA base already saved there
        self.rollouts.start = self.resume + 1 + len(self.rollouts.ahead)  # after the rollouts saved ahead
        if self.topo.global_rank == 0:
            print(f"resumed the RL run of {self.args.load} at iteration {self.resume}", flush=True)
