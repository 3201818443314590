"""Configuration of one Mixture-of-Experts MLP."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    """What an MoE layer computes; the process groups are given to the layer separately.

    ``ffn_hidden_size`` is each expert's full hidden size (before expert tensor
    parallelism splits it).  ``capacity_factor=None`` means dropless routing.
    ``aux_loss_coeff``/``z_loss_coeff`` weight the load-balancing and router
    z-losses, which the layer feeds into the backward pass itself.
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    activation: str = "gelu"
    add_bias: bool = False
    router_order: str = "softmax_topk"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    dispatcher: str = "alltoall"
    grouped_gemm: bool = False
    init_method_std: float = 0.02

    def validate(self, ep_size: int = 1, expert_tp_size: int = 1) -> None:
        """Raise ValueError, naming the numbers, if this config cannot run on the given sizes."""
        for name in ("num_experts", "ffn_hidden_size", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"moe router topk {self.topk} exceeds num_experts {self.num_experts}")
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by the expert-parallel "
                             f"size {ep_size}")
        if expert_tp_size < 1 or self.ffn_hidden_size % expert_tp_size:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the expert "
                             f"tensor-parallel size {expert_tp_size}")
        choices = {"activation": ACTIVATIONS, "router_order": ROUTER_ORDERS,
                   "token_drop_policy": DROP_POLICIES, "dispatcher": DISPATCHERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"loss coefficients must be >= 0, got aux {self.aux_loss_coeff}, "
                             f"z {self.z_loss_coeff}")
        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std}")
