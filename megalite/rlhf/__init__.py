"""RLHF on megalite's parallel GPT: actor log-probs, generation, critic, reference model, PPO math,
a centralized critic/reward model with prefetch, a training backend for outside RL loops and weight export."""

from megalite.rlhf.actor import pipeline_log_probs, sequence_log_probs, token_log_probs
from megalite.rlhf.backend import TrainingBackend
from megalite.rlhf.centralized_critic import CentralizedModel, Prefetcher
from megalite.rlhf.critic import CriticModel, pipeline_values
from megalite.rlhf.generation import GenerationOutput, SamplingConfig, engine_generate, generate
from megalite.rlhf.objectives import LanguageModelObjective, PPOActorObjective, PPOCriticObjective
from megalite.rlhf.ppo import (PPOConfig, aggregate, compute_gae, global_normalizer, kl_penalty, policy_loss,
                                      value_loss, whiten)
from megalite.rlhf.reference import ReferenceModel

__all__ = [
    "token_log_probs", "sequence_log_probs", "pipeline_log_probs", "generate", "engine_generate", "SamplingConfig",
    "GenerationOutput", "CriticModel", "pipeline_values", "ReferenceModel", "PPOConfig", "kl_penalty", "policy_loss",
    "value_loss", "aggregate", "global_normalizer", "compute_gae", "whiten", "CentralizedModel", "Prefetcher",
    "TrainingBackend", "LanguageModelObjective", "PPOActorObjective", "PPOCriticObjective",
]
