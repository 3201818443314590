"""Runs a per-rank op list (F, B, W) with point-to-point transfers between pipeline stages.

Used by the zero-bubble schedules.  Each op receives what it needs just before
it runs (blocking) and posts its sends without waiting, so any op order that is
consistent across ranks (as :func:`zero_bubble.simulate` checks) cannot
deadlock.  Every stage boundary and direction has its own message tag, so
activations and gradients between the same pair of ranks never mix, whatever
the order in which the two ranks post them; a shape header precedes each
tensor, so shapes may vary.  Hand-offs between two chunks of the same rank
(the turn of ZBV's V) stay local.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megalite.tensor_parallel.weight_grad import WeightGradStore

_MAX_DIMS = 7


class _Transfers:
    """Tagged, shape-headed isend/irecv with the ranks of the pp group."""

    def __init__(self, group, dtype, device):
        self.group, self.dtype, self.device = group, dtype, device
        self._in_flight: list = []

    def _global(self, rank):
        return dist.get_global_rank(self.group, rank)

    def send(self, tensor, rank, tag, on_sent=None):
        if tensor.dtype != self.dtype:
            raise ValueError(f"pipeline tensor has dtype {tensor.dtype}, the schedule communicates {self.dtype}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline tensors may have at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        header = torch.tensor([tensor.dim(), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim()), dtype=torch.int64,
                              device=self.device)
        payload = tensor.contiguous()
        works = [dist.isend(header, self._global(rank), group=self.group, tag=tag),
                 dist.isend(payload, self._global(rank), group=self.group, tag=tag)]
        self._in_flight.append((works, [header, payload], on_sent))
        self._reap()

    def recv(self, rank, tag):
        header = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        dist.irecv(header, self._global(rank), group=self.group, tag=tag).wait()
        values = header.tolist()
        tensor = torch.empty(values[1:1 + values[0]], dtype=self.dtype, device=self.device)
        dist.irecv(tensor, self._global(rank), group=self.group, tag=tag).wait()
        return tensor

    def _reap(self):
        while self._in_flight and all(w.is_completed() for w in self._in_flight[0][0]):
            _, _, on_sent = self._in_flight.pop(0)
            if on_sent is not None:
                on_sent()

    def flush(self):
        for works, _, on_sent in self._in_flight:
            for work in works:
                work.wait()
            if on_sent is not None:
                on_sent()
        self._in_flight.clear()


def run_ops(steps, ops, stage_rank, group, dtype, device, free_storage) -> None:
    """Execute this rank's ``ops`` with ``steps`` (the schedule's F/B/W runner).

    ``stage_rank(stage)`` is the pp rank holding a stage; ``steps.stage_of(chunk)``
    the stage of a local chunk.  ``free_storage(output)`` shrinks a sent output.
    """
    me = steps.pp_rank
    num_stages = steps.num_stages
    transfers = _Transfers(group, dtype, device)
    local: dict = {}
    saved: dict = {}
    stores: dict = {}

    def tag(stage, downstream):
        return 2 * stage + (0 if downstream else 1)

    def take(kind, microbatch, from_stage, to_stage):
        """The activation (F) or gradient (B) that ``from_stage`` passes to ``to_stage``."""
        owner = stage_rank(from_stage)
        if owner == me:
            return local.pop((kind, microbatch, to_stage))
        return transfers.recv(owner, tag(min(from_stage, to_stage), kind == "F"))

    def give(kind, microbatch, tensor, from_stage, to_stage, on_sent=None):
        owner = stage_rank(to_stage)
        if owner == me:
            local[kind, microbatch, to_stage] = tensor.detach() if kind == "F" else tensor
        else:
            transfers.send(tensor, owner, tag(min(from_stage, to_stage), kind == "F"), on_sent)

    for kind, microbatch, chunk in ops:
        stage = steps.stage_of(chunk)
        if kind == "F":
            input_tensor = None if stage == 0 else steps.received(take("F", microbatch, stage - 1, stage))
            output = steps.forward(microbatch, chunk, input_tensor)
            if not steps.forward_only:
                saved[microbatch, chunk] = (input_tensor, output)
            if stage < num_stages - 1:
                give("F", microbatch, output, stage, stage + 1, on_sent=partial(free_storage, output))
        elif kind == "B":
            input_tensor, output = saved.pop((microbatch, chunk))
            output_grad = None if stage == num_stages - 1 else take("B", microbatch, stage + 1, stage)
            store = WeightGradStore()
            input_grad = steps.backward(microbatch, chunk, input_tensor, output, output_grad, store=store)
            stores[microbatch, chunk] = store
            if stage > 0:
                give("B", microbatch, input_grad, stage, stage - 1)
        else:
            steps.weight(microbatch, chunk, stores.pop((microbatch, chunk)))
    transfers.flush()
