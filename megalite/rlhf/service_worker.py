"""One TrainingService worker rank: joins the job on ``ready``, then answers the driver's calls in order.

Every transport (local processes, Ray actors) hands each message to :meth:`ServiceWorker.handle` and sends
back what it returns, so the protocol is defined once, here.  Once joined, a thread bumps the counter
``heartbeat/<rank>`` in the driver's store every :data:`HEARTBEAT_SECONDS`: a worker that stops beating is
stopped or frozen, one that beats but does not answer is waiting (e.g. in a collective) for another.
The trainer's NaN guard runs before every update and every save: non-finite values never reach the
weights or a checkpoint.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch

from megalite.rlhf.service_config import Rendezvous, ServiceSpec, resolve_objective
from megalite.training.nan_guard import NanGuard, NonFiniteError, check_finite_weights

HEARTBEAT_SECONDS = 0.5

METHODS = ("ready", "forward_backward", "optim_step", "get_weights", "load_weights", "save", "load", "shutdown")


class ServiceWorker:
    """Rank ``rank`` of the service: a :class:`TrainingBackend` over TP/PP/DP groups built from ``spec``."""

    def __init__(self, rank: int, spec: ServiceSpec):
        self.rank, self.spec = rank, spec
        self.backend = None
        self.nan_guard = NanGuard(spec.nan_guard, log=rank == 0)
        self.steps = 0  # optim_step calls, the guard's iteration numbers
        self.loss: float | None = None  # the last forward_backward's loss, for the guard

    def handle(self, method: str, payload) -> tuple[bool, object]:
        """``(True, result)``, or ``(False, "ErrorType: message")`` when the call raised."""
        try:
            if method not in METHODS:
                raise ValueError(f"unknown TrainingService method {method!r}")
            if self.backend is None and method not in ("ready", "shutdown"):
                raise RuntimeError(f"{method} before the worker joined the job")
            return True, getattr(self, method)(payload)
        except Exception as error:  # noqa: BLE001 - reported to the driver, which raises it
            return False, f"{type(error).__name__}: {error}"

    def ready(self, rendezvous: Rendezvous) -> dict | None:
        """Join the job and build the model; a user's model answers with its tensors' global shapes."""
        import torch.distributed as dist

        from megalite import topology
        from megalite.distributed import DDPConfig, DistributedDataParallel
        from megalite.models import GPTModel
        from megalite.optim import get_optimizer
        from megalite.pipeline import build_chunks
        from megalite.rlhf.backend import TrainingBackend
        from megalite.tensor_parallel import model_parallel_seed

        torch.set_num_threads(1)
        spec = self.spec
        # Local workers see every GPU (rank i takes GPU i); a Ray actor sees only its own (index 0).
        self.device = (torch.device("cuda", self.rank % torch.cuda.device_count()) if spec.with_gpus
                       else torch.device("cpu"))
        if spec.with_gpus:
            torch.cuda.set_device(self.device)
        store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False,
                              timeout=datetime.timedelta(seconds=300))
        threading.Thread(target=_beat, args=(rendezvous, self.rank), name="megalite-heartbeat", daemon=True).start()
        dist.init_process_group("nccl" if spec.with_gpus else "gloo", store=store, rank=self.rank,
                                world_size=rendezvous.world)
        layout = spec.parallel
        self.topo = topo = topology.initialize(tp=layout.tp, pp=layout.pp)
        shapes = None
        if spec.user_model:
            from megalite.rlhf.service_module import build_user_model, tensor_shapes

            self.chunk, self.optimizer = build_user_model(spec, topo, self.device)
            shapes = tensor_shapes(self.chunk)
        else:
            model_parallel_seed(spec.seed, topo.tp.rank)
            [module] = build_chunks(lambda **where: GPTModel(spec.model, **where), spec.model.num_layers,
                                    topo.pp.group)
            module.to(self.device)
            self.chunk = DistributedDataParallel(module, DDPConfig(), topo.dp.group, topo.expert_dp.group)
            self.optimizer = get_optimizer(spec.optimizer, [self.chunk])
        self.backend = TrainingBackend(self.chunk, self.optimizer, resolve_objective(spec.loss_fn),
                                       layout.micro_batch_size, topo)
        return shapes

    def forward_backward(self, batch: dict) -> dict:
        rows = next(iter(batch.values())).shape[0] // self.topo.dp.size
        start = self.topo.dp.rank * rows
        metrics = self.backend.forward_backward({k: v[start:start + rows].to(self.device) for k, v in batch.items()})
        losses = [value for key, value in metrics.items() if key.endswith("loss")]
        self.loss = sum(losses) if losses else None
        return metrics

    def optim_step(self, _) -> dict:
        """The update, unless the guard finds nan/inf: then no update, and an error or (configured) a skip."""
        self.steps += 1
        try:
            apply = self.nan_guard.check(self.steps, self.loss, self.chunk.grad_tensors())
        except NonFiniteError:
            self.backend.discard()
            raise
        finally:
            self.loss = None
        if not apply:
            self.backend.discard()
            return {"update_applied": 0.0, "grad_norm": float("nan")}
        return self.backend.optim_step()

    def get_weights(self, path: str) -> str:
        from megalite.checkpoint import save_sharded

        return save_sharded(path, 0, [self.chunk])

    def load_weights(self, path: str) -> bool:
        from megalite.checkpoint import load_sharded

        load_sharded(path, [self.chunk])
        return True

    def save(self, step: int) -> str:
        from megalite.checkpoint import save_sharded

        if self.spec.nan_guard.check_for_nan_in_loss_and_grad:
            check_finite_weights([self.chunk], step)
        return save_sharded(self.spec.checkpoint_dir, step, [self.chunk], self.optimizer)

    def load(self, path: str) -> bool:
        from megalite.checkpoint import load_sharded

        load_sharded(path, [self.chunk], self.optimizer)
        return True

    def shutdown(self, _) -> bool:
        from megalite import topology

        topology.destroy()
        return True


def _beat(rendezvous: Rendezvous, rank: int) -> None:
    """Bump ``heartbeat/<rank>`` in the driver's store until the store is gone (a client of its own)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(rendezvous.host, rendezvous.port, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        while True:
            store.add(f"heartbeat/{rank}", 1)
            time.sleep(HEARTBEAT_SECONDS)
    except Exception:  # noqa: BLE001 - the driver closed the store: the service is over
        return
