"""Pipeline schedules behind one entry point, :func:`forward_backward`.

* one stage: gradient accumulation over micro-batches;
* one chunk per rank: 1F1B (``pp - rank - 1`` warm-up forwards, then
  one-forward-one-backward, then the cool-down backwards);
* several chunks per rank: interleaved 1F1B over virtual stages, where chunk
  ``c`` on rank ``r`` is virtual stage ``c * pp + r``;
* ``schedule="zero-bubble-h1"`` / ``"zbv"``: the zero-bubble schedules of
  :mod:`megalite.pipeline.zero_bubble`, which split each backward into B (input
  gradient) and W (weight gradient, deferred through a
  :class:`~megalite.tensor_parallel.weight_grad.WeightGradStore`), run by
  :mod:`megalite.pipeline.executor`.

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

from megalite.pipeline.executor import run_ops
from megalite.pipeline.p2p import StageLink
from megalite.pipeline.stages import StageMap, last_stage_rank
from megalite.pipeline.zero_bubble import zb_h1_order, zbv_order
from megalite.tensor_parallel.weight_grad import WeightGradStore, defer_weight_grads
from megalite.topology import group_rank, group_size, resolve_group

SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble-h1", "zbv")


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
                 recorder, pp_rank, pp_size, v_shape=False):
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.scale_loss = scale_loss
        self.recorder = recorder
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.stages = StageMap(pp_size, len(chunks), v_shape)
        self.num_stages = self.stages.num_stages
        self.metrics: list[dict] = []
        self.backwards_left = [num_microbatches] * len(chunks)
        self.weights_left = [num_microbatches] * len(chunks)
        # Under a split backward the forward, too, runs with a store active, so layers pick
        # their splittable backward; nothing is pushed during a forward.
        self.split_backward = False

    def stage_of(self, chunk: int) -> int:
        """The pipeline stage of a local chunk (see :class:`StageMap`)."""
        return self.stages.stage(self.pp_rank, chunk)

    def is_first(self, chunk: int) -> bool:
        return self.stage_of(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage_of(chunk) == self.num_stages - 1

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
        split = defer_weight_grads(WeightGradStore()) if self.split_backward else nullcontext()
        with self._record("F", microbatch, chunk), torch.set_grad_enabled(not self.forward_only), split:
            output, loss_func = self.forward_step_func(self.iterators[chunk], model)
            if self.is_last(chunk):
                loss, metrics = loss_func(output)
                self.metrics.append(metrics)
                output = loss / self.num_microbatches
                if self.scale_loss is not None:
                    output = self.scale_loss(output)
        return output

    def _sync(self, chunk: int, last_one: bool):
        """DDP's ``no_sync()`` for all but a chunk's last gradient pass."""
        model = self.chunks[chunk]
        return nullcontext() if last_one or not hasattr(model, "no_sync") else model.no_sync()

    def backward(self, microbatch: int, chunk: int, input_tensor, output, output_grad, store=None):
        """Backprop one micro-batch through a chunk; returns the grad to send upstream.

        With ``store`` this is the B half of a split backward: weight gradients of
        splittable layers are deferred into ``store`` for :meth:`weight`.
        """
        self.backwards_left[chunk] -= 1
        split = nullcontext() if store is None else defer_weight_grads(store)
        with self._record("B", microbatch, chunk), self._sync(chunk, self.backwards_left[chunk] == 0), split:
            torch.autograd.backward(output, grad_tensors=output_grad)
        if input_tensor is None:
            return None
        if input_tensor.grad is None:
            return torch.zeros_like(input_tensor)
        return input_tensor.grad

    def weight(self, microbatch: int, chunk: int, store: WeightGradStore) -> None:
        """The W half of a split backward: the weight gradients ``store`` deferred."""
        self.weights_left[chunk] -= 1
        with self._record("W", microbatch, chunk), self._sync(chunk, self.weights_left[chunk] == 0):
            store.run()


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
                     scale_loss=None, recorder=None, schedule=None) -> list[dict]:
    """Run forward (and backward) passes over ``num_microbatches`` micro-batches.

    ``model`` is one module or a list of model chunks (several ⇒ interleaved).
    ``forward_step_func(data_iterator, chunk) -> (output, loss_func)``; on the
    last stage ``loss_func(output) -> (loss, metrics)`` and the schedule
    backprops ``loss / num_microbatches`` (through ``scale_loss`` if given).
    ``tensor_shape`` fixes the shape sent between stages; None communicates it.
    ``schedule`` is one of :data:`SCHEDULES`; None means 1f1b, or
    interleaved-1f1b with several chunks.  zbv takes two chunks per rank in the V
    of :class:`StageMap` (so the last stage is on pp rank 0).
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
    schedule = check_schedule(schedule, pp, vpp, num_microbatches, forward_only)
    for index, chunk in enumerate(chunks):
        if (rank > 0 or index > 0) and _input_setter(chunk) is None:
            raise ValueError(f"model chunk {index} on pipeline rank {rank} takes its input from the previous "
                             f"stage but has no set_input_tensor()")
    if recorder is not None:
        recorder.stage, recorder.schedule = rank, schedule
        recorder.start_iteration()

    steps = _Steps(forward_step_func, iterators, chunks, num_microbatches, forward_only, scale_loss,
                   recorder, rank, pp, v_shape=schedule == "zbv")
    if pp == 1:
        _no_pipelining(steps)
    elif _uses_op_list(schedule, pp, num_microbatches, forward_only):
        steps.split_backward = not forward_only
        if forward_only:
            ops = _forward_only_ops(pp, vpp, num_microbatches)
        else:
            ops = (zbv_order if schedule == "zbv" else zb_h1_order)(pp, rank, num_microbatches)
        run_ops(steps, ops, steps.stages.rank_of, group, tensor_shape, dtype, _device_of(chunks), _free_storage)
    else:
        link = StageLink(group, tensor_shape, dtype, _device_of(chunks))
        (_interleaved if vpp > 1 else _one_f_one_b)(steps, link)
        link.flush()
    if not forward_only and finalize_grads_func is not None:
        finalize_grads_func(chunks)
    return steps.metrics if rank == last_stage_rank(pp, schedule) else []


