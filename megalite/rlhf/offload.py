"""Parking tensors in a host-memory pool between the phases that use them, with asynchronous copies.

An :class:`Offloader` manages a set of named tensors: a frozen model's parameters and buffers, or a
trained model's optimizer state.  ``offload()`` moves them into the pool (host tensors, pinned when CUDA
is available, each allocated once and reused) and frees their device memory; ``load()`` copies them back
to freshly allocated device tensors.  The tensor objects themselves stay (their ``.data`` is swapped), so
modules and optimizers keep their references.  While parked, a tensor's data *is* its pool tensor.

On a GPU the copies run on a side CUDA stream with ``non_blocking=True``: ``load()`` returns at once and
orders the compute stream after the copies; ``offload()`` returns at once too (``synchronize()`` waits for
the copies, e.g. before the host reads the pool or before memory is measured).  A device tensor that an
offload copy still reads is kept until ``synchronize()`` or the next ``load()`` (which orders the compute
stream after the copies), so its memory is back in the allocator's free count as soon as that returns.
On CPU the "device" is the CPU and the pool is a separate set of tensors, so an offload is still a real
move: the working copy is freed.

``writeback=False`` is for tensors that do not change on the device (frozen models): after the first
offload the pool already holds their values, so later offloads only free the device copy.  ``pool`` may
hand in host tensors to use as the pool (e.g. a :class:`~megalite.rlhf.target.PolyakTarget`'s master copy,
which is updated on the host and read by every ``load()``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

import torch


class Offloader:
    """Moves the tensors returned by ``tensors()`` (a fresh ``{name: tensor}`` each call) between ``device``
    and a host pool.  Tensors that are already parked or not on ``device`` are left alone."""

    def __init__(self, tensors: Callable[[], dict[str, torch.Tensor]], device, writeback: bool,
                 pool: dict[str, torch.Tensor] | None = None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.tensors, self.device, self.writeback = tensors, device, writeback
        self.pool: dict[str, torch.Tensor] = dict(pool or {})
        self._dtypes: dict[str, torch.dtype] = {}
        self._pin = torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._reading: list[torch.Tensor] = []  # device tensors the copy stream still reads
        self.parked = False

    def _on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device and tensor.numel() > 0

    def _is_parked(self, name: str, tensor: torch.Tensor) -> bool:
        host = self.pool.get(name)
        return host is not None and tensor.data_ptr() == host.data_ptr()

    def _copying(self):
        """The copy stream's context (nothing on CPU)."""
        return nullcontext() if self._stream is None else torch.cuda.stream(self._stream)

    def _wait_for_compute(self) -> None:
        """Copies start after the work queued so far on the compute stream (which wrote or allocated them)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    @torch.no_grad()
    def offload(self) -> None:
        """Move every managed device tensor into the pool (asynchronously on GPU) and free its device memory."""
        self._wait_for_compute()
        for name, tensor in self.tensors().items():
            if self._is_parked(name, tensor) or not self._on_device(tensor):
                continue
            self._dtypes.setdefault(name, tensor.dtype)
            host = self.pool.get(name)
            if host is None or self.writeback:
                if host is None:
                    host = self.pool[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
                with self._copying():
                    host.copy_(tensor, non_blocking=True)
                if self._stream is not None:
                    self._reading.append(tensor.data)
            tensor.data = host
        self.parked = True

    @torch.no_grad()
    def load(self) -> None:
        """Copy every parked tensor into a new device tensor (of its original dtype); compute queued
        afterwards sees the values."""
        self._wait_for_compute()
        for name, tensor in self.tensors().items():
            if not self._is_parked(name, tensor):
                continue
            host = self.pool[name]
            working = torch.empty(host.shape, dtype=self._dtypes.get(name, host.dtype), device=self.device)
            with self._copying():
                working.copy_(host, non_blocking=True)
            tensor.data = working
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._reading.clear()
        self.parked = False

    def synchronize(self) -> None:
        """Wait (on the host) until every copy issued so far has finished."""
        if self._stream is not None:
            self._stream.synchronize()
        self._reading.clear()

    @contextmanager
    def on_device(self):
        """Loaded inside the block, parked again afterwards."""
        self.load()
        try:
            yield
        finally:
            self.offload()

    def pool_tensors(self) -> list[torch.Tensor]:
        return list(self.pool.values())


def module_tensors(module: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    """A module's parameters and buffers by name, for :class:`Offloader`."""
    def tensors():
        return {**dict(module.named_parameters()), **{f"buffer:{n}": b for n, b in module.named_buffers()}}
    return tensors


def optimizer_tensors(optimizer) -> Callable[[], dict[str, torch.Tensor]]:
    """A :class:`~megalite.optim.MixedPrecisionOptimizer`'s own state by name: the Adam moments (and step
    counts) and, where they are separate from the model parameters (bf16/fp16), the fp32 main copies and
    their gradients."""
    def tensors():
        found = {}
        for index, shard in enumerate(optimizer.shards):
            for key, value in optimizer.optimizer.state.get(shard.main, {}).items():
                if isinstance(value, torch.Tensor):
                    found[f"{index}.{key}"] = value
            if shard.main is not shard.values:
                found[f"{index}.main"] = shard.main
                if shard.main.grad is not None and shard.main.grad is not shard.grad_src:
                    found[f"{index}.main_grad"] = shard.main.grad
        return found
    return tensors
