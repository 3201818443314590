"""Pipeline schedules behind one entry point, :func:`forward_backward`.

* one stage: gradient accumulation over micro-batches;
* one chunk per rank: 1F1B (``pp - rank - 1`` warm-up forwards, then
  one-forward-one-backward, then the cool-down backwards);
* several chunks per rank: interleaved 1F1B over virtual stages, where chunk
  ``c`` on rank ``r`` is virtual stage ``c * pp + r``.

Every schedule has a forward-only mode.  Each sent activation's storage is
released on the sender once its send completes (its autograd graph stays valid);
gradients are synchronized once, at each chunk's last backward, and
``finalize_grads_func`` runs after the last micro-batch.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from functools import partial

import torch

from megalite.pipeline.p2p import StageLink
from megalite.topology import group_rank, group_size, resolve_group


def _input_setter(chunk):
    """The module whose ``set_input_tensor`` feeds this chunk (unwrapping a DDP wrapper)."""
    for candidate in (chunk, getattr(chunk, "module", None)):
        if candidate is not None and hasattr(candidate, "set_input_tensor"):
            return candidate
    return None


def _free_storage(output):
    """Shrink a sent activation to a one-element placeholder; its graph stays usable for backward.

    Autograd saves outputs as aliases, so the placeholder never reaches backward, but a
    saved-tensor hook that keeps the very tensor object it is handed would see it.
    """
    if output is None or not output.requires_grad or output._base is not None or output.dim() == 0:
        return
    output.data = torch.empty(1, dtype=output.dtype, device=output.device).expand(output.shape)


class _Steps:
    """Runs one forward or backward of a model chunk and keeps the bookkeeping of a schedule."""

    def __init__(self, forward_step_func, iterators, chunks, num_microbatches, forward_only, scale_loss,
                 recorder, pp_rank, pp_size):
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.scale_loss = scale_loss
        self.recorder = recorder
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.metrics: list[dict] = []
        self.backwards_left = [num_microbatches] * len(chunks)

    def is_first(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == len(self.chunks) - 1

    def _record(self, kind, microbatch, chunk):
        return nullcontext() if self.recorder is None else self.recorder.record(kind, microbatch, chunk)

    def received(self, tensor):
        """A received activation becomes a leaf whose grad goes back upstream."""
        if tensor is not None and not self.forward_only:
            tensor.requires_grad_(True)
        return tensor

    def forward(self, microbatch: int, chunk: int, input_tensor):
        """Output to send downstream, or on the last virtual stage the loss to backprop."""
        model = self.chunks[chunk]
        if not self.is_first(chunk):
            _input_setter(model).set_input_tensor(input_tensor)
        with self._record("F", microbatch, chunk), torch.set_grad_enabled(not self.forward_only):
            output, loss_func = self.forward_step_func(self.iterators[chunk], model)
            if self.is_last(chunk):
                loss, metrics = loss_func(output)
                self.metrics.append(metrics)
                output = loss / self.num_microbatches
                if self.scale_loss is not None:
                    output = self.scale_loss(output)
        return output

    def backward(self, microbatch: int, chunk: int, input_tensor, output, output_grad):
        """Backprop one micro-batch through a chunk; returns the grad to send upstream."""
        self.backwards_left[chunk] -= 1
        model = self.chunks[chunk]
        last_one = self.backwards_left[chunk] == 0
        sync = nullcontext() if last_one or not hasattr(model, "no_sync") else model.no_sync()
        with self._record("B", microbatch, chunk), sync:
            torch.autograd.backward(output, grad_tensors=output_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            return torch.zeros_like(input_tensor)
        return input_tensor.grad


def _no_pipelining(steps: _Steps) -> None:
    for microbatch in range(steps.num_microbatches):
        output = steps.forward(microbatch, 0, None)
        if not steps.forward_only:
            steps.backward(microbatch, 0, None, output, None)


def _one_f_one_b(steps: _Steps, link: StageLink) -> None:
    rank, pp, m = steps.pp_rank, steps.pp_size, steps.num_microbatches
    first, last, forward_only = rank == 0, rank == pp - 1, steps.forward_only
    warmup = min(pp - rank - 1, m)
    steady = m - warmup
    saved: deque = deque()

    def recv_forward():
        return None if first else steps.received(link.recv_forward())

    def send_forward(output):
        if not last:
            link.send_forward(output, on_sent=partial(_free_storage, output))

    def forward(microbatch, input_tensor):
        output = steps.forward(microbatch, 0, input_tensor)
        if not forward_only:
            saved.append((input_tensor, output))
        return output

    def backward(microbatch, output_grad):
        input_tensor, output = saved.popleft()
        return steps.backward(microbatch, 0, input_tensor, output, output_grad)

    for microbatch in range(warmup):
        send_forward(forward(microbatch, recv_forward()))

    input_tensor = recv_forward() if steady else None
    for i in range(steady):
        output = forward(warmup + i, input_tensor)
        final = i == steady - 1
        if forward_only:
            send_forward(output)
            input_tensor = None if final else recv_forward()
            continue
        output_grad = None
        if not last:
            output_grad = link.send_forward_recv_backward(output, on_sent=partial(_free_storage, output))
        input_grad = backward(i, output_grad)
        if first:
            input_tensor = None
        elif final:
            link.send_backward(input_grad)
            input_tensor = None
        else:
            input_tensor = steps.received(link.send_backward_recv_forward(input_grad))

    if forward_only:
        return
    for microbatch in range(steady, m):
        output_grad = None if last else link.recv_backward()
        input_grad = backward(microbatch, output_grad)
        if not first:
            link.send_backward(input_grad)


def _interleaved(steps: _Steps, link: StageLink) -> None:
    rank, pp, m = steps.pp_rank, steps.pp_size, steps.num_microbatches
    vpp = len(steps.chunks)
    total = m * vpp
    forward_only = steps.forward_only
    all_warmup = forward_only or m == pp
    warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    steady = total - warmup
    first_rank, last_rank = rank == 0, rank == pp - 1
    inputs = [deque() for _ in range(vpp)]
    grads = [deque() for _ in range(vpp)]
    saved = [deque() for _ in range(vpp)]

    def chunk_of(k, forward):
        chunk = (k % (pp * vpp)) // pp
        return chunk if forward else vpp - 1 - chunk

    def microbatch_of(k):
        return (k // (pp * vpp)) * pp + k % pp

    def forward(k):
        chunk = chunk_of(k, True)
        input_tensor = None if steps.is_first(chunk) else inputs[chunk].popleft()
        output = steps.forward(microbatch_of(k), chunk, input_tensor)
        if not forward_only:
            saved[chunk].append((input_tensor, output))
        return None if steps.is_last(chunk) else output

    def backward(k):
        chunk = chunk_of(k, False)
        input_tensor, output = saved[chunk].popleft()
        output_grad = None if steps.is_last(chunk) else grads[chunk].popleft()
        input_grad = steps.backward(microbatch_of(k), chunk, input_tensor, output, output_grad)
        return None if steps.is_first(chunk) else input_grad

    def exchange(output, input_grad, recv_prev, recv_next, forward_chunk, backward_chunk):
        from_prev, from_next = link.exchange(send_next=output, send_prev=input_grad, recv_prev=recv_prev,
                                             recv_next=recv_next, on_sent=partial(_free_storage, output))
        if recv_prev:
            inputs[forward_chunk].append(steps.received(from_prev))
        if recv_next:
            grads[backward_chunk].append(from_next)

    if not first_rank:
        inputs[0].append(steps.received(link.recv_forward()))
    for k in range(warmup):
        output = forward(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
        recv_next = k == warmup - 1 and not all_warmup and not last_rank
        exchange(output, None, recv_prev, recv_next, next_chunk, vpp - 1)

    for i in range(steady):
        forward_k, backward_k = warmup + i, i
        output = forward(forward_k)
        input_grad = backward(backward_k)
        if first_rank:
            # The last rank runs pp - 1 forwards behind the first; its output feeds chunk + 1 here.
            sender_chunk = chunk_of(forward_k - (pp - 1), True)
            recv_prev = sender_chunk != vpp - 1
            next_forward_chunk = sender_chunk + 1
        else:
            recv_prev = True
            next_forward_chunk = chunk_of(forward_k + 1, True)
        if last_rank:
            # Symmetrically, the first rank's backward grads feed the last rank's chunk - 1.
            sender_chunk = chunk_of(backward_k - (pp - 1), False)
            recv_next = sender_chunk != 0
            next_backward_chunk = sender_chunk - 1
        else:
            recv_next = True
            next_backward_chunk = chunk_of(backward_k + 1, False)
        recv_prev = recv_prev and i != steady - 1
        exchange(output, input_grad, recv_prev, recv_next, next_forward_chunk, next_backward_chunk)

    if forward_only:
        return
    if all_warmup and not last_rank:
        grads[vpp - 1].append(link.recv_backward())
    for k in range(steady, total):
        input_grad = backward(k)
        next_chunk = chunk_of(k + 1, False)
        recv_next = not (last_rank and next_chunk == vpp - 1) and k != total - 1
        exchange(None, input_grad, False, recv_next, 0, next_chunk)


def _device_of(chunks) -> torch.device:
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


def forward_backward(forward_step_func, data_iterator, model, num_microbatches, *, tensor_shape=None,
                     dtype=torch.float32, forward_only=False, pp_group=None, finalize_grads_func=None,
                     scale_loss=None, recorder=None) -> list[dict]:
    """Run forward (and backward) passes over ``num_microbatches`` micro-batches.

    ``model`` is one module or a list of model chunks (several ⇒ interleaved).
    ``forward_step_func(data_iterator, chunk) -> (output, loss_func)``; on the
    last stage ``loss_func(output) -> (loss, metrics)`` and the schedule
    backprops ``loss / num_microbatches`` (through ``scale_loss`` if given).
    ``tensor_shape`` fixes the shape sent between stages; None communicates it.
    Returns the per-micro-batch metrics on the last stage, ``[]`` elsewhere.
    Bad sizes raise ValueError before any communication.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    vpp = len(chunks)
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if vpp == 0:
        raise ValueError("model is an empty list of chunks")
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != vpp:
            raise ValueError(f"got {len(data_iterator)} data iterators for {vpp} model chunks")
        iterators = list(data_iterator)
    elif vpp > 1 and data_iterator is not None:
        raise ValueError(f"interleaving over {vpp} model chunks needs a list of {vpp} data iterators")
    else:
        iterators = [data_iterator] * vpp
    group = resolve_group(pp_group, "pp")
    pp, rank = group_size(group), group_rank(group)
    if pp == 1 and vpp > 1:
        raise ValueError(f"{vpp} model chunks need a pipeline of more than one stage, got pp={pp}")
    if vpp > 1 and num_microbatches % pp:
        raise ValueError(f"the interleaved schedule needs num_microbatches divisible by pp: "
                         f"{num_microbatches} micro-batches, pp={pp}")
    for index, chunk in enumerate(chunks):
        if (rank > 0 or index > 0) and _input_setter(chunk) is None:
            raise ValueError(f"model chunk {index} on pipeline rank {rank} takes its input from the previous "
                             f"stage but has no set_input_tensor()")
    if recorder is not None:
        recorder.stage = rank

    steps = _Steps(forward_step_func, iterators, chunks, num_microbatches, forward_only, scale_loss,
                   recorder, rank, pp)
    if pp == 1:
        _no_pipelining(steps)
    else:
        link = StageLink(group, tensor_shape, dtype, _device_of(chunks))
        (_interleaved if vpp > 1 else _one_f_one_b)(steps, link)
        link.flush()
    if not forward_only and finalize_grads_func is not None:
        finalize_grads_func(chunks)
    return steps.metrics if rank == pp - 1 else []