def _uses_op_list(schedule: str, pp: int, m: int, forward_only: bool) -> bool:
    """Whether the op-list executor runs this call: the zero-bubble schedules (ZB-H1's forward-only
    run is 1F1B's), and forward-only interleaving over a micro-batch count not divisible by pp."""
    if schedule == "zbv":
        return True
    if schedule == "zero-bubble-h1":
        return not forward_only
    return forward_only and schedule == "interleaved-1f1b" and m % pp != 0


def _forward_only_ops(pp: int, vpp: int, m: int) -> list[tuple[str, int, int]]:
    """Forwards in groups of ``pp`` micro-batches, each group through chunk 0, 1, ... (Megatron's
    interleaved order; the last group may be smaller, so any ``m`` works)."""
    return [("F", mb, c) for first in range(0, m, pp) for c in range(vpp) for mb in range(first, min(first + pp, m))]


def check_schedule(schedule, pp: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> str:
    """The schedule to run (filling in the default); ValueError naming the numbers when it cannot run.

    Forward-only runs take any number of micro-batches."""
    if schedule is None:
        schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if pp == 1 and vpp > 1:
        raise ValueError(f"{vpp} model chunks need a pipeline of more than one stage, got pp={pp}")
    chunks = {"1f1b": 1, "zero-bubble-h1": 1, "zbv": 2}.get(schedule)
    if chunks is not None and vpp != chunks:
        raise ValueError(f"the {schedule} schedule runs {chunks} model chunk(s) per pipeline rank, got {vpp}")
    if schedule == "interleaved-1f1b":
        if vpp == 1:
            raise ValueError("the interleaved-1f1b schedule needs more than one model chunk per rank, got 1")
        if num_microbatches % pp and not forward_only:
            raise ValueError(f"the interleaved schedule needs num_microbatches divisible by pp: "
                             f"{num_microbatches} micro-batches, pp={pp}")
    return schedule
