"""A scoring server: a reward, teacher (or any scoring) model held by one rank and served to all the others.

Requests travel over tensor collectives.

Only the owner rank builds the model.  A request is one round trip on a
dedicated group of the job's backend (NCCL on GPUs, gloo on CPU), so it never
interleaves with training collectives:

1. every rank all-gathers its input shape ``(rows, cols)`` (and whether its
   input is valid), so all agree on the padded size before any payload moves;
2. the inputs ``ids``/``mask`` ``[rows, cols]`` are padded to the largest
   shape and gathered to the owner;
3. the owner cuts each rank's true rows and columns out, right-pads them to
   one batch and runs ``model_fn`` once;
4. the owner broadcasts a small header (ok or failed, model version, output
   dtypes and shapes), then scatters each rank's padded results; every rank
   slices its true size out.

Send and receive buffers are allocated once and grow only when a request is
larger; results handed to the caller are compact copies, so a prefetched
request never overwrites them.  An exception in the owner's ``model_fn``
travels in the header and is raised on every rank as the same RuntimeError.
Requests run in issue order on one background thread per rank (on GPU inside a
side CUDA stream), so a rank can train on batch ``i`` while batch ``i+1`` is
served (:class:`Prefetcher`).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megalite import topology

logger = logging.getLogger(__name__)

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_OUTPUTS, _MAX_TAIL = 4, 3
_SLOT = 3 + _MAX_TAIL  # per output: dtype, per-token (0/1), ndim of the tail, tail dims
_HEADER = 3 + _MAX_OUTPUTS * _SLOT  # failed, version, message bytes, then the outputs


@dataclass
class Served:
    """One rank's results and the version of the served model that produced them."""

    outputs: tuple
    version: int


