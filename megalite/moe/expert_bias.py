"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert routing bias moved toward equal load.

A router with ``MoEConfig.enable_expert_bias`` adds ``expert_bias`` to the scores
it selects experts by (never to the combine weights) and counts, in training, the
tokens it routes to each expert.  After each step :func:`update_expert_bias` sums
those counts over data parallelism (they already span the micro-batch's TP and
CP shares) and moves each bias by ``bias_update_rate`` toward balance: up for an
expert below the mean load, down above it (Megatron-Core's rule).  The bias is a
buffer, not a parameter: no gradient or optimizer touches it, and checkpoints
save it with the model's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megalite import topology
from megalite.moe.router import TopKRouter


@torch.no_grad()
def update_expert_bias(model_chunks: list[nn.Module], dp_group=None) -> None:
    """Apply one bias update to every biased router in ``model_chunks`` and reset its counts."""
    routers = [m for chunk in model_chunks for m in chunk.modules()
               if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([router.tokens_since_update for router in routers])
    if topology.group_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    for router, load in zip(routers, counts):
        router.expert_bias += router.config.bias_update_rate * torch.sign(load.mean() - load)
        router.tokens_since_update.zero_()
