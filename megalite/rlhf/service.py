"""Training as a service: worker processes run a :class:`TrainingBackend` among themselves; a driver awaits calls.

    training = await TrainingService.options(procs=4).as_service(
        model=GPTConfig(...), optimizer=OptimizerConfig(...), loss_fn="language_model",
        parallel=ParallelLayout(tp=2, dp=2, micro_batch_size=2), checkpoint_dir=path)
    metrics = await training.forward_backward(batch)     # the global batch, split over DP by the workers
    await training.optim_step()

The driver spawns ``procs`` workers (``backend="local"``: processes on this machine), which join one
torch.distributed job (gloo on CPU, NCCL with ``with_gpus``) and build the model, DDP, optimizer and
objective from serializable dataclasses; the loss is named (``"language_model"``, ``"ppo_actor"``,
``"ppo_critic"``) or given as ``"module:attribute"`` (a zero-argument objective factory), so messages carry
only data.  Every call is sent to every worker's queue at once and returns an asyncio future, so calls
pipeline.  A reader thread resolves futures and watches the workers: one that dies, or a call unanswered
past ``timeout``, fails every pending and later call with an error naming the worker and its last message.
Weights and checkpoints use megalite's resharding format, so another layout loads them.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import multiprocessing
import os
import queue
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig

STARTUP_SECONDS = 300.0  # the first call (workers import torch and build the model) waits at least this long
OBJECTIVES = {"language_model": "megalite.rlhf.objectives:LanguageModelObjective",
              "ppo_actor": "megalite.rlhf.objectives:PPOActorObjective",
              "ppo_critic": "megalite.rlhf.objectives:PPOCriticObjective"}


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor, pipeline and data parallel sizes of the workers (``tp * pp * dp`` processes)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a worker needs, as data: configs, the loss by name, the layout, the checkpoint directory."""

    model: GPTConfig
    optimizer: OptimizerConfig
    loss_fn: str
    parallel: ParallelLayout
    checkpoint_dir: str
    seed: int = 1234
    with_gpus: bool = False


def resolve_objective(loss_fn: str):
    """The objective for a registered name or ``"module:attribute"`` (called with no arguments)."""
    target = OBJECTIVES.get(loss_fn, loss_fn)
    module_name, sep, attribute = target.partition(":")
    if not sep:
        raise ValueError(f"loss_fn {loss_fn!r} is neither a registered name {sorted(OBJECTIVES)} "
                         f"nor 'module:attribute'")
    return getattr(importlib.import_module(module_name), attribute)()


class _Options:
    def __init__(self, procs: int, with_gpus: bool, backend: str, timeout: float):
        if backend != "local":
            raise ValueError(f"TrainingService backend must be 'local', got {backend!r}")
        if not isinstance(procs, int) or procs < 1:
            raise ValueError(f"procs must be a positive integer, got {procs!r}")
        if with_gpus and torch.cuda.device_count() < procs:
            raise ValueError(f"with_gpus needs {procs} GPUs, this machine has {torch.cuda.device_count()}")
        self.procs, self.with_gpus, self.timeout = procs, with_gpus, timeout

    async def as_service(self, model: GPTConfig, optimizer: OptimizerConfig, loss_fn: str,
                         parallel: ParallelLayout, checkpoint_dir: str, seed: int = 1234) -> "TrainingService":
        """Spawn the workers and wait until every one has built its model."""
        if parallel.world_size != self.procs:
            raise ValueError(f"procs={self.procs} does not match the layout tp={parallel.tp} x pp={parallel.pp} x "
                             f"dp={parallel.dp} = {parallel.world_size} processes")
        resolve_objective(loss_fn)
        spec = ServiceSpec(model, optimizer, loss_fn, parallel, checkpoint_dir, seed, self.with_gpus)
        service = TrainingService(spec, self.procs, self.timeout, asyncio.get_running_loop())
        await service._call("ready", None, deadline=max(self.timeout, STARTUP_SECONDS))
        return service


