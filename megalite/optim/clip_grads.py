"""Global gradient norm across data-parallel shards and model-parallel ranks, and clipping."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.optim.replicas import counts_on_this_rank
from megalite.topology import group_rank, group_size, resolve_group


def _sum_over(value: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if group is not None and group_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def _global_sum(params: list, tensors: list[torch.Tensor], dense_groups: list, expert_groups: list, tp_group,
                expert_tp_group, pp_group, measure, dtype: torch.dtype) -> torch.Tensor:
    """Sum of ``measure(tensors of one kind)`` over all ranks, each model-parallel copy counted once.

    ``tensors[i]`` belongs to ``params[i]``; dense tensors' sums are summed over each group in
    ``dense_groups`` in turn, expert tensors' over ``expert_groups``; summing over orthogonal axis
    groups one after another sums over their product.  Every rank must call this with the same list
    of group kinds.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    parts = {True: [], False: []}
    ranks = group_rank(tp_group), group_rank(expert_tp_group), group_rank(pp_group)
    for param, tensor in zip(params, tensors):
        if counts_on_this_rank(param, *ranks):
            parts[bool(getattr(param, "expert_parallel", False))].append(tensor)
    total = torch.zeros((), dtype=dtype, device=device)
    for expert, groups in ((False, dense_groups), (True, expert_groups)):
        value = torch.zeros(1, dtype=dtype, device=device)
        if parts[expert]:
            value += measure(parts[expert]).to(dtype)
        total = total + _sum_over(value, groups)[0]
    return total


def global_grad_norm(params: list, grads: list[torch.Tensor], dense_groups: list, expert_groups: list,
                     tp_group=None, expert_tp_group=None, pp_group=None) -> torch.Tensor:
    """L2 norm of ``grads`` (``grads[i]`` belongs to ``params[i]``) over all ranks (see ``_global_sum``);
    with the main parameters in place of ``grads`` it is the parameters' norm."""
    def squares(tensors):
        return torch.stack(torch._foreach_norm(tensors)).float().square().sum()

    return _global_sum(params, grads, dense_groups, expert_groups, tp_group, expert_tp_group, pp_group, squares,
                       torch.float32).sqrt()


def global_zero_count(params: list, grads: list[torch.Tensor], dense_groups: list, expert_groups: list,
                      tp_group=None, expert_tp_group=None, pp_group=None) -> int:
    """How many entries of ``grads`` are exactly zero over all ranks (Megatron's num_zeros_in_grad)."""
    def zeros(tensors):
        return sum((t == 0).sum() for t in tensors)

    return int(_global_sum(params, grads, dense_groups, expert_groups, tp_group, expert_tp_group, pp_group, zeros,
                           torch.float64).item())


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so their global norm is at most ``max_norm``."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def clip_grad_norm(params, max_norm: float, model_parallel_group=None, *, tp_group=None, pp_group=None,
                   ep_group=None, expert_tp_group=None) -> float:
    """Clip the gradients of ``params`` by their global L2 norm and return that norm.

    Each parameter's gradient is its ``main_grad`` when it has one (DDP), else ``.grad``.  Dense
    squares are summed over ``model_parallel_group`` (TP x PP, default the topology's "model"
    group); expert squares over the expert-TP, EP and PP groups.  TP-sharded parameters count on
    every TP rank, TP-replicated ones once.  Every DP rank must hold the full reduced gradients.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    tp_group = resolve_group(tp_group, "tp")
    pp_group = resolve_group(pp_group, "pp")
    expert_tp_group = resolve_group(expert_tp_group, "expert_tp")
    dense = [resolve_group(model_parallel_group, "model")]
    expert = [expert_tp_group, resolve_group(ep_group, "ep"), pp_group]
    with_grads = []
    for p in params:
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if grad is not None:
            with_grads.append((p, grad))
    ps = [p for p, _ in with_grads]
    grads = [g for _, g in with_grads]
    norm = global_grad_norm(ps, grads, dense, expert, tp_group, expert_tp_group, pp_group)
    clip_grads_(grads, max_norm, norm)
    return norm.item()
