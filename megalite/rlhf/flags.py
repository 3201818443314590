"""RL's and reward-model training's command-line flags: rows of the same ``Flag`` table as pretraining, mapped onto the RL configs.

A row with ``fields`` takes its default from the config dataclass (``PPOConfig``, ``AdvantageConfig``,
``SamplingConfig``, ``OffloadConfig``, ``EpisodeLimits``, ``GPTConfig``), so ``megalite.rlhf.trainer.RLTrainer``
and the Python API agree; the
other rows are options of the RL loop with their default in the row.  ``RL_FLAGS.config_values(args,
"PPOConfig")`` gives the config's keyword arguments from parsed flags.  The flag names follow verl
and DAPO (``--clip-ratio-low``, ``--loss-agg-mode``, ``--n-samples-per-prompt``).
"""

from __future__ import annotations

from megalite.flags import Flag, FlagTable
from megalite.models import GPTConfig
from megalite.rlhf.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from megalite.rlhf.env_tasks import ENVIRONMENTS
from megalite.rlhf.environment import EpisodeLimits
from megalite.rlhf.generation import SamplingConfig
from megalite.rlhf.placement import OffloadConfig
from megalite.rlhf.ppo import KL_ESTIMATORS, LOSS_AGGREGATIONS, ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES, PPOConfig

ALGO, ROLLOUT, PLACE = ("RL algorithm", "rollouts and rewards", "placement and offload (see megalite.rlhf.placement)")
TASK = "task and warm-up pretraining (megalite.rlhf.arithmetic)"
DEFAULT_REWARD_FN = "megalite.rlhf.rewards:arithmetic_reward"

