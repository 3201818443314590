"""Configuration of one Mixture-of-Experts MLP."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    """What an MoE layer computes; the process groups are given to the layer separately.

    ``ffn_hidden_size`` is each expert's full hidden size (before expert tensor
    parallelism splits it).  ``capacity_factor=None`` means dropless routing.

    Routing (Megatron's ``--moe-router-pre-softmax``): by default the top-k
    router logits are softmaxed among themselves, so a token's k weights sum to 1
    (Mixtral; Qwen-MoE with ``norm_topk_prob``).  ``pre_softmax`` softmaxes over
    all experts first and keeps the top-k probabilities as they are (Qwen-MoE
    without ``norm_topk_prob``).  ``shared_expert_intermediate_size`` adds an
    always-active MLP of that hidden size (the model's activation, tensor-parallel
    like the dense MLP) to every token's routed output; ``shared_expert_gate``
    scales it per token by ``sigmoid(x . w)`` (Qwen2-MoE's shared expert).
    ``aux_loss_coeff``/``z_loss_coeff`` weight the load-balancing and router
    z-losses, which the layer feeds into the backward pass itself.
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    activation: str = "gelu"
    add_bias: bool = False
    pre_softmax: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
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
        choices = {"activation": ACTIVATIONS,
                   "token_drop_policy": DROP_POLICIES, "dispatcher": DISPATCHERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 1):
            raise ValueError(f"shared_expert_intermediate_size must be a positive integer or None, got {shared!r}")
        if self.shared_expert_gate and shared is None:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"loss coefficients must be >= 0, got aux {self.aux_loss_coeff}, "
                             f"z {self.z_loss_coeff}")
        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std}")
