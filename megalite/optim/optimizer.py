"""Mixed-precision AdamW over DDP gradient buffers or FSDP2 shards, optionally sharded over DP.

Each rank keeps, for every parameter, the fp32 "main" copy of the part it updates: the whole
parameter normally, its slice of the DDP bucket shards under the distributed optimizer (ZeRO-1),
or the rows FSDP2 placed on it.  Each chunk says which part that is (``owned_range``).  For fp32
parameters the main copy is a view of the parameter itself; for bf16/fp16 it is a separate fp32
tensor, copied back after each step.  Gradients come from ``param.main_grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megalite.optim.clip_grads import clip_grads_, global_grad_norm, global_zero_count
from megalite.optim.config import OptimizerConfig
from megalite.optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megalite.topology import group_rank, group_size, resolve_group

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class ParamShard:
    """The slice ``[lo, hi)`` of a flattened model parameter that this rank's optimizer updates."""

    key: str
    param: nn.Parameter
    lo: int
    hi: int
    values: torch.Tensor
    main: torch.Tensor
    grad_src: torch.Tensor
    expert: bool


def _make_adamw(groups: list[dict], config: OptimizerConfig, device: torch.device):
    """apex's FusedAdam when apex imports (on GPU), else torch's fused AdamW, else foreach."""
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay)
    if device.type == "cuda":
        try:
            from apex.optimizers import FusedAdam
        except ImportError:
            pass
        else:
            return FusedAdam(groups, adam_w_mode=True, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def _no_weight_decay(name: str, param) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed."""
    return param.ndim <= 1 or name.endswith("bias")


class MixedPrecisionOptimizer:
    """AdamW on fp32 main parameters, with loss scaling, global-norm clipping and ZeRO-1 sharding.

    ``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``; a step is skipped
    (``update_successful=False``) when fp16 gradients hold inf or nan.
    """

    def __init__(self, config: OptimizerConfig, model_chunks: list, groups: dict):
        self.config = config
        self.chunks = model_chunks
        self.groups = groups
        self.sharded = any(chunk.shards_optimizer_state for chunk in model_chunks)
        self.scaler = None
        if config.fp16 and config.loss_scale is not None:
            self.scaler = ConstantGradScaler(config.loss_scale)
        elif config.fp16:
            self.scaler = DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                            growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
        self.num_steps = 0

        coords = {name: group_rank(groups[name]) for name in ("tp", "pp", "ep", "expert_tp")}
        decay, no_decay = [], []
        for index, chunk in enumerate(model_chunks):
            prefix = f"{index}." if len(model_chunks) > 1 else ""
            for name, param in chunk.module.named_parameters():
                if not param.requires_grad:
                    continue
                shard = self._make_shard(prefix + name, param, chunk, coords)
                if shard is not None:
                    (no_decay if _no_weight_decay(name, param) else decay).append(shard)
        self.shards = decay + no_decay
        first = next(iter(model_chunks[0].parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        # wd_mult: a weight-decay schedule scales each group's decay by it, as Megatron's does.
        self.optimizer = _make_adamw([
            {"params": [s.main for s in decay], "wd_mult": 1.0},
            {"params": [s.main for s in no_decay], "weight_decay": 0.0, "wd_mult": 0.0},
        ], config, device)
        self.param_groups = self.optimizer.param_groups

    def _make_shard(self, name, param, chunk, coords) -> ParamShard | None:
        local = chunk.owned_range(param)
        if local is None:
            return None
        lo, hi = local
        expert = bool(getattr(param, "expert_parallel", False))
        where = (f"etp{coords['expert_tp']}.ep{coords['ep']}.pp{coords['pp']}" if expert
                 else f"tp{coords['tp']}.pp{coords['pp']}")
        values = chunk.owned_values(param)
        main = values if values.dtype == torch.float32 else values.float()
        grad_src = chunk.owned_grad(param)
        main.grad = grad_src if grad_src.dtype == torch.float32 else torch.zeros_like(main)
        return ParamShard(f"{name}@{where}", param, lo, hi, values, main, grad_src, expert)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def get_loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    def _sum_groups(self) -> tuple[list, list]:
        g = self.groups
        dense = [g["dp"]] if self.sharded else []
        expert = [g["expert_dp"]] if self.sharded else []
        return dense + [g["tp"], g["pp"]], expert + [g["expert_tp"], g["ep"], g["pp"]]

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        if grads:
            inv_scale = torch.full((), 1.0 / self.scaler.scale, dtype=torch.float32, device=found.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        for group in (self.groups["dp"], self.groups["tp"], self.groups["pp"]):
            if group_size(group) > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        for chunk in self.chunks:
            chunk.finish_param_sync()
        for s in self.shards:
            if s.main.grad is not s.grad_src:
                s.main.grad.copy_(s.grad_src)
        grads = [s.main.grad for s in self.shards]
        if self.scaler is not None:
            found_inf = self._found_inf(grads)
            self.scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = global_zero_count(*self._global_args(grads))
        if self.config.clip_grad > 0:
            norm = global_grad_norm(*self._global_args(grads))
            clip_grads_(grads, self.config.clip_grad, norm)
            grad_norm = norm.item()
        self.optimizer.step()
        self.num_steps += 1
        for s in self.shards:
            if s.values is not s.main:
                s.values.copy_(s.main)
        if self.sharded:
            for chunk in self.chunks:
                chunk.start_param_sync()
            if not self.config.overlap_param_gather:
                for chunk in self.chunks:
                    chunk.finish_param_sync()
        return True, grad_norm, num_zeros

    def _global_args(self, tensors: list[torch.Tensor]) -> tuple:
        """The arguments of ``global_grad_norm``/``global_zero_count`` for ``tensors`` (one per shard)."""
        dense, expert = self._sum_groups()
        return ([s.param for s in self.shards], tensors, dense, expert, self.groups["tp"], self.groups["expert_tp"],
                self.groups["pp"])

    @torch.no_grad()
    def params_norm(self) -> float:
        """The global L2 norm of the fp32 main parameters, each model-parallel copy counted once
        (Megatron's --log-params-norm); a collective over the model-parallel (and, under ZeRO, DP) groups."""
        return global_grad_norm(*self._global_args([s.main for s in self.shards])).item()

    def state_dict(self) -> dict:
        """State for resuming with the same model and parallel layout."""
        return {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps,
                "main": [s.main.clone() for s in self.shards],
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["main"]) != len(self.shards):
            raise ValueError(f"state holds {len(state['main'])} main parameters, this optimizer has {len(self.shards)}")
        self.optimizer.load_state_dict(state["optimizer"])
        # torch replaces its param-group dicts on load; the scheduler must set lr on the new ones.
        self.param_groups = self.optimizer.param_groups
        with torch.no_grad():
            for s, main in zip(self.shards, state["main"]):
                s.main.copy_(main)
        self.num_steps = state["num_steps"]
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])

    def sharded_state_dict(self, copy: bool = True) -> dict:
        """This rank's state, each entry tagged with its parameter's name, global shape and offset.

        Keys are ``"<name>@tp<r>.pp<r>"`` (``"@etp<r>.ep<r>.pp<r>"`` for experts), so the state
        of a model-parallel rank can be reassembled from any data-parallel layout.  ``copy=False``
        returns views of the live tensors (for a caller that writes them out before the next step).
        """
        def take(tensor):
            return tensor.detach().clone() if copy else tensor.detach()

        entries = {}
        for s in self.shards:
            state = self.optimizer.state.get(s.main, {})
            entries[s.key] = {"shape": tuple(s.param.shape), "offset": s.lo, "main": take(s.main),
                              **{k: take(state[k]) for k in _STATE_KEYS if k in state}}
        return {"entries": entries, "num_steps": self.num_steps,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_sharded_state_dict(self, states: list[dict] | dict) -> None:
        """Load state saved by :meth:`sharded_state_dict` on every rank of any DP layout.

        ``states`` is the list of all saved rank dicts (or one merged dict); each local shard is
        assembled from the saved pieces that overlap it.
        """
        states = [states] if isinstance(states, dict) else list(states)
        pieces: dict[str, list] = {}
        for sd in states:
            for key, entry in sd["entries"].items():
                pieces.setdefault(key, []).append(entry)
        torch_sd = self.optimizer.state_dict()
        has_state = states[0]["num_steps"] > 0
        new_state = {}
        with torch.no_grad():
            for index, s in enumerate(self.shards):
                found = pieces.get(s.key, [])
                shape = tuple(s.param.shape)
                filled = 0
                tensors = {k: torch.zeros_like(s.main) for k in _STATE_KEYS}
                for entry in found:
                    if tuple(entry["shape"]) != shape:
                        raise ValueError(f"{s.key}: saved shape {tuple(entry['shape'])} != model shape {shape}")
                    lo = max(s.lo, entry["offset"])
                    hi = min(s.hi, entry["offset"] + entry["main"].numel())
                    if lo >= hi:
                        continue
                    src = slice(lo - entry["offset"], hi - entry["offset"])
                    dst = slice(lo - s.lo, hi - s.lo)
                    s.main[dst] = entry["main"][src]
                    for k in _STATE_KEYS:
                        if k in entry:
                            tensors[k][dst] = entry[k][src]
                    filled += hi - lo
                if filled != s.hi - s.lo:
                    raise ValueError(f"{s.key}: saved state covers {filled} of the {s.hi - s.lo} elements "
                                     f"[{s.lo}, {s.hi}) this rank needs")
                if has_state:
                    new_state[index] = {"step": torch.tensor(float(states[0]["num_steps"])), **tensors}
        torch_sd["state"] = new_state
        for group, saved in zip(torch_sd["param_groups"], states[0]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in ("lr", "weight_decay", "betas", "eps")})
        self.optimizer.load_state_dict(torch_sd)
        self.param_groups = self.optimizer.param_groups
        self.num_steps = states[0]["num_steps"]
        if self.scaler is not None and states[0]["scaler"] is not None:
            self.scaler.load_state_dict(states[0]["scaler"])


