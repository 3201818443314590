"""What a training backend computes per micro-batch: the model call and the loss.

Each objective has ``forward(chunk, micro_batch)`` (this rank's pipeline
chunk, possibly DDP-wrapped), ``normalizer_mask(batch)`` (which tokens or
sequences the loss is averaged over, see :func:`ppo.global_normalizer`) and,
on the last stage, ``loss(output, micro_batch, normalizer) -> (loss, metrics)``
returning this micro-batch's share of the global mean.
Micro-batch keys: ``input_ids``/``attention_mask`` ``[b, s]``; per-token
tensors ``[b, s-1]`` are aligned with ``input_ids[:, 1:]``.
"""

from __future__ import annotations

import torch

from megalite.rlhf.actor import next_token_log_probs, token_log_probs, tp_group_of
from megalite.rlhf.distillation import TeacherOutput, forward_kl
from megalite.rlhf.ppo import PPOConfig, aggregate, kl_penalty, policy_loss, value_loss
from megalite.rlhf.shared_groups import RowLogits, forward_rows


class LanguageModelObjective:
    """Next-token cross entropy over ``loss_mask [b, s-1]`` (token-mean), e.g. for pretraining the actor."""

    mode = "token-mean"

    def normalizer_mask(self, batch: dict) -> torch.Tensor:
        return batch["loss_mask"]

    def forward(self, chunk, mb: dict) -> torch.Tensor:
        return chunk(mb["input_ids"], attention_mask=mb["attention_mask"])

    def loss(self, logits, mb: dict, normalizer: float, chunk):
        log_probs, _ = token_log_probs(logits[:, :-1], mb["input_ids"][:, 1:], tp_group=tp_group_of(chunk))
        loss = aggregate(-log_probs, mb["loss_mask"], self.mode, normalizer)
        return loss, {"lm_loss": loss.detach()}


class PPOActorObjective:
    """Clipped PPO surrogate minus ``entropy_coef`` x entropy, over ``response_mask``.

    Needs ``old_log_probs`` and ``advantages``; with ``config.use_kl_loss`` also
    ``ref_log_probs`` (adds ``kl_coef`` x the aggregated KL estimate); an optional
    ``is_weights`` multiplies the surrogate per token (stale rollouts).  ``distill_coef > 0`` adds that
    times the forward KL to a teacher on its support (needs ``teacher_log_probs [b, s, k]`` and, for
    top-k, ``teacher_indices``; see :mod:`megalite.rlhf.distillation`).  A micro-batch with ``packed`` rows (a
    prompt's samples as one prefix-shared row, :func:`megalite.rlhf.shared_groups.pack_micro_batches`) runs them
    (the same loss and gradients).
    """

    def __init__(self, config: PPOConfig, temperature: float = 1.0, chunk_size: int | None = None,
                 distill_coef: float = 0.0):
        self.config, self.temperature, self.chunk_size = config, temperature, chunk_size
        self.distill_coef = distill_coef
        self.mode = config.loss_aggregation

    def normalizer_mask(self, batch: dict) -> torch.Tensor:
        return batch["response_mask"]

    def forward(self, chunk, mb: dict) -> torch.Tensor:
        return forward_rows(chunk, mb["input_ids"], mb["attention_mask"], mb.get("packed"))

    def loss(self, logits, mb: dict, normalizer: float, chunk):
        with_entropy = self.config.entropy_coef > 0
        log_probs, entropy = next_token_log_probs(logits, mb["input_ids"], chunk, self.temperature, self.chunk_size,
                                                  with_entropy)
        mask = mb["response_mask"]
        loss, metrics = policy_loss(log_probs, mb["old_log_probs"], mb["advantages"], mask, self.config, normalizer,
                                    mb.get("is_weights"))
        metrics["policy_loss"] = loss.detach()
        if self.config.use_kl_loss:
            kl = kl_penalty(log_probs, mb["ref_log_probs"], self.config.kl_estimator, self.config.kl_clamp)
            kl_term = aggregate(kl, mask, self.mode, normalizer)
            metrics["kl_loss"] = kl_term.detach()
            loss = loss + self.config.kl_coef * kl_term
        if self.distill_coef > 0:
            indices = mb.get("teacher_indices")
            teacher = TeacherOutput(mb["teacher_log_probs"][:, :-1], None if indices is None else indices[:, :-1],
                                    None)
            full = logits.expand() if isinstance(logits, RowLogits) else logits
            distill = aggregate(forward_kl(full[:, :-1], teacher, tp_group_of(chunk)), mask, self.mode, normalizer)
            metrics["distill_kl"] = distill.detach()
            loss = loss + self.distill_coef * distill
        if with_entropy:
            entropy_term = aggregate(entropy, mask, self.mode, normalizer)
            metrics["entropy"] = entropy_term.detach()
            loss = loss - self.config.entropy_coef * entropy_term
        return loss, metrics


class PPOCriticObjective:
    """Clipped value loss of a :class:`CriticModel` over ``response_mask``; needs ``old_values``, ``returns``."""

    def __init__(self, config: PPOConfig):
        self.config = config
        self.mode = config.loss_aggregation

    def normalizer_mask(self, batch: dict) -> torch.Tensor:
        return batch["response_mask"]

    def forward(self, chunk, mb: dict) -> torch.Tensor:
        return chunk(mb["input_ids"], mb["attention_mask"])

    def loss(self, values, mb: dict, normalizer: float, chunk):
        loss = value_loss(values[:, :-1], mb["old_values"], mb["returns"], mb["response_mask"], self.config,
                          normalizer)
        return loss, {"value_loss": loss.detach()}
