"""Token dispatchers: move routed tokens to the ranks that own their experts and back.

``dispatch(tokens, probs, indices)`` returns ``(rows, counts, plan)``: the rows
this rank's local experts must process, grouped by local expert with
``counts[e]`` rows each; ``combine(expert_rows, plan)`` returns ``[T, h]``, every
token's outputs weighted by its routing probabilities and summed.  Expert
tensor parallelism: each expert's rows are gathered to all of its ETP shards
and their partial outputs are reduce-scattered back, so the experts module sees
every row its expert must process.

``last_bytes_sent`` is the hidden-state payload this rank sent to other EP
ranks in the latest dispatch (what the benchmark compares with the analytic
volume).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite import kernels, topology
from megalite.moe.comm import all_gather_counts, all_to_all, gather_rows, reduce_scatter_rows


@dataclass
class _AllToAllPlan:
    row_map: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    send_splits: list[int]
    recv_splits: list[int]
    etp_sizes: list[int]
    order: torch.Tensor | None


@dataclass
class _AllGatherPlan:
    row_map: torch.Tensor
    probs: torch.Tensor
    ep_sizes: list[int]
    etp_sizes: list[int]


def _ranks(group) -> tuple[int, int]:
    return topology.group_size(group), topology.group_rank(group)


class AllToAllDispatcher:
    """Permute by expert, exchange counts, all-to-all over EP, gather over ETP; the reverse to combine."""

    def __init__(self, num_experts: int, ep_group=None, etp_group=None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size, self.ep_rank = _ranks(ep_group)
        self.etp_size, _ = _ranks(etp_group)
        self.num_local = num_experts // self.ep_size
        self.last_bytes_sent = 0

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        ep, num_local = self.ep_size, self.num_local
        permuted, row_map = kernels.permute(tokens, indices)
        send = torch.bincount(indices[indices >= 0], minlength=self.num_experts).view(ep, num_local)
        recv = all_to_all(send, self.ep_group, [1] * ep, [1] * ep)
        grid = all_gather_counts(recv, self.etp_group)
        send_list, grid_list = send.sum(1).tolist(), grid.tolist()
        recv_splits = [sum(row) for row in grid_list[topology.group_rank(self.etp_group)]]
        etp_sizes = [sum(map(sum, block)) for block in grid_list]
        self.last_bytes_sent = (sum(send_list) - send_list[self.ep_rank]) * tokens.shape[1] * tokens.element_size()

        rows = all_to_all(permuted, self.ep_group, recv_splits, send_list)
        rows = gather_rows(rows, self.etp_group, etp_sizes)
        counts = grid.sum((0, 1))
        order = None
        if num_local > 1 and ep * self.etp_size > 1:
            expert_of_row = torch.repeat_interleave(
                torch.arange(num_local, device=rows.device).repeat(ep * self.etp_size), grid.reshape(-1),
                output_size=rows.shape[0])
            order = torch.argsort(expert_of_row, stable=True)
            rows = rows.index_select(0, order)
        plan = _AllToAllPlan(row_map, probs, tokens.shape[0], send_list, recv_splits, etp_sizes, order)
        return rows, counts.tolist(), plan

    def combine(self, expert_rows: torch.Tensor, plan: _AllToAllPlan) -> torch.Tensor:
        if plan.order is not None:
            inverse = torch.empty_like(plan.order)
            inverse[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)
            expert_rows = expert_rows.index_select(0, inverse)
        rows = reduce_scatter_rows(expert_rows, self.etp_group, plan.etp_sizes)
        rows = all_to_all(rows, self.ep_group, plan.send_splits, plan.recv_splits)
        return kernels.unpermute(rows, plan.row_map, plan.probs, plan.num_tokens)


class AllGatherDispatcher:
    """Gather every token of the EP x ETP group, keep those for local experts; reduce-scatter to combine."""

    def __init__(self, num_experts: int, ep_group=None, etp_group=None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size, self.ep_rank = _ranks(ep_group)
        self.num_local = num_experts // self.ep_size
        self.last_bytes_sent = 0

    @staticmethod
    def _gather(tensors, group):
        if group is None:
            return tensors, [tensors[0].shape[0]]
        sizes = all_gather_counts(torch.tensor([tensors[0].shape[0]], device=tensors[0].device), group)
        sizes = sizes.reshape(-1).tolist()
        return [gather_rows(t, group, sizes) for t in tensors], sizes

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        self.last_bytes_sent = tokens.shape[0] * tokens.shape[1] * tokens.element_size() * (self.ep_size - 1)
        (tokens, probs, indices), ep_sizes = self._gather([tokens, probs, indices], self.ep_group)
        (tokens, probs, indices), etp_sizes = self._gather([tokens, probs, indices], self.etp_group)
        first = self.ep_rank * self.num_local
        local = indices - first
        local = local.masked_fill((local < 0) | (local >= self.num_local), -1)
        rows, row_map = kernels.permute(tokens, local)
        counts = torch.bincount(local[local >= 0], minlength=self.num_local)
        return rows, counts.tolist(), _AllGatherPlan(row_map, probs, ep_sizes, etp_sizes)

    def combine(self, expert_rows: torch.Tensor, plan: _AllGatherPlan) -> torch.Tensor:
        out = kernels.unpermute(expert_rows, plan.row_map, plan.probs, plan.probs.shape[0])
        out = reduce_scatter_rows(out, self.etp_group, plan.etp_sizes)
        return reduce_scatter_rows(out, self.ep_group, plan.ep_sizes)


def make_dispatcher(kind: str, num_experts: int, ep_group=None, etp_group=None):
    """The dispatcher named by ``MoEConfig.dispatcher``."""
    cls = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[kind]
    return cls(num_experts, ep_group, etp_group)
