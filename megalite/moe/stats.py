"""Router statistics of a whole model for logging: aux and z losses, tokens per expert, load imbalance, bias norm.

Each :class:`~megalite.moe.layer.MoELayer` keeps its last training micro-batch's statistics in
``last_stats`` (already summed over context parallelism).  :func:`router_statistics` gathers them
from this rank's model chunks and sums them over the groups that hold other layers (pipeline) or
other tokens (data parallel), so every rank of those groups gets the model's numbers.
"""

from __future__ import annotations

import math

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
    the same tokens and are not summed); ``moe_load_imbalance_layer_<l>`` is max/mean of layer l's
    counts and ``moe_load_imbalance`` its mean over layers.  With aux-loss-free balancing,
    ``moe_expert_bias_norm_layer_<l>`` is the L2 norm of layer l's expert bias (as it stands now, after
    the step's update) and ``moe_expert_bias_norm`` that of all layers' biases together.  Layers are
    indexed by their global number (``num_layers`` of them), so summing over pipeline stages assembles
    the model.  Every rank of ``reduce_groups`` must call this.
    """
    # Per layer: aux, z, contributions (one per rank holding the layer), squared bias norm, copies with a bias,
    # then the counts.
    rows = torch.zeros(num_layers, 5 + num_experts, dtype=torch.float64, device=device)
    for chunk in model_chunks:
        for layer in chunk.modules():
            if isinstance(layer, MoELayer) and layer.last_stats is not None:
                stats, bias = layer.last_stats, layer.router.expert_bias
                square = 0.0 if bias is None else float(bias.double().square().sum())
                head = [stats["aux_loss"], stats["z_loss"], 1.0, square, float(bias is not None)]
                rows[layer.layer_number, :5] += torch.tensor(head, dtype=rows.dtype, device=rows.device)
                rows[layer.layer_number, 5:] += torch.tensor(stats["tokens_per_expert"], dtype=rows.dtype,
                                                             device=rows.device)
    for group in reduce_groups:
        if topology.group_size(group) > 1:
            dist.all_reduce(rows, group=group)
    present = (rows[:, 2] > 0).nonzero().view(-1).tolist()
    if not present:
        return {}
    seen = rows[present, 2].sum().item()
    tokens = rows[present, 5:]
    imbalance = (tokens.max(1).values / tokens.mean(1).clamp_min(1e-12)).tolist()
    values = {"moe_aux_loss": rows[present, 0].sum().item() / seen,
              "moe_z_loss": rows[present, 1].sum().item() / seen,
              "moe_load_imbalance": sum(imbalance) / len(imbalance)}
    values.update({f"moe_tokens_expert_{e}": int(count) for e, count in enumerate(tokens.sum(0).tolist())})
    values.update({f"moe_load_imbalance_layer_{layer}": ratio for layer, ratio in zip(present, imbalance)})
    # Every rank holding a layer holds the same bias: the mean of its copies' squares is its square.
    squares = {layer: rows[layer, 3].item() / rows[layer, 2].item() for layer in present if rows[layer, 4] > 0}
    if squares:
        values["moe_expert_bias_norm"] = math.sqrt(sum(squares.values()))
        values.update({f"moe_expert_bias_norm_layer_{layer}": math.sqrt(square) for layer, square in squares.items()})
    return values