def get_optimizer(config: OptimizerConfig, model_chunks, tp_group=None, pp_group=None, ep_group=None,
                  dp_group=None, expert_dp_group=None, expert_tp_group=None) -> MixedPrecisionOptimizer:
    """Build the optimizer for DDP- or FSDP-wrapped ``model_chunks`` (one chunk per virtual pipeline stage).

    Groups default to the current topology's; the DP groups default to those of the first chunk.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if not chunks:
        raise ValueError("get_optimizer needs at least one model chunk, got 0")
    for i, chunk in enumerate(chunks):
        if not hasattr(chunk, "owned_range") or not hasattr(chunk, "zero_grad_buffer"):
            raise ValueError(f"model chunk {i} is a {type(chunk).__name__}; wrap it in "
                             "megalite.distributed.DistributedDataParallel or FullyShardedDataParallel first")
    groups = {
        "tp": resolve_group(tp_group, "tp"),
        "pp": resolve_group(pp_group, "pp"),
        "ep": resolve_group(ep_group, "ep"),
        "expert_tp": resolve_group(expert_tp_group, "expert_tp"),
        "dp": dp_group if dp_group is not None else chunks[0].dp_group,
        "expert_dp": expert_dp_group if expert_dp_group is not None else chunks[0].expert_dp_group,
    }
    return MixedPrecisionOptimizer(config, chunks, groups)
