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

import math
from dataclasses import dataclass

import torch

from megalite import kernels, topology
from megalite.moe.comm import (PendingAllToAll, all_gather_counts, all_to_all, all_to_all_start, gather_rows,
                               reduce_scatter_rows)


@dataclass
class _AllToAllPlan:
    """Source side: ``rank_map`` (rows by destination rank; None without EP), the all-to-all splits.  Receiver
    side: the ETP block sizes, ``row_map`` (rows by local expert) with the rows' ``gates`` over ``num_rows``."""

    rank_map: torch.Tensor | None
    num_tokens: int
    send_splits: list[int]
    recv_splits: list[int]
    etp_sizes: list[int]
    row_map: torch.Tensor
    gates: torch.Tensor
    num_rows: int


@dataclass
class _InFlightDispatch:
    """A dispatch before :meth:`AllToAllDispatcher.finish_dispatch`: the rows, local expert ids and gates
    received (or pending), and the source side of the plan."""

    received: list[torch.Tensor | PendingAllToAll]
    rank_map: torch.Tensor | None
    num_tokens: int
    send_splits: list[int]
    recv_splits: list[int]


@dataclass
class _AllGatherPlan:
    row_map: torch.Tensor
    probs: torch.Tensor
    ep_sizes: list[int]
    etp_sizes: list[int]


def ranks_per_token(num_experts: int, topk: int, ep_size: int, group_topk: int | None = None) -> float:
    """EP ranks one token's rows reach in :class:`AllToAllDispatcher` (itself included), expected under uniform
    routing: a rank holds none of the token's k distinct experts with probability C(E - E/ep, k) / C(E, k).
    Group-limited routing with the groups aligned to the EP ranks caps it at ``group_topk``."""
    missed = math.comb(num_experts - num_experts // ep_size, topk) / math.comb(num_experts, topk)
    reached = ep_size * (1 - missed)
    return reached if group_topk is None else min(reached, group_topk)


def _ranks(group) -> tuple[int, int]:
    return topology.group_size(group), topology.group_rank(group)


class AllToAllDispatcher:
    """Send each token once to every EP rank holding one of its experts; expand it to those experts there.

    As DeepEP does it: the source permutes tokens by destination rank (one row per
    (token, rank), however many of the token's experts that rank holds) and sends
    each row's local expert ids and gates beside it; the receiver gathers the rows
    over ETP and permutes them by local expert.  To combine, the receiver sums each
    row's expert outputs weighted by their gates, reduce-scatters over ETP, and
    sends one row per (token, rank) back, where the source sums over ranks.  So a
    token whose experts lie on g ranks costs g rows of hidden state, not k.
    Without an EP group the rank step is skipped (every expert is local).
    """

    def __init__(self, num_experts: int, ep_group=None, etp_group=None):
        self.num_experts = num_experts
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size, self.ep_rank = _ranks(ep_group)
        self.etp_size, _ = _ranks(etp_group)
        self.num_local = num_experts // self.ep_size
        self.last_bytes_sent = 0

    def _to_ranks(self, tokens, probs, indices):
        """Rows by destination rank, with each row's local expert ids (-1: not on that rank) and gates."""
        ep = self.ep_size
        dest = torch.where(indices >= 0, torch.div(indices, self.num_local, rounding_mode="floor"), -1)
        ranks = torch.arange(ep, device=indices.device)
        hit = (dest.unsqueeze(-1) == ranks).any(1)
        rows, rank_map = kernels.permute(tokens, torch.where(hit, ranks, -1))
        token, rank = torch.div(rank_map, ep, rounding_mode="floor"), rank_map % ep
        local = torch.where(dest[token] == rank[:, None], indices[token] - rank[:, None] * self.num_local, -1)
        return rows, local, probs.index_select(0, token), rank_map, hit.sum(0)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        return self.finish_dispatch(self._exchange(tokens, probs, indices, all_to_all))

    def start_dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> _InFlightDispatch:
        """Issue the dispatch's EP all-to-alls without waiting; :meth:`finish_dispatch` completes it.  Work run in
        between overlaps the token exchange (``MoEConfig.shared_expert_overlap``), and, in backward, the
        exchange of the rows' gradients (see :func:`all_to_all_start`)."""
        return self._exchange(tokens, probs, indices, all_to_all_start)

    def _exchange(self, tokens, probs, indices, send) -> _InFlightDispatch:
        """Rows, local expert ids and gates sent to the EP ranks by ``send`` (blocking or not)."""
        num_tokens = tokens.shape[0]
        rank_map, send_list, recv_splits = None, [num_tokens], [num_tokens]
        rows, local, gates = tokens, indices, probs
        if self.ep_group is not None:
            rows, local, gates, rank_map, send_counts = self._to_ranks(tokens, probs, indices)
            send_list = send_counts.tolist()
            recv_splits = all_to_all(send_counts, self.ep_group, [1] * self.ep_size, [1] * self.ep_size).tolist()
        self.last_bytes_sent = (sum(send_list) - send_list[self.ep_rank]) * tokens.shape[1] * tokens.element_size()
        received = [send(t, self.ep_group, recv_splits, send_list) for t in (rows, local, gates)]
        return _InFlightDispatch(received, rank_map, num_tokens, send_list, recv_splits)

    def finish_dispatch(self, started: _InFlightDispatch):
        """Wait for :meth:`start_dispatch`'s exchange; return ``dispatch``'s ``(rows, counts, plan)``."""
        rows, local, gates = (t.wait() if isinstance(t, PendingAllToAll) else t for t in started.received)
        etp_sizes = [rows.shape[0]]
        if self.etp_group is not None:
            etp_sizes = all_gather_counts(torch.tensor([rows.shape[0]], device=rows.device), self.etp_group)
            etp_sizes = etp_sizes.reshape(-1).tolist()
            rows, local, gates = (gather_rows(t, self.etp_group, etp_sizes) for t in (rows, local, gates))
        expert_rows, row_map = kernels.permute(rows, local)
        counts = torch.bincount(local[local >= 0], minlength=self.num_local)
        plan = _AllToAllPlan(started.rank_map, started.num_tokens, started.send_splits, started.recv_splits,
                             etp_sizes, row_map, gates, rows.shape[0])
        return expert_rows, counts.tolist(), plan

    def combine(self, expert_rows: torch.Tensor, plan: _AllToAllPlan) -> torch.Tensor:
        rows = kernels.unpermute(expert_rows, plan.row_map, plan.gates, plan.num_rows)
        rows = reduce_scatter_rows(rows, self.etp_group, plan.etp_sizes)
        if plan.rank_map is None:
            return rows
        rows = all_to_all(rows, self.ep_group, plan.send_splits, plan.recv_splits)
        ones = torch.ones(plan.num_tokens, self.ep_size, dtype=torch.float32, device=rows.device)
        return kernels.unpermute(rows, plan.rank_map, ones, plan.num_tokens)


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
