"""DeepSeek-V3's routing: sigmoid scores, group-limited top-k on scores plus a balancing bias.

Each expert's score is ``sigmoid(logit)``.  The experts are chosen by
``score + expert_bias`` (the bias steers load, see :mod:`megalite.moe.expert_bias`),
first among groups: with ``num_groups`` groups of consecutive experts, a token
keeps the ``group_topk`` groups whose best ``topk / group_topk`` biased scores
sum highest, then takes its top ``topk`` experts inside them (node-limited
routing: with the groups aligned to EP ranks a token's tokens reach at most
``group_topk`` groups of ranks).  The combine weights are the unbiased scores of
the chosen experts, normalised to sum to 1 over them when ``topk > 1``, times
``routed_scaling_factor``; Megatron-Core's ``sigmoid`` score function and
Hugging Face's ``DeepseekV3TopkRouter`` compute the same.  The scores the
load-balancing loss sees are the sigmoids normalised over all experts, and the
experts it counts each token for are its top-k by unbiased score (not the
group-limited, biased choice), as Megatron-Core's.
"""

from __future__ import annotations

import torch

from megalite.moe.config import MoEConfig


def sigmoid_topk(logits: torch.Tensor, config: MoEConfig,
                 expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(aux_scores [T, E], probs [T, k], indices [T, k])`` of fp32 router ``logits [T, E]``."""
    scores = torch.sigmoid(logits)
    choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    if config.num_groups is not None:
        tokens, groups = choice.shape[0], config.num_groups
        per_group = choice.view(tokens, groups, -1)
        group_scores = per_group.topk(config.topk // config.group_topk, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(config.group_topk, dim=-1).indices
        keep = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
    indices = choice.topk(config.topk, dim=-1).indices
    probs = scores.gather(1, indices)
    if config.topk > 1:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    aux_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return aux_scores, probs * config.routed_scaling_factor, indices
