"""Runs a per-rank op list (F, B, W) with point-to-point transfers between pipeline stages.

Used by the zero-bubble schedules.  Each op receives what it needs just before
it runs (blocking) and posts its sends without waiting, so any op order that is
consistent across ranks (as :func:`zero_bubble.simulate` checks) cannot
deadlock.  Every stage boundary and direction has its own message tags, so
activations and gradients between the same pair of ranks never mix, whatever
the order in which the two ranks post them.  Without a fixed ``tensor_shape`` a
shape header (on a tag of its own) precedes each tensor, so shapes may vary.
Receives of the next few ops are posted ahead, so data lands while a rank
computes.  Hand-offs between two chunks of the same rank (the turn of ZBV's V)
stay local.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megalite.tensor_parallel.weight_grad import WeightGradStore

_MAX_DIMS = 7


class _Transfers:
    """Tagged isend/irecv with the ranks of the pp group; a shape header precedes each tensor
    unless the shape is fixed.  Receives can be posted ahead of need (:meth:`post`)."""

    def __init__(self, group, tensor_shape, dtype, device):
        self.group, self.dtype, self.device = group, dtype, device
        self.tensor_shape = None if tensor_shape is None else tuple(tensor_shape)
        self._in_flight: list = []
        self._posted: dict = {}

    def _global(self, rank):
        return dist.get_global_rank(self.group, rank)

    def send(self, tensor, rank, tag, on_sent=None):
        if tensor.dtype != self.dtype:
            raise ValueError(f"pipeline tensor has dtype {tensor.dtype}, the schedule communicates {self.dtype}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline tensors may have at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        buffers = [tensor.contiguous()]
        if self.tensor_shape is None:
            buffers.insert(0, torch.tensor([tensor.dim(), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim()),
                                           dtype=torch.int64, device=self.device))
        # Headers and tensors travel on tags of their own, so a header receive posted ahead
        # can never match a tensor.
        tags = [2 * tag + 1] if self.tensor_shape is not None else [2 * tag, 2 * tag + 1]
        works = [dist.isend(b, self._global(rank), group=self.group, tag=t) for b, t in zip(buffers, tags)]
        self._in_flight.append((works, buffers, on_sent))
        self._reap()

    def post(self, key, rank, tag):
        """Post the receive for ``key`` (the tensor itself, or its shape header) without waiting."""
        if key in self._posted:
            return
        if self.tensor_shape is None:
            buffer = torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)
        else:
            buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        first_tag = 2 * tag + (1 if self.tensor_shape is not None else 0)
        self._posted[key] = (dist.irecv(buffer, self._global(rank), group=self.group, tag=first_tag), buffer, rank, tag)

    def recv(self, key, rank, tag):
        self.post(key, rank, tag)
        work, buffer, _, _ = self._posted.pop(key)
        work.wait()
        if self.tensor_shape is not None:
            return buffer
        values = buffer.tolist()
        tensor = torch.empty(values[1:1 + values[0]], dtype=self.dtype, device=self.device)
        dist.irecv(tensor, self._global(rank), group=self.group, tag=2 * tag + 1).wait()
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


def run_ops(steps, ops, stage_rank, group, tensor_shape, dtype, device, free_storage, lookahead=2) -> None:
    """Execute this rank's ``ops`` with ``steps`` (the schedule's F/B/W runner).

    ``stage_rank(stage)`` is the pp rank holding a stage; ``steps.stage_of(chunk)``
    the stage of a local chunk.  ``free_storage(output)`` shrinks a sent output.
    The receives of the next ``lookahead`` ops are posted before an op runs, so a
    neighbour's data can land while this rank computes.
    """
    me = steps.pp_rank
    num_stages = steps.num_stages
    transfers = _Transfers(group, tensor_shape, dtype, device)
    local: dict = {}
    saved: dict = {}
    stores: dict = {}

    def source(kind, microbatch, chunk):
        """``(key, owner rank, tag)`` of what op (kind, microbatch, chunk) receives, or None."""
        stage = steps.stage_of(chunk)
        if kind == "F" and stage > 0:
            edge = stage - 1
        elif kind == "B" and stage < num_stages - 1:
            edge = stage
        else:
            return None
        owner = stage_rank(stage - 1 if kind == "F" else stage + 1)
        return (kind, microbatch, stage), owner, 2 * edge + (0 if kind == "F" else 1)

    def take(kind, microbatch, chunk):
        key, owner, tag = source(kind, microbatch, chunk)
        return local.pop(key) if owner == me else transfers.recv(key, owner, tag)

    def give(kind, microbatch, tensor, from_stage, to_stage, on_sent=None):
        owner = stage_rank(to_stage)
        if owner == me:
            local[kind, microbatch, to_stage] = tensor.detach() if kind == "F" else tensor
        else:
            edge = min(from_stage, to_stage)
            transfers.send(tensor, owner, 2 * edge + (0 if kind == "F" else 1), on_sent)

    for index, (kind, microbatch, chunk) in enumerate(ops):
        for ahead in ops[index:index + 1 + lookahead]:
            found = source(*ahead) if ahead[0] != "W" else None
            if found is not None and found[1] != me:
                transfers.post(*found)
        stage = steps.stage_of(chunk)
        if kind == "F":
            input_tensor = None if stage == 0 else steps.received(take("F", microbatch, chunk))
            output = steps.forward(microbatch, chunk, input_tensor)
            if not steps.forward_only:
                saved[microbatch, chunk] = (input_tensor, output)
            if stage < num_stages - 1:
                give("F", microbatch, output, stage, stage + 1, on_sent=partial(free_storage, output))
        elif kind == "B":
            input_tensor, output = saved.pop((microbatch, chunk))
            output_grad = None if stage == num_stages - 1 else take("B", microbatch, chunk)
            store = WeightGradStore()
            input_grad = steps.backward(microbatch, chunk, input_tensor, output, output_grad, store=store)
            stores[microbatch, chunk] = store
            if stage > 0:
                give("B", microbatch, input_grad, stage, stage - 1)
        else:
            steps.weight(microbatch, chunk, stores.pop((microbatch, chunk)))
    transfers.flush()
