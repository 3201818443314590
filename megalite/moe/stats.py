"""Router statistics of a whole model for logging: aux and z losses, tokens per expert, load imbalance.

Each :class:`~megalite.moe.layer.MoELayer` keeps its last training micro-batch's statistics in
``last_stats`` (already summed over context parallelism).  :func:`router_statistics` gathers them
from this rank's model chunks and sums them over the groups that hold other layers (pipeline) or
other tokens (data parallel), so every rank of those groups gets the model's numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import topology
from megalite.moe.layer import MoELayer


def router_statistics(model_chunks, num_layers: int, num_experts: int, reduce_groups=(),
                      device: torch.device | None = None) -> dict[str, float]:
    """Router statistics of the last training micro-batch; ``{}`` when no MoE layer has any yet.

    ``moe_aux_loss``/``moe_z_loss`` are means over MoE layers and the ranks of ``reduce_groups``;
    ``moe_tokens_expert_<e>`` counts the (token, slot) assignments routed to expert e, summed over
    MoE layers and those ranks (pass the pipeline and data-parallel groups: tensor-parallel ranks see
    the same tokens and are not summed); ``moe_load_imbalance`` is max/mean of the per-layer counts,
    averaged over layers.  Layers are indexed by their global number (``num_layers`` of them), so
    summing over pipeline stages assembles the model.  Every rank of ``reduce_groups`` must call this.
    """
    rows = torch.zeros(num_layers, 3 + num_experts, dtype=torch.float64, device=device)
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, MoELayer) and layer.last_stats is not None:
                stats = layer.last_stats
                rows[layer.layer_number, :3] += torch.tensor([stats["aux_loss"], stats["z_loss"], 1.0],
                                                             dtype=rows.dtype, device=rows.device)
                rows[layer.layer_number, 3:] += torch.tensor(stats["tokens_per_expert"], dtype=rows.dtype,
                                                             device=rows.device)
    for group in reduce_groups:
        if topology.group_size(group) > 1:
            dist.all_reduce(rows, group=group)
    rows = rows[rows[:, 2] > 0]
    if rows.shape[0] == 0:
        return {}
    seen = rows[:, 2].sum().item()
    tokens = rows[:, 3:]
    imbalance = tokens.max(1).values / tokens.mean(1).clamp_min(1e-12)
    values = {"moe_aux_loss": rows[:, 0].sum().item() / seen, "moe_z_loss": rows[:, 1].sum().item() / seen,
              "moe_load_imbalance": imbalance.mean().item()}
    values.update({f"moe_tokens_expert_{e}": int(count) for e, count in enumerate(tokens.sum(0).tolist())})
    return values
