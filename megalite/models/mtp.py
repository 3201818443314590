"""Multi-token prediction (DeepSeek-V3's MTP, as Megatron-Core builds it): depths predicting tokens further ahead.

Depth ``k`` (0-based, ``config.mtp_num_layers`` of them) takes the previous depth's hidden states ``h`` (the
main model's final-norm output for depth 0) and the shared word embedding ``e`` of the input tokens shifted
left by ``k + 1``, and computes ``final_layernorm(layer(eh_proj([enorm(e); hnorm(h)])))``; the shared output
layer turns that into logits for the labels shifted left by ``k + 1`` (the token ``k + 2`` places ahead).
Shifted positions past the end of the sequence (or, in packed samples, into the next document) take no part
in the loss.  Under context parallelism the token ids, labels and masks are shifted along the whole sequence
(gathered over CP; the hidden states stay on their rank), and each rank's loss is its share of the
micro-batch's, weighted by the CP size as replicated weights average their gradients over CP (the main loss's
convention).  Each depth's loss is its mean over those tokens; their mean times ``mtp_loss_scaling_factor`` is
added to the micro-batch's loss through the backward pass only (:func:`megalite.moe.losses.attach_loss`,
Megatron's ``MTPLossAutoScaler``), so the model still returns the main per-token loss.  ``aux_loss_scale``
(set with the routers' by :func:`megalite.moe.set_aux_loss_scale`) scales that gradient as a trainer scales
each micro-batch's loss.

Parameter names are Megatron-Core's, under ``mtp.layers.{k}.``: ``enorm``, ``hnorm``, ``eh_proj`` (``[h, 2h]``,
column-parallel), ``transformer_layer`` (a decoder layer, global number ``num_layers + k``, of the last decoder
layer's kind) and ``final_layernorm``.  Under pipeline parallelism the depths sit on the last stage, with a copy
of the word embedding (``mtp.embedding``, a checkpoint alias of the model's; rotary positions only).

Under full recompute (``recompute_granularity`` "full", either method) each depth keeps only its inputs in
training and recomputes its layer in backward, as Megatron-Core checkpoints its MTP layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.context_parallel import chunk_indices
from megalite.models.init import init_stream, layer_stream, normal_init
from megalite.models.norms import build_norm
from megalite.models.transformer_block import TransformerLayer
from megalite.moe.losses import attach_loss
from megalite.tensor_parallel import (ColumnParallelLinear, gather_from_tensor_parallel_region, recompute,
                                      scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)


def check_mtp_config(config) -> None:
    """Raise ValueError unless ``config.mtp_num_layers``/``mtp_loss_scaling_factor`` make sense."""
    depth = config.mtp_num_layers
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(f"GPTConfig.mtp_num_layers must be a positive integer or None, got {depth!r}")
    if not config.mtp_loss_scaling_factor >= 0:
        raise ValueError(f"GPTConfig.mtp_loss_scaling_factor must be >= 0, got {config.mtp_loss_scaling_factor}")


def check_mtp_layout(config, pipelined: bool) -> None:
    """Raise ValueError when MTP cannot run split over pipeline stages."""
    if pipelined and config.mtp_num_layers and config.position_embedding_type != "rope":
        raise ValueError(f"multi-token prediction under pipeline parallelism needs rotary positions "
                         f"(position_embedding_type 'rope', got {config.position_embedding_type!r}): the last "
                         "stage keeps a copy of the word embedding only")


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """``x [b, s]`` moved one place to the left along the sequence, zero at the end (Megatron's ``roll_tensor``)."""
    return F.pad(x[:, 1:], (0, 1))


class MTPLayer(nn.Module):
    """One prediction depth: ``final_layernorm(transformer_layer(eh_proj([enorm(e); hnorm(h)])))``.

    ``h`` and ``e`` are ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), as is the result;
    ``kv_cache``: the layer's cache when drafting (``megalite.inference.mtp_drafter``).
    """

    def __init__(self, config, depth: int, *, tp_group=None, ep_group=None, expert_tp_group=None, cp_group=None,
                 cp_comm_type: str = "p2p", sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        norm_args = (config.normalization, config.hidden_size, config.norm_eps)
        self.enorm = build_norm(*norm_args, sequence_parallel=sequence_parallel)
        self.hnorm = build_norm(*norm_args, sequence_parallel=sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size, bias=False,
                                            sequence_parallel=sequence_parallel, tp_group=tp_group,
                                            init_method=normal_init(config.init_method_std))
        self.transformer_layer = TransformerLayer(
            config, config.num_layers + depth, tp_group=tp_group, ep_group=ep_group, expert_tp_group=expert_tp_group,
            cp_group=cp_group, cp_comm_type=cp_comm_type, sequence_parallel=sequence_parallel)
        self.final_layernorm = build_norm(*norm_args, sequence_parallel=sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary=None, mask=None, documents=None,
                kv_cache=None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        # column-parallel output [s, b, h/tp] -> the whole hidden size, back to this rank's tokens under SP
        x = gather_from_tensor_parallel_region(x, self.tp_group)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rotary, kv_cache, mask, documents))


class MultiTokenPrediction(nn.Module):
    """The ``config.mtp_num_layers`` depths of one model (on its last pipeline stage), and their loss.

    ``embedding``: on a last stage without the model's embedding, its copy (whose word embedding is a
    ``shared_embedding``, kept equal to the first stage's as a tied output layer is).
    """

    def __init__(self, config, embedding: nn.Module | None = None, **layer_kwargs):
        super().__init__()
        self.embedding = embedding
        self.scaling_factor = config.mtp_loss_scaling_factor
        self.tp_group = layer_kwargs.get("tp_group")
        self.cp_group = layer_kwargs.get("cp_group")
        self.aux_loss_scale = 1.0
        self.recompute_full = config.recompute_granularity == "full"
        self.last_losses: list[torch.Tensor] | None = None
        self.layers = nn.ModuleList()
        for depth in range(config.mtp_num_layers):
            with init_stream(config.seed, layer_stream(config.num_layers + depth)):
                self.layers.append(MTPLayer(config, depth, **layer_kwargs))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor, *, embedding, output_logits, loss_mask: torch.Tensor | None = None,
                rotary=None, mask=None, documents=None) -> torch.Tensor:
        """``hidden`` (the main model's final-norm states) with the MTP loss attached to its backward.

        ``input_ids``, ``position_ids``, ``labels`` and ``loss_mask`` (1 = a token in the loss; default all)
        are ``[b, s]``; ``documents [b, s]`` (packed samples) keeps each shifted target inside its document.
        ``embedding(ids, positions)`` and ``output_logits(states)`` are the model's shared embedding and head.
        """
        cp, rank = topology.group_size(self.cp_group), topology.group_rank(self.cp_group)
        seq = labels.shape[1] * cp
        mine = chunk_indices(seq, cp, rank, device=labels.device)  # this rank's positions in the whole sequence
        mask_k = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        if position_ids is None:
            position_ids = mine.expand_as(labels)
        ids, positions, targets, mask_k = (self._whole(x, mine) for x in (input_ids, position_ids, labels, mask_k))
        h, total, values = hidden, 0.0, []
        for depth, layer in enumerate(self.layers):
            ids, positions, targets, mask_k = shift_left(ids), shift_left(positions), shift_left(targets), \
                shift_left(mask_k)
            if documents is not None:
                mask_k = mask_k * _same_document(documents, depth + 1)
            embedded = embedding(ids[:, mine], positions[:, mine])
            if self.recompute_full and self.training:
                h = recompute(layer, h, embedded, rotary, mask, documents)
            else:
                h = layer(h, embedded, rotary, mask, documents)
            per_token = vocab_parallel_cross_entropy(output_logits(h), targets[:, mine].t(), tp_group=self.tp_group).t()
            loss = (per_token * mask_k[:, mine]).sum() * cp / mask_k.sum().clamp(min=1.0)
            total = total + loss
            values.append(loss)
        if self.training:
            self.last_losses = [v.detach() for v in values]
        return attach_loss(hidden, total * (self.scaling_factor / len(self.layers)), self.aux_loss_scale)

    def _whole(self, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """``[b, S]`` of this rank's ``[b, S/cp]`` slice ``mine``, gathered over context parallelism."""
        cp = topology.group_size(self.cp_group)
        if cp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(cp)]
        torch.distributed.all_gather(parts, local.contiguous(), group=self.cp_group)
        whole = local.new_empty(local.shape[0], local.shape[1] * cp)
        for rank, part in enumerate(parts):
            whole[:, chunk_indices(whole.shape[1], cp, rank, device=local.device)] = part
        return whole


def _same_document(documents: torch.Tensor, shift: int) -> torch.Tensor:
    """1.0 where the token ``shift`` places ahead lies in the same document, ``[b, s]`` (0 past the end)."""
    same = (documents[:, shift:] == documents[:, :-shift]).float()
    return F.pad(same, (0, shift))


def mtp_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"mtp_{k}_loss": loss}`` of depth ``k`` (1-based, Megatron's names) from ``model``'s last training
    forward; empty for a model without MTP (or one not training)."""
    for module in model.modules():
        if isinstance(module, MultiTokenPrediction) and module.training and module.last_losses is not None:
            return {f"mtp_{depth + 1}_loss": loss for depth, loss in enumerate(module.last_losses)}
    return {}