class ScoringServer:
    """Serve ``model_fn`` from global rank ``owner`` to every rank of the default group.

    ``model_fn(ids, mask)`` takes one batch ``[N, S]`` (every rank's rows, right-padded
    to ``S`` with mask 0) and returns a tensor or a tuple of tensors whose first dims
    are ``[N, S]`` (per-token) or ``[N]`` (per-row); ``per_token`` says which, for all
    outputs or one bool per output (owner only; the others learn it from the header).  Each rank receives its own rows
    (and columns) as a tuple.  ``model_fn`` is only needed, and only called, on the
    owner.  ``replicated=True`` is the fallback where every rank holds its own copy
    (every rank passes ``model_fn``; no communication, same numbers).  The owner sets
    :attr:`version` when it changes the served model; results carry the version
    that produced them.  Construction is collective unless replicated.
    """

    def __init__(self, model_fn: Callable | None, owner: int = 0, per_token: bool | tuple[bool, ...] = True,
                 replicated: bool = False, device: torch.device | str | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not 0 <= owner < world:
            raise ValueError(f"scoring server owner rank {owner} is outside the world of {world} ranks")
        self.owner, self.world, self.per_token, self.replicated = owner, world, per_token, replicated
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        serves = replicated or self.rank == owner
        if serves and model_fn is None:
            who = "every rank holds a replicated" if replicated else f"rank {owner} owns the served"
            raise ValueError(f"{who} model but got model_fn=None")
        self.model_fn = model_fn if serves else None
        self.version = 0
        self.bytes_sent = self.bytes_received = 0
        self.intervals: list[tuple[float, float]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self.device = torch.device(device) if device is not None else topology.device()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.group = None if replicated else dist.new_group(backend=dist.get_backend())
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring-server")

    def submit(self, ids: torch.Tensor, mask: torch.Tensor) -> Future:
        """Issue a request with this rank's ``ids``/``mask`` ``[rows, cols]``; the future gives a :class:`Served`."""
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record()
        return self._worker.submit(self._serve, ids, mask, event)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """Blocking request; this rank's outputs."""
        return self.submit(ids, mask).result().outputs

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat reusable buffer of at least ``numel`` elements (reallocated only to grow)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel]

    def _serve(self, ids, mask, event) -> Served:
        if self._stream is None:
            return self._round_trip(ids, mask)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            served = self._round_trip(ids, mask)
        self._stream.synchronize()
        return served

    def _round_trip(self, ids: torch.Tensor, mask: torch.Tensor) -> Served:
        problem = _check_inputs(ids, mask)
        if self.replicated:
            if problem:
                raise ValueError(problem)
            return Served(self._run([ids.to(self.device)], [mask.to(self.device)])[0], self.version)
        shapes = self._buffer("shapes", 3 * self.world, torch.int64).view(self.world, 3)
        mine = torch.tensor([ids.shape[0], ids.shape[-1], int(problem is not None)] if ids.dim() == 2 else
                            [0, 0, 1], dtype=torch.int64, device=self.device)
        dist.all_gather(list(shapes.unbind(0)), mine, group=self.group)
        shape_list = shapes.tolist()
        bad = [r for r, (_, _, flag) in enumerate(shape_list) if flag]
        if bad:
            raise ValueError(f"scoring server request: invalid inputs on rank(s) {bad}"
                             + (f" (this rank: {problem})" if problem else ""))
        rows, cols = max(s[0] for s in shape_list), max(s[1] for s in shape_list)
        padded = self._buffer("send_inputs", 2 * rows * cols, torch.int64).view(2, rows, cols)
        padded.zero_()
        padded[0, :ids.shape[0], :ids.shape[1]] = ids
        padded[1, :ids.shape[0], :ids.shape[1]] = mask
        gathered = None
        if self.rank == self.owner:
            gathered = list(self._buffer("recv_inputs", self.world * 2 * rows * cols, torch.int64)
                            .view(self.world, 2, rows, cols).unbind(0))
        dist.gather(padded, gathered, dst=self.owner, group=self.group)
        self.bytes_sent += 0 if self.rank == self.owner else padded.numel() * 8
        if self.rank == self.owner:
            self.bytes_received += (self.world - 1) * padded.numel() * 8
        return self._results(shape_list, rows, cols, gathered)

    def _run(self, ids_list: list, mask_list: list) -> list[tuple]:
        """The owner's one forward over every rank's rows; each rank's result tuple."""
        cols = max(ids.shape[1] for ids in ids_list)
        batch_ids = torch.cat([torch.nn.functional.pad(ids, (0, cols - ids.shape[1])) for ids in ids_list])
        batch_mask = torch.cat([torch.nn.functional.pad(m, (0, cols - m.shape[1])) for m in mask_list])
        start = time.monotonic()
        with torch.no_grad():
            outputs = self.model_fn(batch_ids, batch_mask)
        self.intervals.append((start, time.monotonic()))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        flags = self._per_token_flags(len(outputs))
        for out, per_token in zip(outputs, flags):
            expected = (batch_ids.shape[0], cols) if per_token else (batch_ids.shape[0],)
            if not isinstance(out, torch.Tensor) or tuple(out.shape[:len(expected)]) != expected:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"scoring server_fn must return tensors of leading shape {expected}, got {got}")
        per_rank, start_row = [], 0
        for ids in ids_list:
            rows = slice(start_row, start_row + ids.shape[0])
            per_rank.append(tuple((o[rows, :ids.shape[1]] if per_token else o[rows]).contiguous()
                                  for o, per_token in zip(outputs, flags)))
            start_row += ids.shape[0]
        return per_rank

    def _per_token_flags(self, count: int) -> tuple:
        flags = self.per_token if isinstance(self.per_token, tuple) else (self.per_token,) * count
        if len(flags) != count:
            raise ValueError(f"scoring server_fn returned {count} outputs for {len(flags)} per_token flags")
        return flags

    def _results(self, shapes: list, rows: int, cols: int, gathered) -> Served:
        header = self._buffer("header", _HEADER, torch.int64)
        header.zero_()
        outputs = message = None
        if self.rank == self.owner:
            try:
                ids_list = [g[0, :r, :c] for g, (r, c, _) in zip(gathered, shapes)]
                mask_list = [g[1, :r, :c] for g, (r, c, _) in zip(gathered, shapes)]
                outputs = self._run(ids_list, mask_list)
                _describe(header, outputs[0], self.version, self._per_token_flags(len(outputs[0])))
            except Exception as error:  # noqa: BLE001 - every failure of the owner's model goes to every rank
                message = "".join(traceback.format_exception_only(type(error), error)).strip().encode()
                header[0], header[2] = 1, len(message)
        dist.broadcast(header, src=self.owner, group=self.group)
        if int(header[0]):
            text = self._buffer("message", int(header[2]), torch.uint8)
            if self.rank == self.owner:
                text.copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
            dist.broadcast(text, src=self.owner, group=self.group)
            raise RuntimeError(f"scoring server on rank {self.owner} failed: {bytes(text.cpu().tolist()).decode()}")
        version, results = int(header[1]), []
        my_rows, my_cols = shapes[self.rank][0], shapes[self.rank][1]
        for index, (dtype, per_token, tail) in enumerate(_outputs(header)):
            shape = ((rows, cols) if per_token else (rows,)) + tail
            numel = int(torch.Size(shape).numel())
            recv = self._buffer(f"recv_out{index}", numel, dtype).view(shape)
            chunks = None
            if self.rank == self.owner:
                send = self._buffer(f"send_out{index}", self.world * numel, dtype).view((self.world,) + shape)
                send.zero_()
                for r, out in enumerate(outputs):
                    part = out[index]
                    target = send[r, :part.shape[0], :part.shape[1]] if per_token else send[r, :part.shape[0]]
                    target.copy_(part)
                chunks = list(send.unbind(0))
                self.bytes_sent += (self.world - 1) * numel * recv.element_size()
            else:
                self.bytes_received += numel * recv.element_size()
            dist.scatter(recv, chunks, src=self.owner, group=self.group)
            mine = recv[:my_rows, :my_cols] if per_token else recv[:my_rows]
            results.append(mine.clone())
        return Served(tuple(results), version)

    def close(self) -> None:
        """Wait for outstanding requests and stop the worker thread."""
        self._worker.shutdown(wait=True)


