"""The MoE MLP: router, token dispatcher and experts, a drop-in replacement for the dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.moe.config import MoEConfig
from megalite.moe.dispatcher import make_dispatcher
from megalite.moe.experts import Experts
from megalite.moe.losses import attach_loss
from megalite.moe.router import TopKRouter
from megalite.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region


def _real(group):
    """None for a missing or single-rank group, so size-1 axes cost no collective."""
    return group if topology.group_size(group) > 1 else None


class MoELayer(nn.Module):
    """Mixture-of-Experts MLP taking and returning the dense MLP's layout.

    ``x`` is ``[s, b, h]`` replicated over TP, or ``[s/tp, b, h]`` with
    ``sequence_parallel``.  Inside the layer every rank dispatches its own tokens:
    without sequence parallelism the router runs on all (replicated) tokens and
    each TP rank then dispatches its 1/tp block of them, gathering the outputs
    at the end (a token count that does not divide by tp, as the inference
    engine packs them, is padded with rows routed to no expert).  Experts
    ``ep_rank * E/ep ...`` live on this rank, each split over
    ``expert_tp_group``.  A capacity limit applies to the tokens one rank routes:
    the whole micro-batch without sequence parallelism, the rank's 1/tp of it with.

    Router losses are not returned: the backward pass adds
    ``aux_loss_scale * d(aux_coeff * aux + z_coeff * z)`` by itself.  The default
    scale 1.0 treats them as part of this micro-batch's loss; a trainer that
    scales each micro-batch's loss (1/num_microbatches, an fp16 loss scale) sets
    the same factor with :func:`set_aux_loss_scale`.  ``last_stats`` holds the
    latest training-mode forward's micro-batch statistics for logging (evaluation
    forwards leave it alone).

    Under context parallelism (``cp_group``) each rank routes its share of the
    sequence: statistics are summed over CP, and each rank's router loss is its
    part of the micro-batch's; since replicated weights average their
    gradients over CP, that part is weighted by the CP size.

    A shared expert (``config.shared_expert_intermediate_size``) is the model's
    dense MLP module of that size, built by the caller and passed as
    ``shared_experts`` (called on ``x``, returning ``(out, bias)`` in ``x``'s
    layout); with ``config.shared_expert_gate`` its output is scaled by
    ``sigmoid(x . shared_expert_gate)``, a replicated ``[1, h]`` weight.  With
    ``config.shared_expert_overlap`` it runs between the start and the end of the
    dispatch's token all-to-all, so it computes while the tokens travel (and its
    backward while their gradients travel back); its output is added in the
    same place either way, so the results are bitwise the same.
    """

    def __init__(self, hidden_size: int, config: MoEConfig, *, layer_number: int = 0, tp_group=None,
                 ep_group=None, expert_tp_group=None, cp_group=None, sequence_parallel: bool = False,
                 shared_experts: nn.Module | None = None):
        super().__init__()
        self.tp_group = _real(topology.resolve_group(tp_group, "tp"))
        self.cp_group = _real(topology.resolve_group(cp_group, "cp"))
        self.ep_group = _real(topology.resolve_group(ep_group, "ep"))
        self.expert_tp_group = _real(topology.resolve_group(expert_tp_group, "expert_tp"))
        ep_size = topology.group_size(self.ep_group)
        config.validate(ep_size, topology.group_size(self.expert_tp_group))
        self.hidden_size, self.config, self.layer_number = hidden_size, config, layer_number
        self.sequence_parallel = sequence_parallel
        self.aux_loss_scale = 1.0
        self.last_stats: dict | None = None

        self.router = TopKRouter(hidden_size, config)
        if sequence_parallel and self.tp_group is not None:
            self.router.weight.sequence_parallel = True
        num_local = config.num_experts // ep_size
        self.experts = Experts(hidden_size, config, num_local, topology.group_rank(self.ep_group) * num_local,
                               topology.group_rank(self.expert_tp_group),
                               topology.group_size(self.expert_tp_group))
        self.dispatcher = make_dispatcher(config.dispatcher, config.num_experts, self.ep_group,
                                          self.expert_tp_group)
        if (shared_experts is None) != (config.shared_expert_intermediate_size is None):
            raise ValueError(f"MoELayer: shared_expert_intermediate_size={config.shared_expert_intermediate_size} "
                             f"needs a shared_experts module exactly when it is set")
        self.shared_experts = shared_experts
        self.shared_expert_gate = None
        if config.shared_expert_gate:
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden_size))
            with torch.no_grad():
                self.shared_expert_gate.normal_(0.0, config.init_method_std)
            if sequence_parallel and self.tp_group is not None:
                self.shared_expert_gate.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer: input {tuple(x.shape)} has hidden size {x.shape[-1]}, "
                             f"expected {self.hidden_size}")
        split = self.tp_group is not None and not self.sequence_parallel
        tp = topology.group_size(self.tp_group)
        tokens = x.reshape(-1, self.hidden_size)
        num_tokens = tokens.shape[0]
        stats_groups = [g for g in (self.tp_group if self.sequence_parallel else None, self.cp_group) if g is not None]
        routing = self.router(tokens, stats_groups, x.shape[1] if x.dim() == 3 else 1)
        if self.training:
            self.last_stats = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss,
                               "tokens_per_expert": routing.tokens_per_expert}
        probs, indices = routing.probs, routing.indices
        if routing.loss is not None:
            probs = attach_loss(probs, routing.loss, self.aux_loss_scale * topology.group_size(self.cp_group))
        if split:
            tokens, probs, indices = _pad_rows(tokens, probs, indices, -num_tokens % tp)
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp_group)
            probs = scatter_to_sequence_parallel_region(probs, self.tp_group)
            block = indices.shape[0] // tp
            start = topology.group_rank(self.tp_group) * block
            indices = indices[start:start + block]

        shared = None
        if self.config.shared_expert_overlap:
            started = self.dispatcher.start_dispatch(tokens, probs, indices)
            shared = self._shared(x)
            rows, counts, plan = self.dispatcher.finish_dispatch(started)
        else:
            rows, counts, plan = self.dispatcher.dispatch(tokens, probs, indices)
        out = self.dispatcher.combine(self.experts(rows, counts), plan)
        if split:
            out = gather_from_sequence_parallel_region(out, self.tp_group, tensor_parallel_output_grad=False)
            out = out[:num_tokens]
        out = out.to(x.dtype).view(x.shape)
        if self.shared_experts is not None:
            out = out + (shared if shared is not None else self._shared(x))
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, times its sigmoid gate when there is one."""
        shared, bias = self.shared_experts(x)
        if bias is not None:
            shared = shared + bias
        if self.shared_expert_gate is not None:
            shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate))
        return shared


def _pad_rows(tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, pad: int):
    """``pad`` extra rows that route nowhere (expert -1, weight 0), so the tokens split evenly over TP."""
    if not pad:
        return tokens, probs, indices
    return (torch.cat([tokens, tokens.new_zeros(pad, tokens.shape[1])]),
            torch.cat([probs, probs.new_zeros(pad, probs.shape[1])]),
            torch.cat([indices, indices.new_full((pad, indices.shape[1]), -1)]))


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set the factor on the gradients of the losses ``model``'s modules add in backward: every MoE layer's
    router losses, and any other module with an ``aux_loss_scale`` (multi-token prediction)."""
    for module in model.modules():
        if isinstance(module, MoELayer) or hasattr(module, "aux_loss_scale"):
            module.aux_loss_scale = scale
