"""The RL trainer's one config: the parsed rows of pretraining's and RL's flag tables, checked before any collective.

:func:`parse_args` builds the command line from the same ``Flag`` tables as pretraining (``megalite.training.flags``
for the model, batch and I/O options, ``megalite.rlhf.flags.RL_FLAGS`` for the RL ones), so every option has one
default.  :func:`validate` checks every size and combination and fills the derived values the trainer reads
(``dp``, the per-rank batch sizes and the ``AdvantageConfig``/``PPOConfig``/``OffloadConfig`` built from the rows).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from megalite.flags import ArgumentParser
from megalite.lora.state import check_model
from megalite.models import GPTConfig
from megalite.rlhf.advantages import AdvantageConfig
from megalite.rlhf.arithmetic import TOKENIZER, prompt_width
from megalite.rlhf.env_tasks import longest_demonstration
from megalite.rlhf.flags import DEFAULT_REWARD_FN, RL_FLAGS
from megalite.rlhf.placement import OffloadConfig
from megalite.rlhf.prompt_data import PromptData
from megalite.rlhf.ppo import PPOConfig
from megalite.rlhf.reward_model import check_reward_model
from megalite.rlhf.rewards import load_reward_fn
from megalite.training.flags import FLAGS, lora_config, lr_schedule_config
from megalite.training.lr_schedule import ScheduleSettings, schedule_settings

MODEL_FLAGS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--seed", "--hidden-size",
               "--num-layers", "--num-attention-heads", "--global-batch-size", "--micro-batch-size", "--train-iters",
               "--load", "--save", "--save-interval", "--override-existing-checkpoints", "--eval-interval",
               "--metrics-file", "--tensorboard-dir", "--lora-rank", "--lora-alpha", "--lora-dropout",
               "--lora-target-modules", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters",
               "--lr-warmup-fraction", "--lr-warmup-init", "--lr-wsd-decay-style", "--lr-wsd-decay-iters",
               "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"]
"""The pretraining rows the RL trainer takes (with the RL defaults and help below).  The LR schedule rows are
pretraining's (Megatron's ``OptimizerParamScheduler``, counted in RL iterations); their default stays a constant
LR."""


def parse_args(argv=None, description: str = "RL (PPO, GRPO, RLOO, REINFORCE++) on megalite's parallel GPT"
               ) -> argparse.Namespace:
    p = ArgumentParser(description=description)
    FLAGS.add_to(p, MODEL_FLAGS,
                 defaults={"--tensor-model-parallel-size": 2, "--seed": 1234, "--hidden-size": 64, "--num-layers": 2,
                           "--global-batch-size": 128, "--micro-batch-size": 32, "--train-iters": 100,
                           "--tensorboard-dir": "runs/rlhf_ppo", "--eval-interval": None,
                           "--lr-decay-style": "constant"},
                 helps={"--global-batch-size": "prompts per RL iteration over all data-parallel ranks",
                        "--micro-batch-size": "sequences per forward on one rank", "--train-iters": "RL iterations",
                        "--load": "an RL checkpoint (a --save directory) to resume from, or a pretrained actor (a "
                                  "megalite checkpoint) to start RL from instead of the warm-up",
                        "--save": "save the whole RL state here (megalite.rlhf.trainer_checkpoint) every "
                                  "--save-interval iterations and at the end",
                        "--save-interval": "RL iterations between checkpoints; None: only at the end",
                        "--eval-interval": "RL iterations between greedy evaluations on a fixed prompt set with the "
                                           "same reward (logged as valid_*); None: no evaluation",
                        "--min-lr": "the actor's LR floor of the schedule; the critic's is scaled by --critic-lr / "
                                    "--actor-lr",
                        "--lr-decay-iters": "RL iterations the LR decays over; None: --train-iters",
                        "--lora-rank": "None: RL trains every actor weight; a rank: the warmed-up (or loaded) actor is "
                                       "frozen and RL trains low-rank adapters on it, and weight sync to rollout "
                                       "ranks sends the adapters only"})
    RL_FLAGS.add_to(p)
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> None:
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
    hints = args.guide_samples_per_attempt
    if hints < 1 or (hints > 1 and args.environment != "guidance"):
        raise ValueError(f"--guide-samples-per-attempt {hints} needs a positive number and, above 1, --environment "
                         f"guidance")
    rows = args.prompts_per_rank * args.n_samples_per_prompt * hints
    if rows % args.micro_batch_size:
        raise ValueError(f"{rows} sequences per DP rank ({args.prompts_per_rank} prompts x "
                         f"{args.n_samples_per_prompt} samples" + (f" x {hints} hints" if hints > 1 else "")
                         + f") are not divisible by --micro-batch-size {args.micro_batch_size}")
    if args.micro_batch_tokens is not None and (args.micro_batch_tokens < 1 or args.pipeline_model_parallel_size > 1):
        raise ValueError(f"--micro-batch-tokens {args.micro_batch_tokens} needs a positive budget and "
                         f"--pipeline-model-parallel-size 1")
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {args.max_staleness}")
    if args.partial_rollout_tokens is not None and (
            not 1 <= args.partial_rollout_tokens <= args.max_new_tokens or hints > 1):
        raise ValueError(f"--partial-rollout-tokens {args.partial_rollout_tokens} needs 1 <= tokens <= "
                         f"--max-new-tokens {args.max_new_tokens} and --guide-samples-per-attempt 1 (several hints "
                         f"branch an episode; partial rollouts keep whole groups)")
    if args.save_interval is not None and (not args.save or args.save_interval < 1):
        raise ValueError(f"--save-interval {args.save_interval} needs --save and a positive number of iterations")
    for name in ("eval_interval", "sample_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of iterations, got "
                             f"{getattr(args, name)}")
    if args.eval_samples is not None and (args.eval_samples < 1 or not args.eval_interval):
        raise ValueError(f"--eval-samples {args.eval_samples} needs --eval-interval and at least 1 sample")
    if args.eval_interval and (args.use_scoring_server or args.reward_model):
        raise ValueError("--eval-interval scores with a --reward-fn on every rank (not --use-scoring-server or "
                         "--reward-model)")
    if args.dynamic_sampling and (args.n_samples_per_prompt < 2 or args.use_scoring_server):
        raise ValueError(f"--dynamic-sampling needs --n-samples-per-prompt >= 2 (got {args.n_samples_per_prompt}) "
                         f"and a local reward (not --use-scoring-server)")
    if args.overlong_buffer_len > args.max_new_tokens:
        raise ValueError(f"--overlong-buffer-len {args.overlong_buffer_len} exceeds --max-new-tokens "
                         f"{args.max_new_tokens}")
    if args.environment and (rollout or args.use_scoring_server or args.dynamic_sampling or args.eval_interval
                             or args.reward_model):
        raise ValueError(f"--environment {args.environment} is rewarded by the environment on the training ranks: "
                         f"it runs without --rollout-world-size, --use-scoring-server, --dynamic-sampling, "
                         f"--eval-interval and --reward-model")
    if args.environment and not args.max_new_tokens < args.max_total_tokens:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be below --max-total-tokens "
                         f"{args.max_total_tokens}")
    if args.warmup_direct_fraction is not None and args.environment != "calculator":
        raise ValueError("--warmup-direct-fraction shapes the warm-up of --environment calculator")
    if args.warmup_wrong_hint_fraction is not None and args.environment != "guidance":
        raise ValueError("--warmup-wrong-hint-fraction shapes the warm-up of --environment guidance")
    if args.environment == "guidance" and args.advantage_estimator == "gae":
        raise ValueError("--environment guidance trains a guide model beside the policy with a critic-free "
                         "--advantage-estimator (grpo, rloo, reinforce_plus_plus)")
    if args.environment and not args.load and longest_demonstration(args) > args.max_total_tokens:
        raise ValueError(f"--environment {args.environment} warm-up demonstrations up to --max-operand "
                         f"{args.max_operand} take {longest_demonstration(args)} tokens, more than "
                         f"--max-total-tokens {args.max_total_tokens}")
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
    check_prompt_data(args)
    args.actor_schedule, args.critic_schedule = (lr_schedule(args, lr, flag) for lr, flag in
                                                 ((args.actor_lr, "--actor-lr"), (args.critic_lr, "--critic-lr")))
    args.lora = lora_config(args)
    if args.lora is not None:
        check_model(args.lora, actor_config(args))
    args.offload = OffloadConfig(**RL_FLAGS.config_values(args, "OffloadConfig"))
    args.advantage = AdvantageConfig(**RL_FLAGS.config_values(args, "AdvantageConfig"))
    args.guide_advantage = args.advantage  # the guidance flow's guide: with several hints, a group is one attempt's
    if hints > 1:
        args.guide_advantage = replace(args.advantage, group_size=hints)
        args.advantage = replace(args.advantage, group_size=args.n_samples_per_prompt * hints)
    args.ppo = PPOConfig(**RL_FLAGS.config_values(args, "PPOConfig"))
    if args.reward_model:
        check_reward_model(args.reward_model, TOKENIZER.vocab_size)
    elif args.prompt_set is not None:
        args.reward = args.prompt_set.reward
    else:
        args.reward = load_reward_fn(args.reward_fn)


def lr_schedule(args: argparse.Namespace, lr: float, flag: str = "--actor-lr") -> ScheduleSettings:
    """The schedule of a model trained at peak ``lr`` (the actor's ``--actor-lr`` or the critic's ``--critic-lr``):
    pretraining's schedule flags with ``--min-lr`` and ``--lr-warmup-init`` scaled by ``lr / --actor-lr``, so both
    models follow one shape.  It advances once per RL iteration by ``--global-batch-size`` prompts, so every length
    is in RL iterations.  Errors name ``flag``, the peak's flag, where pretraining's name ``--lr``."""
    scale = lr / args.actor_lr if args.actor_lr else 1.0
    config = lr_schedule_config(args)
    config.lr_warmup_init *= scale
    try:
        return schedule_settings(config, lr=lr, min_lr=args.min_lr * scale, weight_decay=0.0,
                                 global_batch_size=args.global_batch_size, train_iters=args.train_iters)
    except ValueError as error:
        raise ValueError(str(error).replace("--lr ", f"{flag} ")) from None


def actor_config(args: argparse.Namespace) -> GPTConfig:
    """The actor's (and every RL model's) GPT architecture: the flags' sizes on the task tokenizer's vocabulary, with
    positions for the longest prompt and response (or episode)."""
    return GPTConfig(vocab_size=TOKENIZER.vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     max_position_embeddings=args.max_total_tokens if args.environment else
                     max(16, args.prompt_width + args.max_new_tokens),
                     make_vocab_size_divisible_by=8, seed=args.seed, **RL_FLAGS.config_values(args, "GPTConfig"))


def check_prompt_data(args: argparse.Namespace) -> None:
    """Reads ``--prompt-data`` into ``args.prompt_set`` (None without it) and fills ``args.prompt_width``, the
    tokens every prompt is left-padded to; the file and its combinations with other flags are checked here."""
    args.prompt_set = None
    args.prompt_width = prompt_width(args.max_operand)
    if args.prompt_data is None:
        return
    if args.environment or args.rollout_world_size or args.use_scoring_server or args.reward_model:
        raise ValueError("--prompt-data scores with the records' answers on the training ranks: no --environment, "
                         "--rollout-world-size, --use-scoring-server or --reward-model")
    if args.reward_fn != DEFAULT_REWARD_FN:
        raise ValueError(f"--prompt-data scores responses against the records' answers; drop --reward-fn "
                         f"{args.reward_fn}")
    args.prompt_set = data = PromptData(args.prompt_data, args.held_out_prompts)
    args.prompt_width = data.width
    if args.eval_interval and len(data.held_out) < args.dp:
        raise ValueError(f"--eval-interval needs at least one held-out prompt per data-parallel rank: "
                         f"--held-out-prompts {args.held_out_prompts} < {args.dp}")
    if not args.load and not data.has_completions:
        raise ValueError(f"--prompt-data {args.prompt_data}: without --load the warm-up fine-tunes on the records' "
                         f"completions, and some training records have no string 'completion' field")
    if not args.load and data.longest_answer() > args.max_new_tokens:
        raise ValueError(f"--prompt-data {args.prompt_data}: the longest completion takes {data.longest_answer()} "
                         f"tokens with end-of-document, more than --max-new-tokens {args.max_new_tokens}")
