"""Configuration of one Mixture-of-Experts MLP."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss")


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
    ``shared_expert_overlap`` (Megatron's ``--moe-shared-expert-overlap``) runs
    the shared expert while the all-to-all dispatcher's token exchange is in
    flight, and its backward while the rows' gradients travel back; the numbers
    are the same as without it, only the schedule changes.
    ``aux_loss_coeff``/``z_loss_coeff`` weight the load-balancing and router
    z-losses, which the layer feeds into the backward pass itself.
    ``load_balancing_type`` picks the balancing loss ``aux_loss_coeff`` weighs
    (Megatron's ``--moe-router-load-balancing-type``): "aux_loss" over the
    micro-batch's tokens, or "seq_aux_loss", DeepSeek-V3's per-sequence loss
    averaged over the micro-batch's sequences (see ``losses.py``).

    DeepSeek-V3 routing (see ``sigmoid_routing.py``): ``score_function``
    "sigmoid", experts chosen by score plus a balancing bias when
    ``enable_expert_bias`` (moved by ``bias_update_rate`` per step, see
    ``expert_bias.py``), among the ``group_topk`` best of ``num_groups`` expert
    groups, combine weights scaled by ``routed_scaling_factor``.
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int = 2
    activation: str = "gelu"
    add_bias: bool = False
    pre_softmax: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    shared_expert_overlap: bool = False
    aux_loss_coeff: float = 0.0
    load_balancing_type: str = "aux_loss"
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    dispatcher: str = "alltoall"
    grouped_gemm: bool = False
    score_function: str = "softmax"
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    routed_scaling_factor: float = 1.0
    num_groups: int | None = None
    group_topk: int | None = None
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
        choices = {"activation": ACTIVATIONS, "score_function": SCORE_FUNCTIONS,
                   "load_balancing_type": LOAD_BALANCING_TYPES,
                   "token_drop_policy": DROP_POLICIES, "dispatcher": DISPATCHERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 1):
            raise ValueError(f"shared_expert_intermediate_size must be a positive integer or None, got {shared!r}")
        if self.shared_expert_gate and shared is None:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size)")
        if self.shared_expert_overlap and (shared is None or self.dispatcher != "alltoall"):
            raise ValueError(f"shared_expert_overlap needs a shared expert (shared_expert_intermediate_size, got "
                             f"{shared}) and the alltoall dispatcher (got {self.dispatcher!r})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"loss coefficients must be >= 0, got aux {self.aux_loss_coeff}, "
                             f"z {self.z_loss_coeff}")
        self._validate_sigmoid_routing()
        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std}")

    def _validate_sigmoid_routing(self) -> None:
        groups, group_topk = self.num_groups, self.group_topk
        if self.score_function != "sigmoid":
            if self.enable_expert_bias or groups is not None or self.routed_scaling_factor != 1.0:
                raise ValueError("expert bias, expert groups and routed_scaling_factor need score_function "
                                 f"'sigmoid', got {self.score_function!r}")
            return
        if self.pre_softmax:
            raise ValueError("pre_softmax applies to score_function 'softmax', not 'sigmoid'")
        if self.capacity_factor is not None:
            raise ValueError("score_function 'sigmoid' routes dropless: capacity_factor must be None")
        if not self.bias_update_rate >= 0 or not self.routed_scaling_factor > 0:
            raise ValueError(f"bias_update_rate must be >= 0 and routed_scaling_factor positive, got "
                             f"{self.bias_update_rate} and {self.routed_scaling_factor}")
        if (groups is None) != (group_topk is None):
            raise ValueError(f"num_groups={groups} and group_topk={group_topk} must be given together")
        if groups is None:
            return
        if groups < 1 or group_topk < 1 or self.num_experts % groups:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by num_groups {groups} (or a "
                             f"size is not positive)")
        if group_topk > groups:
            raise ValueError(f"group_topk {group_topk} exceeds num_groups {groups}")
        if self.topk % group_topk or self.topk > group_topk * (self.num_experts // groups):
            raise ValueError(f"topk {self.topk} must be a multiple of group_topk {group_topk} and fit in "
                             f"{group_topk} groups of {self.num_experts // groups} experts")
