"""Training as a service: worker ranks run a :class:`TrainingBackend` among themselves; a driver awaits calls.

    training = await TrainingService.options(procs=4, backend="local").as_service(
        model=GPTConfig(...), optimizer=OptimizerConfig(...), loss_fn="language_model",
        parallel=ParallelLayout(tp=2, dp=2, micro_batch_size=2), checkpoint_dir=path)
    metrics = await training.forward_backward(batch)     # the global batch, split over DP by the workers
    await training.optim_step()

The driver starts ``procs`` workers through a transport (``backend="local"``: processes on this machine;
``backend="ray"``: Ray actors), hosts the TCPStore where they join one torch.distributed job (gloo on CPU,
NCCL with ``with_gpus``), and each builds the model, DDP, optimizer and objective from serializable
dataclasses (or, with ``strategy="fsdp2"`` or ``"ddp"``, your own ``nn.Module`` from a picklable factory,
sharded or replicated over the workers: :mod:`megalite.rlhf.service_module`); the loss is named
(``"language_model"``, ``"ppo_actor"``, ``"ppo_critic"``) or given as ``"module:attribute"`` (a zero-argument
objective factory), so messages carry only data.  Every call is sent to
every worker at once and returns an asyncio future, so calls pipeline.  A reader thread resolves futures and
watches the workers: one that dies, or a call unanswered past ``timeout``, fails every pending and later call
with an error naming the worker and its last message.  Each worker also beats a heartbeat into the store, so
an overdue call blames the worker that went silent (stopped, frozen), not one waiting for it in a collective;
and when one worker's call fails while the others have not answered within :data:`PEER_FAILURE_SECONDS` (they
wait for it in a collective), that worker's own error fails the call at once and the service stops.  Batches
are checked (shapes, token ids inside the model's vocabulary) before they are sent.  Weights and checkpoints
use megalite's resharding format, so another layout loads them; they pass through ``checkpoint_dir``, which the
driver and every worker must see (a shared filesystem when Ray spreads the workers over machines).

Like pretraining's ``--save`` (:mod:`megalite.training.save_dir`), ``checkpoint_dir`` is locked by one service
at a time, and the first ``save`` refuses to write over checkpoints the service did not ``load`` unless
``override_existing_checkpoints``.  The trainer's NaN guard (``nan_guard``, :mod:`megalite.training.nan_guard`)
keeps non-finite values out of the weights and the checkpoints.  The local workers die with the driver.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import operator
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig
from megalite.rlhf.service_config import (ParallelLayout, Rendezvous, ServiceSpec, check_batch, check_model,
                                           resolve_objective)
from megalite.rlhf.service_transport import Transport
from megalite.training.nan_guard import NanGuardConfig
from megalite.training.save_dir import DirNames, SaveDirLock, check_not_overwriting

STARTUP_SECONDS = 300.0  # the first call (workers import torch and build the model) waits at least this long
PEER_FAILURE_SECONDS = 10.0  # how long the other workers may take to answer a call that failed on one worker
SILENT_SECONDS = 2.0  # a worker without a heartbeat for this long is stopped or frozen
BACKENDS = ("local", "ray")
NAMES = DirNames(save="checkpoint_dir", load="load()", override="override_existing_checkpoints=True")


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

    async def as_service(self, model: GPTConfig | Callable, optimizer: OptimizerConfig | Callable, loss_fn: str,
                         parallel: ParallelLayout, checkpoint_dir: str, seed: int = 1234,
                         nan_guard: NanGuardConfig | None = None, override_existing_checkpoints: bool = False,
                         strategy: str = "megalite") -> "TrainingService":
        """Lock ``checkpoint_dir``, start the workers and wait until every one has built its model.

        ``strategy="megalite"``: ``model`` is a ``GPTConfig`` (TP/PP/DP).  ``"fsdp2"`` / ``"ddp"``: ``model`` is a
        zero-argument factory of your own ``nn.Module``, sharded (FSDP2) or replicated (DDP) over the ``dp``
        workers, and ``optimizer`` an ``OptimizerConfig`` or a factory ``params -> torch.optim.Optimizer``
        (:mod:`megalite.rlhf.service_module`).  ``nan_guard``: the trainer's guard settings (default: stop with an
        error before a non-finite update).
        """
        check_model(strategy, model, optimizer, parallel, pickled=self.backend == "local")
        if parallel.world_size != self.procs:
            raise ValueError(f"procs={self.procs} does not match the layout tp={parallel.tp} x pp={parallel.pp} x "
                             f"dp={parallel.dp} = {parallel.world_size} processes")
        resolve_objective(loss_fn)
        nan_guard = nan_guard or NanGuardConfig()
        nan_guard.validate()
        spec = ServiceSpec(model, optimizer, loss_fn, parallel, checkpoint_dir, seed, self.with_gpus, nan_guard,
                           strategy)
        os.makedirs(checkpoint_dir, exist_ok=True)
        lock = SaveDirLock(checkpoint_dir, NAMES)
        try:
            transport = _transport(self.backend, spec, self.procs)
        except BaseException:
            lock.release()
            raise
        try:
            service = TrainingService(spec, transport, self.procs, self.timeout, asyncio.get_running_loop(), lock,
                                      override_existing_checkpoints)
        except BaseException:
            lock.release()
            transport.kill()
            transport.close()
            raise
        try:
            service._shapes = await service._call("ready", service._rendezvous,
                                                  deadline=max(self.timeout, STARTUP_SECONDS))
        except BaseException:
            await service.shutdown()
            raise
        return service


@dataclass
class _Call:
    """A call in flight: its future, when it was issued, how long it may take, the replies so far."""

    future: asyncio.Future
    method: str
    start: float
    allowed: float
    replies: dict = field(default_factory=dict)  # rank -> (ok, result or error text)
    failed_at: float | None = None  # when the first worker reported an error


class TrainingService:
    """The driver's handle on the workers; build it with ``await TrainingService.options(...).as_service(...)``."""

    @staticmethod
    def options(procs: int, with_gpus: bool = False, backend: str = "local", timeout: float = 300.0) -> _Options:
        return _Options(procs, with_gpus, backend, timeout)

    def __init__(self, spec: ServiceSpec, transport: Transport, procs: int, timeout: float,
                 loop: asyncio.AbstractEventLoop, lock: SaveDirLock, override_existing_checkpoints: bool = False):
        import torch.distributed as dist

        self.spec, self.procs, self.timeout, self._loop, self._transport = spec, procs, timeout, loop, transport
        self._dir_lock, self._override = lock, override_existing_checkpoints
        self._loaded: tuple[str, int] | None = None  # (save directory, iteration) of the last load()
        self._shapes: dict | None = None  # a user's model: its tensors' global shapes (from the workers)
        self._may_write = False  # checkpoint_dir passed the overwrite check
        # The driver hosts the rendezvous, so it lives as long as the service and its port is never raced for.
        # It listens only on the address it advertises (TCPStore alone would listen on every interface).
        family = socket.getaddrinfo(transport.host, 0, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((transport.host, 0), family=family)
        port = listener.getsockname()[1]
        # The store owns the socket from here on and closes it when it is dropped.
        self._store = dist.TCPStore(transport.host, port, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STARTUP_SECONDS),
                                    master_listen_fd=listener.detach())
        self._rendezvous = Rendezvous(transport.host, self._store.port, procs)
        self._ids = itertools.count()
        self._pending: dict[int, _Call] = {}
        self._heard = [(0, time.monotonic())] * procs  # each worker's heartbeat count, and when it last changed
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
        """Accumulate the gradient of the global ``batch`` (dict of ``[B, ...]`` tensors); its metrics.

        The call sends a copy: the transport moves what it sends into shared memory from a background
        thread, which must not touch the caller's tensors (another call may be reading them meanwhile)."""
        check_batch(self.spec, batch)
        return self._call("forward_backward", {k: v.detach().to("cpu", copy=True) for k, v in batch.items()})

    def optim_step(self) -> asyncio.Future:
        return self._call("optim_step", None)

    def get_weights(self) -> asyncio.Future:
        """Every model tensor in the global (tp = pp = 1) layout, by checkpoint name."""
        return self._call("get_weights", os.path.join(self._tmp, f"weights_{next(self._ids)}"))

    def load_weights(self, weights: dict) -> asyncio.Future:
        """Load global model tensors (as :meth:`get_weights` returns them) into every worker."""
        from megalite.checkpoint import save_global_checkpoint

        path = os.path.join(self._tmp, f"load_{next(self._ids)}")
        if self.spec.user_model:
            from megalite.checkpoint import TensorShard, save_global_shards

            shards = [TensorShard(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor.detach().cpu())
                      for name, tensor in sorted(weights.items())]
            save_global_shards(path, None, shards, model_shapes=self._shapes)
        else:
            save_global_checkpoint(path, self.spec.model, weights)
        return self._call("load_weights", path)

    def save(self, step: int) -> asyncio.Future:
        """Model and optimizer at ``checkpoint_dir/iter_<step>``; the future gives that path.

        ``step`` is a non-negative integer.  The first save refuses a ``checkpoint_dir`` that holds
        checkpoints this service did not load (unless ``override_existing_checkpoints``)."""
        try:
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)
        except TypeError:
            raise ValueError(f"save step must be a non-negative integer, got {step!r}") from None
        if step < 0:
            raise ValueError(f"save step must be a non-negative integer, got {step}")
        if not self._may_write:
            loaded_dir, loaded_iteration = self._loaded or (None, 0)
            warning = check_not_overwriting(self.spec.checkpoint_dir, loaded_dir, loaded_iteration, self._override,
                                            NAMES)
            if warning:
                print(warning, file=sys.stderr, flush=True)
            self._may_write = True
        return self._call("save", step)

    def load(self, path: str) -> asyncio.Future:
        """Model and optimizer from a megalite checkpoint saved under any layout."""
        from megalite.checkpoint import read_checkpoint_info

        try:  # where it comes from, for save()'s overwrite rule; the workers may see paths the driver does not
            info = read_checkpoint_info(path)
        except (OSError, ValueError):
            info = None
        future = self._call("load", path)

        def loaded(done: asyncio.Future) -> None:
            if info is not None and not done.cancelled() and done.exception() is None:
                self._loaded = (os.path.dirname(info["directory"]), info["iteration"])
        future.add_done_callback(loaded)
        return future

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
            for call in abandoned:
                self._settle(call.future, RuntimeError(f"TrainingService shut down before {call.method} finished"))
            self._reader.join()
            self._transport.close()
            self._store = None  # closes the rendezvous port
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._dir_lock.release()

    @property
    def pids(self) -> list[int]:
        """Each worker's process id."""
        return self._transport.pids

    # --- plumbing ------------------------------------------------------------------------------------
    def _call(self, method: str, payload, deadline: float | None = None) -> asyncio.Future:
        if self._closed:
            raise RuntimeError(f"TrainingService.{method} called after shutdown")
        future = self._loop.create_future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(RuntimeError(self._failure))
                return future
            call_id = next(self._ids)
            self._pending[call_id] = _Call(future, method, time.monotonic(), deadline or self.timeout)
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
            call = self._pending.get(call_id)
            if call is None:
                return
            self._last[rank] = f"{call.method} #{call_id} ({'ok' if ok else 'failed'})"
            self._last_reply = time.monotonic()
            if call.method == "shutdown" and ok:
                self._finished.add(rank)
            call.replies[rank] = (ok, value)
            if not ok and call.failed_at is None:
                call.failed_at = self._last_reply
            if len(call.replies) < self.procs:
                return
            del self._pending[call_id]
        errors = _errors(call.replies)
        if errors:
            self._settle(call.future, RuntimeError(f"{call.method} failed on {errors}"))
        else:
            self._settle(call.future, None, self._result(call.method, call.replies[0][1]))

    def _result(self, method: str, value):
        if method == "get_weights":
            from megalite.checkpoint import read_global_tensors

            return read_global_tensors(value)[1]
        return value

    def _listen(self, now: float) -> None:
        """Note which workers' heartbeats moved."""
        for rank, (count, _) in enumerate(self._heard):
            beats = self._store.add(f"heartbeat/{rank}", 0)
            if beats != count:
                self._heard[rank] = (beats, now)

    def _watch(self) -> None:
        """Fail everything when a worker died, a call is overdue, or one worker's failure holds up the others."""
        if self._failure is not None or self._closed:
            return
        now, problem = time.monotonic(), None
        self._listen(now)
        for rank, what in self._transport.casualties():
            if rank not in self._finished:
                problem = f"training worker {rank} {what}; its last message: {self._last[rank]}"
                break
        with self._lock:
            for call_id, call in self._pending.items():
                if problem is not None:
                    break
                missing = [r for r in range(self.procs) if r not in call.replies]
                grace = min(PEER_FAILURE_SECONDS, call.allowed)
                if call.failed_at is not None and now - call.failed_at > grace:
                    problem = (f"{call.method} #{call_id} failed on {_errors(call.replies)}; {_workers(missing)} "
                               f"did not finish it within {grace:.0f} s (waiting for "
                               f"the failed worker in a collective), so the service stopped its workers")
                # A queued call's clock starts when it was issued or when the workers last answered.
                elif now - max(call.start, self._last_reply) > call.allowed:
                    silent = max(missing, key=lambda r: now - self._heard[r][1])
                    quiet = now - self._heard[silent][1]
                    why = (f" and sent no heartbeat for {quiet:.0f} s (stopped or frozen)" if quiet > SILENT_SECONDS
                           else "")
                    problem = (f"training worker {silent} did not answer {call.method} #{call_id} within "
                               f"{call.allowed:.0f} s{why}; its last message: {self._last[silent]}")
            if problem is None:
                return
            self._failure = problem
            pending, self._pending = list(self._pending.values()), {}
        self._transport.kill()
        for call in pending:
            self._settle(call.future, RuntimeError(problem))

    def _settle(self, future: asyncio.Future, error: Exception | None, value=None) -> None:
        def apply():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        self._loop.call_soon_threadsafe(apply)


def _errors(replies: dict) -> str:
    """The failed workers' errors, each text once: ``worker 1: E`` or ``workers 0, 1: E``."""
    by_text: dict[str, list[int]] = {}
    for rank, (ok, value) in sorted(replies.items()):
        if not ok:
            by_text.setdefault(str(value), []).append(rank)
    return "; ".join(f"{_workers(ranks)}: {text}" for text, ranks in by_text.items())


def _workers(ranks: list[int]) -> str:
    return f"worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
