"""Top-k router: a linear gate, top-k selection, optional capacity dropping and the router losses."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.moe.config import MoEConfig
from megalite.moe.losses import sequence_load_balancing_loss, z_loss
from megalite.moe.sigmoid_routing import sigmoid_topk


@dataclass
class Routing:
    """Where each token goes.

    ``probs`` [T, k] are the combine weights (they sum to 1 per token unless
    ``MoEConfig.pre_softmax``; a dropped assignment's weight is 0), ``indices``
    [T, k] the expert ids with -1 for a dropped assignment.  ``loss`` is this rank's share of
    ``aux_coeff * aux + z_coeff * z`` (differentiable, or None when both
    coefficients are 0); ``aux_loss``/``z_loss`` are the micro-batch's values
    (aux of ``MoEConfig.load_balancing_type``) and ``tokens_per_expert`` its routed assignments per expert, before dropping;
    ``dropped`` counts the assignments this rank dropped for capacity.
    """

    probs: torch.Tensor
    indices: torch.Tensor
    loss: torch.Tensor | None
    aux_loss: float
    z_loss: float
    tokens_per_expert: list[int]
    dropped: int


def capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Assignments an expert accepts from ``num_tokens`` tokens: ceil(factor * T * k / E)."""
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


def keep_mask(probs: torch.Tensor, indices: torch.Tensor, num_experts: int, limit: int, policy: str) -> torch.Tensor:
    """[T, k] bool: the assignments kept when every expert takes at most ``limit`` of them.

    ``policy="probs"`` keeps each expert's highest-weight assignments,
    ``"position"`` its earliest tokens.
    """
    num_tokens = probs.shape[0]
    routed = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=probs.device)
    routed.scatter_(1, indices, True)
    if policy == "position":
        kept = routed & (routed.long().cumsum(0) <= limit)
    else:
        weight = torch.full((num_tokens, num_experts), -1.0, dtype=probs.dtype, device=probs.device)
        weight.scatter_(1, indices, probs.detach())
        best = weight.topk(min(limit, num_tokens), dim=0).indices
        kept = torch.zeros_like(routed).scatter_(0, best, True) & routed
    return kept.gather(1, indices)


class TopKRouter(nn.Module):
    """Linear gate ``[h] -> [E]`` followed by top-k routing.

    ``stats_groups`` are the groups over which one micro-batch's tokens are
    split (the TP group under sequence parallelism, the CP group): token counts
    and loss values are summed over each in turn so that every rank sees
    micro-batch statistics.  Capacity dropping looks at this rank's tokens only.

    With ``score_function`` "sigmoid" the scores and choice are
    :func:`~megalite.moe.sigmoid_routing.sigmoid_topk`'s; with
    ``enable_expert_bias`` the buffers ``expert_bias`` (saved with the model) and
    ``tokens_since_update`` (training-mode counts, with grad enabled) serve
    :func:`~megalite.moe.expert_bias.update_expert_bias`.
    """

    def __init__(self, hidden_size: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        with torch.no_grad():
            self.weight.normal_(0.0, config.init_method_std)
        biased = config.enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_experts) if biased else None)
        self.register_buffer("tokens_since_update", torch.zeros(config.num_experts) if biased else None,
                             persistent=False)

    def forward(self, tokens: torch.Tensor, stats_groups=(), sequences: int = 1) -> Routing:
        """Route ``tokens`` [T, h]: ``sequences`` interleaved sequences laid out as ``[s, sequences, h]`` flattened
        (the sequence-wise balance loss needs to know them apart)."""
        cfg = self.config
        logits = F.linear(tokens.float(), self.weight.float())
        if cfg.score_function == "sigmoid":
            scores, probs, indices = sigmoid_topk(logits, cfg, self.expert_bias)
        elif cfg.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, indices = scores.topk(cfg.topk, dim=-1)
        else:
            scores = torch.softmax(logits, dim=-1)
            top, indices = logits.topk(cfg.topk, dim=-1)
            probs = torch.softmax(top, dim=-1)

        num_experts = cfg.num_experts
        counts = torch.bincount(indices.reshape(-1), minlength=num_experts)
        balance_scores, balance_counts = _balance_inputs(logits, scores, cfg, sequences)
        stats = torch.cat([counts.double(), torch.logsumexp(logits.detach(), -1).square().sum().double().view(1),
                           torch.tensor([tokens.shape[0]], dtype=torch.float64, device=tokens.device),
                           balance_counts.double().view(-1), balance_scores.detach().sum(0).double().view(-1)])
        for group in stats_groups:
            dist.all_reduce(stats, group=group)
        total_counts = stats[:num_experts].round().long()
        if self.tokens_since_update is not None and self.training and torch.is_grad_enabled():
            # (A recomputed layer routes twice, without grad and then in backward: count once, as Megatron-Core.)
            self.tokens_since_update += total_counts
        num_tokens = max(int(stats[num_experts + 1].item()), 1)
        seq_length = max(num_tokens // balance_counts.shape[0], 1)
        total_balance = stats[num_experts + 2:].view(2, *balance_counts.shape)

        aux_value = float(sequence_load_balancing_loss(total_balance[1].unsqueeze(0), total_balance[0].round(),
                                                       seq_length, cfg.topk))
        z_value = float(stats[num_experts] / num_tokens)
        loss = None
        if cfg.aux_loss_coeff > 0:
            loss = cfg.aux_loss_coeff * sequence_load_balancing_loss(balance_scores, total_balance[0].round().to(
                scores.dtype), seq_length, cfg.topk)
        if cfg.z_loss_coeff > 0:
            z = cfg.z_loss_coeff * z_loss(logits, num_tokens)
            loss = z if loss is None else loss + z

        dropped = 0
        if cfg.capacity_factor is not None:
            limit = capacity(tokens.shape[0], num_experts, cfg.topk, cfg.capacity_factor)
            kept = keep_mask(probs, indices, num_experts, limit, cfg.token_drop_policy)
            dropped = int((~kept).sum())
            probs = probs * kept
            indices = indices.masked_fill(~kept, -1)
        return Routing(probs=probs, indices=indices, loss=loss, aux_loss=aux_value, z_loss=z_value,
                       tokens_per_expert=total_counts.tolist(), dropped=dropped)


def _balance_inputs(logits: torch.Tensor, scores: torch.Tensor, config: MoEConfig,
                    sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [s, B, E], assignments [B, E])`` the balancing loss compares, for B "sequences".

    "aux_loss": the whole micro-batch is one sequence; "seq_aux_loss": each of
    the ``sequences`` is its own.  As Megatron-Core (and DeepSeek-V3 for its
    sequence-wise loss) define it, a token counts for its top-k experts by
    unbiased score, whatever groups or an expert bias chose for routing (with
    softmax scores these are the routed experts, before capacity dropping).
    """
    num_experts = config.num_experts
    if config.load_balancing_type == "aux_loss":
        sequences = 1
    elif logits.shape[0] % sequences:
        raise ValueError(f"{logits.shape[0]} router tokens do not split into {sequences} sequences")
    chosen = logits.detach().topk(config.topk, dim=-1).indices
    routed = torch.zeros_like(logits, dtype=torch.float64).scatter_(1, chosen, 1.0)
    return scores.view(-1, sequences, num_experts), routed.view(-1, sequences, num_experts).sum(0)
