"""Point-to-point exchanges of activations and gradients between adjacent stages.

Every exchange is one batch of isend/irecv with the previous and next pipeline
rank (wrapping around, so the last rank feeds the first one's next model chunk
under interleaving).  Activations travel downstream with tag 0 and gradients
upstream with tag 1, and ops are posted activations first on both sides, so
messages between a pair match even when that pair is both prev and next.
When no fixed shape is given, a small shape header precedes each tensor in
its own batch, so sequence lengths may change from one batch to the next.

An exchange waits for its receives only: sends complete in the background
(a rank need not wait for its neighbour to be ready to receive), and each
send's ``on_sent`` callback runs once the send is known to be done, at a
later exchange or at :meth:`StageLink.flush`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.topology import group_rank, group_size

_DOWN, _UP = 0, 1
_MAX_DIMS = 7


class StageLink:
    """Batched send/receive with this rank's neighbours in the pipeline group."""

    def __init__(self, group, tensor_shape=None, dtype=torch.float32, device=None):
        size, rank = group_size(group), group_rank(group)
        self.group = group
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)
        self.tensor_shape = None if tensor_shape is None else tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else device
        self._in_flight: list[tuple[object, object]] = []

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, on_sent=None):
        """Send to next/prev and receive from prev/next in one batch; returns (from_prev, from_next).

        ``on_sent()`` runs once both sends of this exchange have completed.
        """
        for tensor in (send_next, send_prev):
            if tensor is not None and tensor.dtype != self.dtype:
                raise ValueError(f"pipeline tensor has dtype {tensor.dtype}, the schedule communicates {self.dtype}")
        self._reap()
        if self.tensor_shape is None:
            prev_shape, next_shape = self._exchange_shapes(send_next, send_prev, recv_prev, recv_next)
        else:
            prev_shape = next_shape = self.tensor_shape
        from_prev = self._empty(prev_shape) if recv_prev else None
        from_next = self._empty(next_shape) if recv_next else None
        self._run(send_next, from_prev, send_prev, from_next, on_sent)
        return from_prev, from_next

    def flush(self) -> None:
        """Wait for every send still in flight and run its callback."""
        for works, on_sent in self._in_flight:
            for work in works:
                work.wait()
            if on_sent is not None:
                on_sent()
        self._in_flight.clear()

    def _reap(self) -> None:
        """Run the callbacks of sends that have completed, oldest first."""
        while self._in_flight and all(w.is_completed() for w in self._in_flight[0][0]):
            _, on_sent = self._in_flight.pop(0)
            if on_sent is not None:
                on_sent()

    def _empty(self, shape):
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _run(self, send_next, recv_prev, send_prev, recv_next, on_sent=None):
        ops, is_send = [], []
        for tensor, peer, tag, op in ((send_next, self.next_rank, _DOWN, dist.isend),
                                      (recv_prev, self.prev_rank, _DOWN, dist.irecv),
                                      (send_prev, self.prev_rank, _UP, dist.isend),
                                      (recv_next, self.next_rank, _UP, dist.irecv)):
            if tensor is not None:
                ops.append(dist.P2POp(op, tensor.contiguous() if op is dist.isend else tensor, peer, self.group, tag))
                is_send.append(op is dist.isend)
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) != len(ops):
            # A coalesced backend (NCCL) returns one handle for the whole batch.
            sends = []
            for work in works:
                work.wait()
        else:
            sends = [(work, op.tensor) for work, op, send in zip(works, ops, is_send) if send]
            for work, send in zip(works, is_send):
                if not send:
                    work.wait()
        if sends:
            # Keep each sent buffer alive until its send has completed.
            self._in_flight.append(([w for w, _ in sends], _Release(on_sent, [t for _, t in sends])))
        elif on_sent is not None:
            on_sent()

    def _header(self, tensor):
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline tensors may have at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        values = [tensor.dim(), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim())
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _empty_header(self):
        return torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=self.device)

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        prev_header = self._empty_header() if recv_prev else None
        next_header = self._empty_header() if recv_next else None
        self._run(None if send_next is None else self._header(send_next), prev_header,
                  None if send_prev is None else self._header(send_prev), next_header)

        def shape(h):
            if h is None:
                return None
            values = h.tolist()
            return tuple(values[1:1 + values[0]])

        return shape(prev_header), shape(next_header)

    def recv_forward(self):
        return self.exchange(recv_prev=True)[0]

    def recv_backward(self):
        return self.exchange(recv_next=True)[1]

    def send_forward(self, output, on_sent=None):
        self.exchange(send_next=output, on_sent=on_sent)

    def send_backward(self, input_grad):
        self.exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output, on_sent=None):
        return self.exchange(send_next=output, recv_next=True, on_sent=on_sent)[1]

    def send_backward_recv_forward(self, input_grad):
        return self.exchange(send_prev=input_grad, recv_prev=True)[0]

class _Release:
    """Holds sent buffers until their sends complete, then runs the exchange's callback."""

    def __init__(self, on_sent, buffers):
        self.on_sent, self.buffers = on_sent, buffers

    def __call__(self):
        self.buffers = None
        if self.on_sent is not None:
            self.on_sent()
