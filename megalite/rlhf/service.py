"""Training as a service: worker ranks run a :class:`TrainingBackend` among themselves; a driver awaits calls.

    training = await TrainingService.options(procs=4, backend="local").as_service(
        model=GPTConfig(...), optimizer=OptimizerConfig(...), loss_fn="language_model",
        parallel=ParallelLayout(tp=2, dp=2, micro_batch_size=2), checkpoint_dir=path)
    metrics = await training.forward_backward(batch)     # the global batch, split over DP by the workers
    await training.optim_step()

The driver starts ``procs`` workers through a transport (``backend="local"``: processes on this machine;
``backend="ray"``: Ray actors), hosts the TCPStore where they join one torch.distributed job (gloo on CPU,
NCCL with ``with_gpus``), and each builds the model, DDP, optimizer and objective from serializable
dataclasses; the loss is named (``"language_model"``, ``"ppo_actor"``, ``"ppo_critic"``) or given as
``"module:attribute"`` (a zero-argument objective factory), so messages carry only data.  Every call is sent to
every worker at once and returns an asyncio future, so calls pipeline.  A reader thread resolves futures and
watches the workers: one that dies, or a call unanswered past ``timeout``, fails every pending and later call
with an error naming the worker and its last message.  Weights and checkpoints use megalite's resharding
format, so another layout loads them; they pass through ``checkpoint_dir``, which the driver and every worker
must see (a shared filesystem when Ray spreads the workers over machines).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import os
import shutil
import tempfile
import threading
import time

import torch

from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig
from megalite.rlhf.service_config import ParallelLayout, Rendezvous, ServiceSpec, resolve_objective
from megalite.rlhf.service_transport import Transport

STARTUP_SECONDS = 300.0  # the first call (workers import torch and build the model) waits at least this long
BACKENDS = ("local", "ray")


def _transport(backend: str, spec: ServiceSpec, procs: int) -> Transport:
    if backend == "local":
        from megalite.rlhf.service_local import LocalTransport

        return LocalTransport(spec, procs)
    try:
        from megalite.rlhf.service_ray import RayTransport
    except ImportError as error:
        raise ImportError(f"TrainingService backend='ray' needs Ray ({error}); pip install 'megalite[ray]'") from None
    return RayTransport(spec, procs)


class _Options:
    def __init__(self, procs: int, with_gpus: bool, backend: str, timeout: float):
        if backend not in BACKENDS:
            raise ValueError(f"TrainingService backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(procs, int) or procs < 1:
            raise ValueError(f"procs must be a positive integer, got {procs!r}")
        if backend == "local" and with_gpus and torch.cuda.device_count() < procs:
            raise ValueError(f"with_gpus needs {procs} GPUs, this machine has {torch.cuda.device_count()}")
        self.procs, self.with_gpus, self.backend, self.timeout = procs, with_gpus, backend, timeout

    async def as_service(self, model: GPTConfig, optimizer: OptimizerConfig, loss_fn: str,
                         parallel: ParallelLayout, checkpoint_dir: str, seed: int = 1234) -> "TrainingService":
        """Start the workers and wait until every one has built its model."""
        if parallel.world_size != self.procs:
            raise ValueError(f"procs={self.procs} does not match the layout tp={parallel.tp} x pp={parallel.pp} x "
                             f"dp={parallel.dp} = {parallel.world_size} processes")
        resolve_objective(loss_fn)
        spec = ServiceSpec(model, optimizer, loss_fn, parallel, checkpoint_dir, seed, self.with_gpus)
        transport = _transport(self.backend, spec, self.procs)
        try:
            service = TrainingService(spec, transport, self.procs, self.timeout, asyncio.get_running_loop())
        except BaseException:
            transport.kill()
            transport.close()
            raise
        try:
            await service._call("ready", service._rendezvous, deadline=max(self.timeout, STARTUP_SECONDS))
        except BaseException:
            await service.shutdown()
            raise
        return service


class TrainingService:
    """The driver's handle on the workers; build it with ``await TrainingService.options(...).as_service(...)``."""

    @staticmethod
    def options(procs: int, with_gpus: bool = False, backend: str = "local", timeout: float = 300.0) -> _Options:
        return _Options(procs, with_gpus, backend, timeout)

    def __init__(self, spec: ServiceSpec, transport: Transport, procs: int, timeout: float,
                 loop: asyncio.AbstractEventLoop):
        import torch.distributed as dist

        self.spec, self.procs, self.timeout, self._loop, self._transport = spec, procs, timeout, loop, transport
        # The driver hosts the rendezvous, so it lives as long as the service and its port is never raced for.
        self._store = dist.TCPStore(transport.host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STARTUP_SECONDS))
        self._rendezvous = Rendezvous(transport.host, self._store.port, procs)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, str, float, float, dict]] = {}
        self._last = ["none"] * procs
        self._finished: set[int] = set()  # ranks that answered shutdown, so may be gone
        self._last_reply = 0.0
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        os.makedirs(spec.checkpoint_dir, exist_ok=True)
        self._tmp = tempfile.mkdtemp(prefix=".service-", dir=spec.checkpoint_dir)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # --- the API -------------------------------------------------------------------------------------
    def forward_backward(self, batch: dict) -> asyncio.Future:
        """Accumulate the gradient of the global ``batch`` (dict of ``[B, ...]`` tensors); its metrics."""
        self._check_batch(batch)
        return self._call("forward_backward", {k: v.detach().cpu() for k, v in batch.items()})

    def optim_step(self) -> asyncio.Future:
        return self._call("optim_step", None)

    def get_weights(self) -> asyncio.Future:
        """Every model tensor in the global (tp = pp = 1) layout, by checkpoint name."""
        return self._call("get_weights", os.path.join(self._tmp, f"weights_{next(self._ids)}"))

    def load_weights(self, weights: dict) -> asyncio.Future:
        """Load global model tensors (as :meth:`get_weights` returns them) into every worker."""
        from megalite.checkpoint import save_global_checkpoint

        path = os.path.join(self._tmp, f"load_{next(self._ids)}")
        save_global_checkpoint(path, self.spec.model, weights)
        return self._call("load_weights", path)

    def save(self, step: int) -> asyncio.Future:
        """Model and optimizer at ``checkpoint_dir/iter_<step>``; the future gives that path."""
        return self._call("save", int(step))

    def load(self, path: str) -> asyncio.Future:
        """Model and optimizer from a megalite checkpoint saved under any layout."""
        return self._call("load", path)

    async def shutdown(self) -> None:
        """Stop the workers (pending calls finish first) and wait until no worker is left."""
        if self._closed:
            return
        try:
            if self._failure is None:
                await self._call("shutdown", None)
        finally:
            self._closed = True
            with self._lock:
                abandoned, self._pending = list(self._pending.values()), {}
            if abandoned:  # the shutdown itself was cancelled
                self._transport.kill()
            for future, method, *_ in abandoned:
                self._settle(future, RuntimeError(f"TrainingService shut down before {method} finished"))
            self._reader.join()
            self._transport.close()
            self._store = None  # closes the rendezvous port
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        """Each worker's process id."""
        return self._transport.pids

    # --- plumbing ------------------------------------------------------------------------------------
    def _check_batch(self, batch: dict) -> None:
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ValueError("forward_backward needs a dict batch with 'input_ids' [B, s]")
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise ValueError(f"batch['input_ids'] must be [B, s], got shape {tuple(ids.shape)}")
        rows, layout = ids.shape[0], self.spec.parallel
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != rows:
                raise ValueError(f"batch[{key!r}] has shape {tuple(getattr(value, 'shape', ()))}; every entry "
                                 f"needs the {rows} rows of input_ids")
        if rows % (layout.dp * layout.micro_batch_size):
            raise ValueError(f"batch of {rows} sequences is not divisible by dp={layout.dp} x "
                             f"micro_batch_size={layout.micro_batch_size}")

    def _call(self, method: str, payload, deadline: float | None = None) -> asyncio.Future:
        if self._closed:
            raise RuntimeError(f"TrainingService.{method} called after shutdown")
        future = self._loop.create_future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(RuntimeError(self._failure))
                return future
            call_id = next(self._ids)
            self._pending[call_id] = (future, method, time.monotonic(), deadline or self.timeout, {})
        self._transport.send(call_id, method, payload)
        return future

    def _read(self) -> None:
        while not self._closed or self._pending:
            for reply in self._transport.receive(0.2):
                self._take(*reply)
            self._watch()
            if self._failure is not None and not self._pending:
                return

    def _take(self, call_id: int, rank: int, ok: bool, value) -> None:
        """Record one worker's reply; settle the call once every worker answered it."""
        with self._lock:
            entry = self._pending.get(call_id)
            if entry is None:
                return
            future, method, _, _, replies = entry
            self._last[rank] = f"{method} #{call_id} ({'ok' if ok else 'failed'})"
            self._last_reply = time.monotonic()
            if method == "shutdown" and ok:
                self._finished.add(rank)
            replies[rank] = (ok, value)
            if len(replies) < self.procs:
                return
            del self._pending[call_id]
        errors = [f"worker {r}: {v}" for r, (good, v) in sorted(replies.items()) if not good]
        if errors:
            self._settle(future, RuntimeError(f"{method} failed on " + "; ".join(errors)))
        else:
            self._settle(future, None, self._result(method, replies[0][1]))

    def _result(self, method: str, value):
        if method == "get_weights":
            from megalite.checkpoint import read_global_tensors

            return read_global_tensors(value)[1]
        return value

    def _watch(self) -> None:
        """Fail everything when a worker died or a call is overdue."""
        if self._failure is not None or self._closed:
            return
        now, problem = time.monotonic(), None
        for rank, what in self._transport.casualties():
            if rank not in self._finished:
                problem = f"training worker {rank} {what}; its last message: {self._last[rank]}"
                break
        with self._lock:
            for call_id, (_, method, start, allowed, replies) in self._pending.items():
                # A queued call's clock starts when it was issued or when the workers last answered.
                if problem is None and now - max(start, self._last_reply) > allowed:
                    missing = [r for r in range(self.procs) if r not in replies]
                    problem = (f"training worker {missing[0]} did not answer {method} #{call_id} within "
                               f"{allowed:.0f} s; its last message: {self._last[missing[0]]}")
            if problem is None:
                return
            self._failure = problem
            pending, self._pending = list(self._pending.values()), {}
        self._transport.kill()
        for future, *_ in pending:
            self._settle(future, RuntimeError(problem))

    def _settle(self, future: asyncio.Future, error: Exception | None, value=None) -> None:
        def apply():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        self._loop.call_soon_threadsafe(apply)
