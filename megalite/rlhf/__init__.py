"""RLHF on megalite's parallel GPT: the RL trainer (``megalite.rlhf.trainer.RLTrainer``), actor log-probs, generation,
critic, reference model, PPO math, advantage estimators (GAE, GRPO, RLOO, REINFORCE++), rewards and a learned reward
model, multi-turn tool-using environments (``environment``, ``env_tasks``) and the guidance flow's second trained model
(``guidance``), a scoring server (a reward or teacher
model on one rank, with tensor transport and prefetch), distillation from a teacher's top-k, a training backend and a
training service for outside RL loops, weight export and trainer -> rollout weight sync, and the placement plan with
CPU offload of frozen models and optimizer state between the generation, scoring and training phases."""

from megalite.rlhf.advantages import (ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages, compute_gae,
                                      discounted_returns, grpo_advantages, rloo_advantages)
from megalite.rlhf.actor import pipeline_log_probs, sequence_log_probs, token_log_probs
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.scoring_server import ScoringServer, Prefetcher
from megalite.rlhf.critic import CriticModel, pipeline_values
from megalite.rlhf.environment import Environment, EpisodeLimits, StepResult, run_episodes
from megalite.rlhf.env_tasks import CalculatorEnvironment, GuidanceEnvironment, VerifierEnvironment
from megalite.rlhf.distillation import TeacherOutput, forward_kl, teacher_fn, teacher_rewards
from megalite.rlhf.generation import (GenerationOutput, RolloutEngine, SamplingConfig, engine_generate, engine_supports,
                                      generate)
from megalite.rlhf.offload import Offloader
from megalite.rlhf.placement import OffloadConfig, Placement
from megalite.rlhf.objectives import LanguageModelObjective, PPOActorObjective, PPOCriticObjective
from megalite.rlhf.ppo import (PPOConfig, aggregate, global_normalizer, kl_penalty, policy_loss,
                               rollout_is_weights, value_loss, whiten)
from megalite.rlhf.preference import (PreferenceConfig, completion_pair, kto_loss, pack_pair, pair_log_probs,
                                      preference_forward_step, preference_loss)
from megalite.rlhf.reward_model import BradleyTerryObjective, RewardModelScorer
from megalite.rlhf.rewards import load_reward_fn, overlong_penalty, token_rewards, varied_groups
from megalite.rlhf.weight_sync import SyncRole, WeightSync
from megalite.rlhf.reference import ReferenceModel
from megalite.rlhf.service import TrainingService
from megalite.rlhf.service_config import ParallelLayout
from megalite.rlhf.target import PolyakTarget

__all__ = [
    "token_log_probs", "sequence_log_probs", "pipeline_log_probs", "generate", "engine_generate", "engine_supports",
    "SamplingConfig", "RolloutEngine", "Environment", "EpisodeLimits", "StepResult", "run_episodes",
    "CalculatorEnvironment", "GuidanceEnvironment", "VerifierEnvironment",
    "GenerationOutput", "CriticModel", "pipeline_values", "ReferenceModel", "PPOConfig", "kl_penalty", "policy_loss",
    "value_loss", "aggregate", "global_normalizer", "compute_gae", "whiten", "ScoringServer", "Prefetcher",
    "TrainingBackend", "LanguageModelObjective", "PPOActorObjective", "PPOCriticObjective",
    "ADVANTAGE_ESTIMATORS", "AdvantageConfig", "compute_advantages", "discounted_returns", "grpo_advantages",
    "rloo_advantages", "rollout_is_weights", "load_reward_fn", "overlong_penalty", "token_rewards", "varied_groups",
    "BradleyTerryObjective", "RewardModelScorer", "SyncRole", "WeightSync", "TeacherOutput", "forward_kl",
    "teacher_fn", "teacher_rewards", "ParallelLayout", "TrainingService",
    "PolyakTarget", "Offloader", "OffloadConfig", "Placement", "PreferenceConfig", "completion_pair", "kto_loss",
    "pack_pair", "pair_log_probs",
    "preference_forward_step", "preference_loss",
]
