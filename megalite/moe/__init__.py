"""Mixture of Experts with expert parallelism: router, token dispatchers, experts and the MoE layer."""

from megalite.moe.config import MoEConfig
from megalite.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher, make_dispatcher
from megalite.moe.expert_bias import update_expert_bias
from megalite.moe.experts import Experts
from megalite.moe.hf import moe_config_from_hf, moe_config_to_hf, moe_tensor_to_hf, moe_tensors_from_hf
from megalite.moe.layer import MoELayer, set_aux_loss_scale
from megalite.moe.losses import attach_loss, load_balancing_loss, sequence_load_balancing_loss, z_loss
from megalite.moe.router import Routing, TopKRouter, capacity, keep_mask
from megalite.moe.sigmoid_routing import sigmoid_topk
from megalite.moe.stats import router_statistics

__all__ = [
    "MoEConfig", "MoELayer", "set_aux_loss_scale", "TopKRouter", "Routing", "capacity", "keep_mask",
    "Experts", "AllToAllDispatcher", "AllGatherDispatcher", "make_dispatcher",
    "load_balancing_loss", "sequence_load_balancing_loss", "z_loss", "attach_loss", "router_statistics",
    "sigmoid_topk", "update_expert_bias",
    "moe_config_from_hf", "moe_config_to_hf", "moe_tensors_from_hf", "moe_tensor_to_hf",
]