RL_FLAGS = FlagTable((
    Flag("--advantage-estimator", ALGO, ("AdvantageConfig.estimator",),
         help=f"one of {', '.join(ADVANTAGE_ESTIMATORS)}"),
    Flag("--n-samples-per-prompt", ALGO, ("AdvantageConfig.group_size",), type=int,
         help="responses sampled per prompt (a group)"),
    Flag("--no-shared-prompt-rows", ALGO, default=False,
         help="the trainer's forwards (reference, old log-probs, update) run each sample as its own row instead of a "
              "prompt's samples as one row with the prompt once (megalite.rlhf.shared_groups; the same results)"),
    Flag("--no-norm-adv-by-std", ALGO, ("AdvantageConfig.norm_by_std",), sets=False,
         help="grpo: do not divide by the group's std (Dr. GRPO)"),
    Flag("--gamma", ALGO, ("AdvantageConfig.gamma",), type=float, help="discount"),
    Flag("--lam", ALGO, ("AdvantageConfig.lam",), type=float, help="GAE lambda"),
    Flag("--ppo-epochs", ALGO, default=2, type=int, help="passes over each batch of rollouts"),
    Flag("--actor-lr", ALGO, default=5e-4, type=float),
    Flag("--critic-lr", ALGO, default=2e-3, type=float),
    Flag("--guide-lr", ALGO, default=5e-4, type=float,
         help="--environment guidance: the guide's learning rate (it has its own optimizer)"),
    Flag("--loss-agg-mode", ALGO, ("PPOConfig.loss_aggregation",), choices=LOSS_AGGREGATIONS),
    Flag("--clip-ratio-low", ALGO, ("PPOConfig.clip_eps",), type=float),
    Flag("--clip-ratio-high", ALGO, ("PPOConfig.clip_eps_high",), type=float,
         help="None: --clip-ratio-low (DAPO: 0.28)"),
    Flag("--dual-clip", ALGO, ("PPOConfig.dual_clip",), type=float,
         help="bound (> 1) on the loss of negative-advantage tokens (verl's clip_ratio_c)"),
    Flag("--value-clip", ALGO, ("PPOConfig.value_clip",), type=float,
         help="the critic's new values stay within this of the old ones in the clipped value loss"),
    Flag("--kl-coef", ALGO, ("PPOConfig.kl_coef",), type=float, help="weight of the KL to the reference model"),
    Flag("--kl-estimator", ALGO, ("PPOConfig.kl_estimator",), choices=KL_ESTIMATORS),
    Flag("--kl-clamp", ALGO, ("PPOConfig.kl_clamp",), type=float,
         help="the log-ratio and the KL estimate are clamped to [-this, this]"),
    Flag("--use-kl-loss", ALGO, ("PPOConfig.use_kl_loss",), sets=True,
         help="KL as a loss term instead of in the reward (GRPO)"),
    Flag("--entropy-coef", ALGO, ("PPOConfig.entropy_coef",), type=float),
    Flag("--dynamic-sampling", ALGO, default=False,
         help="drop groups whose rewards are all equal and generate more to refill the batch"),
    Flag("--max-num-gen-batches", ALGO, default=4, type=int, help="dynamic sampling: generation rounds at most"),
    Flag("--overlong-buffer-len", ALGO, default=0, type=int, help="DAPO overlong shaping window (0: off)"),
    Flag("--overlong-penalty-factor", ALGO, default=1.0, type=float),
    Flag("--max-staleness", ALGO, default=0, type=int, help="rollouts may be this many updates old"),
    Flag("--partial-rollout-tokens", ALGO, type=int,
         help="partial rollouts: generate in rounds of at most this many tokens per row; a batch is the first groups "
              "to finish, unfinished rows continue under the next weights, each token keeping its behaviour "
              "log-prob (groups older than --max-staleness are dropped; --environment episodes pause mid-action); "
              "None: whole generations"),
    Flag("--rollout-is-cap", ALGO, ("PPOConfig.rollout_is_cap",), type=float,
         help="bound C on the importance weight pi_old / pi_behaviour between the trainer's old log-probs and the "
              "engine's (stale rollouts, or --recompute-old-log-probs); None: no correction"),
    Flag("--rollout-is-mode", ALGO, ("PPOConfig.rollout_is_mode",), choices=ROLLOUT_IS_MODES,
         help="truncate (TIS): min(w, C); mask (MIS): w inside [1/C, C], else 0 (the token or sequence drops out)"),
    Flag("--rollout-is-level", ALGO, ("PPOConfig.rollout_is_level",), choices=ROLLOUT_IS_LEVELS,
         help="token: a weight per token; sequence: the product of a response's token ratios, for all its tokens"),
    Flag("--balance-dp-tokens", ALGO, default=False,
         help="before the update, move rows between data-parallel ranks so each trains about the same number of "
              "tokens (equal rows per rank; the loss and gradients are those of the unbalanced batch)"),
    Flag("--micro-batch-tokens", ALGO, type=int,
         help="cut the RL update's micro-batches by this many padded tokens (rows sorted longest first, each "
              "micro-batch cut to its longest row) instead of --micro-batch-size rows; pp=1; None: by rows"),
    Flag("--recompute-old-log-probs", ALGO, default=False,
         help="recompute the old log-probs with the actor every iteration (not only for stale rollouts): the PPO "
              "ratio is taken against the trainer's own forward, the engine's log-probs enter through the "
              "--rollout-is-* weights, and the train/inference log-prob gap is logged"),

    Flag("--reward-fn", ROLLOUT, default=DEFAULT_REWARD_FN,
         help="module:function taking (prompt, response) and returning a float"),
    Flag("--reward-model", ROLLOUT,
         help="a reward-model checkpoint (examples/train_reward_model.py) used instead of --reward-fn"),
    Flag("--temperature", ROLLOUT, ("SamplingConfig.temperature",), type=float),
    Flag("--batch-invariant", ROLLOUT, ("GPTConfig.batch_invariant",), sets=True,
         help="run the actor in batch-invariant mode (megalite.batch_invariant): the engine's log-probs equal the "
              "trainer's bit for bit; slower"),
    Flag("--max-new-tokens", ROLLOUT, ("SamplingConfig.max_new_tokens",), default=3, type=int),
    Flag("--rollout-world-size", ROLLOUT, default=0, type=int,
         help="ranks that only generate (the last ones); 0: rollouts run on the training ranks"),
    Flag("--rollout-tensor-parallel-size", ROLLOUT, default=1, type=int),
    Flag("--use-scoring-server", ROLLOUT, default=False,
         help="score rollouts on a scoring server: the reward (and teacher) held by one rank only"),
    Flag("--scoring-server-rank", ROLLOUT, default=0, type=int, help="the rank that holds the scoring server"),
    Flag("--distill-coef", ROLLOUT, default=0.0, type=float,
         help="with --use-scoring-server: a teacher GPT on the scoring-server rank; this times the forward KL to it "
              "(on its top-k support) joins the actor loss"),
    Flag("--teacher-reward-coef", ROLLOUT, default=0.0, type=float,
         help="with --use-scoring-server: this times the teacher's log-prob of each response token joins the "
              "per-token reward"),
    Flag("--teacher-topk", ROLLOUT, type=int,
         help="the teacher sends its top-k log-probs (values + indices) instead of the full vocabulary"),
    Flag("--teacher-load", ROLLOUT, help="teacher checkpoint (megalite format); None: a GPT initialized from --seed + 1"),

    Flag("--offload-frozen-models", PLACE, ("OffloadConfig.offload_frozen_models",), sets=True,
         help="park the reference, reward model, teacher and target critic in (pinned) host memory and copy them "
              "to the device only for scoring (verl's ref/reward param_offload)"),
    Flag("--offload-optimizer", PLACE, ("OffloadConfig.offload_optimizer",), sets=True,
         help="park the actor's and critic's optimizer state in host memory during generation and scoring "
              "(verl's optimizer_offload)"),
    Flag("--target-critic-tau", PLACE, type=float,
         help="gae: advantages use a target critic, a host copy of the critic moved by Polyak averaging at this "
              "rate after each update"),

    Flag("--eval-samples", ROLLOUT, type=int,
         help="--eval-interval: also sample this many responses per evaluation prompt (at --temperature) and log "
              "valid_pass@1 and valid_pass@N (the unbiased estimator; a sample passes with reward >= 1); None: "
              "greedy only"),
    Flag("--sample-interval", ROLLOUT, type=int,
         help="print a few prompts with their sampled responses and rewards every this many iterations; None: never"),
    Flag("--environment", TASK, choices=tuple(ENVIRONMENTS),
         help="play episodes of this environment (megalite.rlhf.env_tasks) instead of the built-in rollouts: "
              "verifier (a+b, one turn), calculator (a*b with a <calc>EXPR</calc> tool) or guidance (a*b: "
              "attempt, a trained guide model's hint, revision); the environment gives the reward"),
    Flag("--max-turns", TASK, ("EpisodeLimits.max_turns",), type=int, help="--environment: actions per episode"),
    Flag("--max-total-tokens", TASK, ("EpisodeLimits.max_total_tokens",), type=int,
         help="--environment: prompt, actions and observations of an episode together (also the model's positions)"),
    Flag("--error-reward", TASK, ("EpisodeLimits.error_reward",), type=float,
         help="--environment: the final reward of an episode whose step (a tool call) raised"),
    Flag("--warmup-direct-fraction", TASK, type=float,
         help="--environment calculator: this fraction of the warm-up demonstrations answer without the tool (a "
              "policy that has yet to learn when to call it); None: the environment's default, always the tool"),
    Flag("--warmup-wrong-hint-fraction", TASK, type=float,
         help="--environment guidance: this fraction of the guide's warm-up hints are wrong numbers (a guide RL has "
              "to teach); None: the environment's default, every hint right"),
    Flag("--guide-samples-per-attempt", TASK, default=1, type=int,
         help="--environment guidance: hints the guide writes to each attempt, each followed by its own revision "
              "(a row of the policy's); with more than 1 the guide's advantages are group-relative over the hints "
              "to one attempt, and a policy group is all revisions to one question"),
    Flag("--prompt-data", TASK,
         help="jsonl of {prompt, answer} records (megalite.rlhf.math_task's file or your own) to draw the prompts "
              "from instead of a+b, scored against the answers (megalite.rlhf.prompt_data); with a completion in "
              "every record the warm-up is SFT on them"),
    Flag("--held-out-prompts", TASK, default=32, type=int,
         help="--prompt-data: the last records, held out for --eval-interval"),
    Flag("--max-operand", TASK, default=9, type=int,
         help="problems are a+b (a*b for calculator) with 0 <= a, b <= this"),
    Flag("--pretrain-iters", TASK, default=80, type=int, help="warm-up pretraining steps before RL (none with --load)"),
    Flag("--pretrain-lr", TASK, default=3e-3, type=float),
    Flag("--pretrain-global-batch-size", TASK, default=64, type=int,
         help="sequences per warm-up step over all data-parallel ranks"),
), (AdvantageConfig, PPOConfig, SamplingConfig, OffloadConfig, EpisodeLimits, GPTConfig))

PREFERENCES = "preference data"

REWARD_MODEL_FLAGS = FlagTable((
    Flag("--data-path", PREFERENCES, help="preference JSONL of {prompt, chosen, rejected}; None: a synthetic "
                                          "arithmetic set written into --save"),
    Flag("--synthetic-pairs", PREFERENCES, default=4000, type=int, help="pairs in the synthetic set"),
    Flag("--held-out-pairs", PREFERENCES, default=256, type=int,
         help="the last pairs, held out to measure accuracy"),
))
"""examples/train_reward_model.py's data options (the model and batch flags are pretraining's)."""