def _check_inputs(ids, mask) -> str | None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return f"ids must be an integer tensor [rows, cols], got {getattr(ids, 'shape', type(ids).__name__)}"
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        return f"mask must have the ids' shape {tuple(ids.shape)}, got {getattr(mask, 'shape', type(mask).__name__)}"
    return None


def _describe(header: torch.Tensor, outputs: tuple, version: int, per_token: tuple) -> None:
    """Fill the header with the owner's version and one rank's output dtypes and per-row tail shapes."""
    if len(outputs) > _MAX_OUTPUTS:
        raise ValueError(f"scoring server_fn returned {len(outputs)} tensors; at most {_MAX_OUTPUTS}")
    header[1] = version
    for i, (out, flag) in enumerate(zip(outputs, per_token)):
        tail = tuple(out.shape[2 if flag else 1:])
        if out.dtype not in _DTYPES or len(tail) > _MAX_TAIL:
            raise ValueError(f"scoring server output {i} has dtype {out.dtype} and {out.dim()} dims; "
                             f"supported: {_DTYPES}, at most {_MAX_TAIL} dims after the leading ones")
        base = 3 + i * _SLOT
        header[base], header[base + 1], header[base + 2] = _DTYPES.index(out.dtype) + 1, int(flag), len(tail)
        for j, size in enumerate(tail):
            header[base + 3 + j] = size


def _outputs(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple]]:
    values, described = header.tolist(), []
    for i in range(_MAX_OUTPUTS):
        base = 3 + i * _SLOT
        if values[base] == 0:
            break
        described.append((_DTYPES[values[base] - 1], bool(values[base + 1]),
                          tuple(values[base + 3:base + 3 + values[base + 2]])))
    return described


class Prefetcher:
    """Iterate ``(batch, outputs)`` with up to ``depth`` later batches' requests already in flight.

    ``depth=1`` is double buffering: before batch ``i`` is handed out, batch
    ``i+1`` has been drawn from ``batches`` and its request issued, so the
    scoring server works on it while the caller trains on batch ``i``.
    ``depth=0`` waits for each request right after issuing it.
    ``inputs_of(batch)`` gives the ``(ids, mask)`` sent.  ``current_version()``
    is the caller's version of the served model when a result is used (default:
    the served model is frozen); :attr:`staleness` records, per batch, how many
    versions older the result is, and each is logged.  ``pending`` (default: a
    fresh deque) holds the ``(batch, future)`` pairs issued and not yet handed
    out, for a checkpoint to read; a resume may fill it with finished futures.
    """

    def __init__(self, model: ScoringServer, batches: Iterable, depth: int = 1,
                 inputs_of: Callable | None = None, current_version: Callable[[], int] | None = None,
                 pending: deque | None = None):
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be a non-negative integer, got {depth!r}")
        self.model, self.batches, self.depth = model, iter(batches), depth
        self.inputs_of = inputs_of or (lambda batch: batch)
        self.current_version = current_version
        self.staleness: list[int] = []
        self.pending = deque() if pending is None else pending

    def __iter__(self) -> Iterator:
        pending = self.pending
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.depth + 1:
                try:
                    batch = next(self.batches)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((batch, self.model.submit(*self.inputs_of(batch))))
            if not pending:
                return
            batch, future = pending.popleft()
            served = future.result()
            now = served.version if self.current_version is None else self.current_version()
            self.staleness.append(now - served.version)
            logger.info("served result of model version %d used at version %d (staleness %d)",
                        served.version, now, now - served.version)
            yield batch, served.outputs