class TrainingService:
    """The driver's handle on the workers; build it with ``await TrainingService.options(...).as_service(...)``."""

    @staticmethod
    def options(procs: int, with_gpus: bool = False, backend: str = "local", timeout: float = 300.0) -> _Options:
        return _Options(procs, with_gpus, backend, timeout)

    def __init__(self, spec: ServiceSpec, procs: int, timeout: float, loop: asyncio.AbstractEventLoop):
        self.spec, self.procs, self.timeout, self._loop = spec, procs, timeout, loop
        ctx = multiprocessing.get_context("spawn")
        self._replies = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(procs)]
        port = _free_port()
        self._workers = [ctx.Process(target=_worker_main, args=(rank, procs, port, spec, self._inboxes[rank],
                                                                 self._replies), daemon=True)
                         for rank in range(procs)]
        for worker in self._workers:
            worker.start()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, str, float, float, dict]] = {}
        self._last = ["none"] * procs
        self._last_reply = 0.0
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._tmp = tempfile.mkdtemp(prefix="megalite-service-")
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
        """Stop the workers (pending calls finish first) and wait until no process is left."""
        if self._closed:
            return
        try:
            if self._failure is None:
                await self._call("shutdown", None)
        finally:
            self._closed = True
            for worker in self._workers:
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()
                    worker.join()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

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
        for inbox in self._inboxes:
            inbox.put((call_id, method, payload))
        return future

    def _read(self) -> None:
        while not self._closed or self._pending:
            try:
                call_id, rank, ok, value = self._replies.get(timeout=0.2)
            except queue.Empty:
                self._watch()
                if self._failure is not None and not self._pending:
                    return
                continue
            with self._lock:
                entry = self._pending.get(call_id)
                if entry is None:
                    continue
                future, method, _, _, replies = entry
                self._last[rank] = f"{method} #{call_id} ({'ok' if ok else 'failed'})"
                self._last_reply = time.monotonic()
                replies[rank] = (ok, value)
                if len(replies) < self.procs:
                    continue
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
        for rank, worker in enumerate(self._workers):
            if not worker.is_alive():
                problem = (f"training worker {rank} (pid {worker.pid}) exited with code {worker.exitcode}; "
                           f"its last message: {self._last[rank]}")
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
        for worker in self._workers:
            if worker.is_alive():
                worker.kill()
        for future, *_ in pending:
            self._settle(future, RuntimeError(problem))

    def _settle(self, future: asyncio.Future, error: Exception | None, value=None) -> None:
        def apply():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        self._loop.call_soon_threadsafe(apply)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world: int, port: int, spec: ServiceSpec, inbox, replies) -> None:
    """One worker: join the job, build the backend, answer calls in order until ``shutdown``."""
    torch.set_num_threads(1)
    state = None
    while True:
        call_id, method, payload = inbox.get()
        try:
            if method == "ready":
                state = _WorkerState(rank, world, port, spec)
                value = True
            else:
                value = getattr(state, method)(payload)
            replies.put((call_id, rank, True, value))
        except Exception as error:  # noqa: BLE001 - reported to the driver, which raises it
            replies.put((call_id, rank, False, "".join(traceback.format_exception_only(type(error), error)).strip()))
        if method == "shutdown":
            return


class _WorkerState:
    def __init__(self, rank: int, world: int, port: int, spec: ServiceSpec):
        import torch.distributed as dist

        from megalite import topology
        from megalite.distributed import DDPConfig, DistributedDataParallel
        from megalite.models import GPTModel
        from megalite.optim import get_optimizer
        from megalite.pipeline import split_layers
        from megalite.rlhf.backend import TrainingBackend
        from megalite.tensor_parallel import model_parallel_seed

        self.spec, self.rank = spec, rank
        backend = "nccl" if spec.with_gpus else "gloo"
        self.device = torch.device("cuda", rank) if spec.with_gpus else torch.device("cpu")
        if spec.with_gpus:
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        layout = spec.parallel
        self.topo = topo = topology.initialize(tp=layout.tp, pp=layout.pp)
        model_parallel_seed(spec.seed, topo.tp.rank)
        layer_range = split_layers(spec.model.num_layers, topo.pp.size)[topo.pp.rank][0]
        module = GPTModel(spec.model, pre_process=topo.is_first_stage(), post_process=topo.is_last_stage(),
                          layer_range=layer_range).to(self.device)
        self.chunk = DistributedDataParallel(module, DDPConfig(), topo.dp.group, topo.expert_dp.group)
        self.optimizer = get_optimizer(spec.optimizer, [self.chunk])
        self.backend = TrainingBackend(self.chunk, self.optimizer, resolve_objective(spec.loss_fn),
                                       layout.micro_batch_size, topo)

    def forward_backward(self, batch: dict) -> dict:
        rows = batch["input_ids"].shape[0] // self.topo.dp.size
        start = self.topo.dp.rank * rows
        return self.backend.forward_backward({k: v[start:start + rows].to(self.device) for k, v in batch.items()})

    def optim_step(self, _) -> dict:
        return self.backend.optim_step()

    def get_weights(self, path: str) -> str:
        from megalite.checkpoint import save_checkpoint

        return save_checkpoint(path, 0, [self.chunk])

    def load_weights(self, path: str) -> bool:
        from megalite.checkpoint import load_checkpoint

        load_checkpoint(path, [self.chunk])
        return True

    def save(self, step: int) -> str:
        from megalite.checkpoint import save_checkpoint

        return save_checkpoint(self.spec.checkpoint_dir, step, [self.chunk], self.optimizer)

    def load(self, path: str) -> bool:
        from megalite.checkpoint import load_checkpoint

        load_checkpoint(path, [self.chunk], self.optimizer)
        return True

    def shutdown(self, _) -> bool:
        from megalite import topology

        topology.destroy()
        return True
