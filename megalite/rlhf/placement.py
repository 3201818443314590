"""Where each model of an RL job keeps its weights, gradients and optimizer state in each phase, and how
much memory each phase uses.

An RL iteration runs three phases: ``generation`` (the actor samples), ``scoring`` (reward model,
reference, critic and target critic score the samples) and ``training`` (actor and critic update).  A
:class:`Placement` holds the job's models and, from an :class:`OffloadConfig`, a plan: for each model
and phase, whether a piece of state is on the compute ``device`` or parked in the host ``pool`` (see
:mod:`megalite.rlhf.offload`).  ``with placement.phase(name):`` moves every piece to where the plan puts
it for that phase, then measures the phase:

- ``mem_<phase>_device_bytes``: bytes of the models' tensors (parameters, buffers, gradients including
  DDP's grad buffer, optimizer state) on the compute device, counted from the tensors themselves (each
  storage once), largest over the phase (sampled when it starts and when it ends);
- ``mem_<phase>_pool_bytes``: bytes of the same kind parked in host pools (including the Polyak target's
  master copy), at the same samples;
- ``mem_<phase>_peak_bytes`` (CUDA only): ``torch.cuda.max_memory_allocated`` over the phase (all
  allocations of the process: activations and KV caches too), its peak counter reset when the phase starts;
- ``time_offload_s``: host seconds spent moving state at phase starts (issuing the copies and waiting for
  the offloads; loads on a GPU overlap what follows).

On CPU the device is the CPU, so a parked tensor moves to a separate pool tensor and stops counting as
device bytes.  Offloads are waited for before a phase starts, so the memory they free is free in it;
loads stay asynchronous (the compute stream waits for them on the GPU).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule

from megalite.rlhf.offload import Offloader, module_tensors, optimizer_tensors
from megalite.rlhf.target import PolyakTarget

PHASES = ("generation", "scoring", "training")
DEVICE, POOL = "device", "pool"


@dataclass(frozen=True)
class OffloadConfig:
    """What leaves the device between the phases that use it.

    offload_frozen_models: the reference, reward model, teacher and target critic (the models no optimizer
        trains) live in the host pool and come to the device only for their phase (verl's reference and
        reward-model ``param_offload``; OpenRLHF's ``--ref_reward_offload``).
    offload_optimizer: the trained models' optimizer state (Adam moments, and the fp32 main copies when the
        weights are bf16/fp16) lives in the pool during generation and scoring and comes back for
        training (verl's ``optimizer_offload``).
    """

    offload_frozen_models: bool = False
    offload_optimizer: bool = False


@dataclass
class _Model:
    name: str
    kind: str  # "trained", "frozen" or "target"
    module: torch.nn.Module
    phases: tuple[str, ...]
    on_demand: bool = False
    optimizer: object = None
    target: PolyakTarget | None = None
    offloaders: dict[str, Offloader] = field(default_factory=dict)  # state name -> its offloader
    fixed: bool = True  # whether the module keeps its parameter objects (FSDP2 swaps sharded/unsharded ones)
    params: list = field(default_factory=list)  # the module's parameters and buffers as registered
    buffers: list = field(default_factory=list)

    def tensors(self) -> tuple[list, list]:
        """(parameters, buffers): the registration's lists, or a fresh walk where FSDP2 swaps parameters."""
        if self.fixed:
            return self.params, self.buffers
        return list(self.module.parameters()), list(self.module.buffers())


class Placement:
    """The job's models, their placement plan per phase, the moves between phases and per-phase memory."""

    def __init__(self, config: OffloadConfig, device):
        self.config, self.device = config, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.models: dict[str, _Model] = {}
        self._phase: str | None = None
        self._metrics: dict[str, float] = {}

    def _add(self, model: _Model) -> None:
        """Register ``model``; its module's parameters and buffers are listed here, once (the per-phase memory
        reads these lists, so a module must have its final structure, adapters included, when added; moves
        between device and pool swap ``.data`` and keep the tensor objects).  An FSDP2 module registers its
        unsharded parameters in place of the sharded ones while gathered, so it is walked at each measurement."""
        if model.name in self.models:
            raise ValueError(f"placement already has a model named {model.name!r}")
        unknown = [p for p in model.phases if p not in PHASES]
        if unknown or not model.phases:
            raise ValueError(f"model {model.name!r}: phases {list(model.phases)} must be a non-empty subset of "
                             f"{list(PHASES)}")
        model.params, model.buffers = list(model.module.parameters()), list(model.module.buffers())
        model.fixed = not any(isinstance(m, FSDPModule) for m in model.module.modules())
        elsewhere = sorted({str(t.device) for t in [*model.params, *model.buffers] if t.device != self.device})
        if elsewhere:
            raise ValueError(f"model {model.name!r} has tensors on {', '.join(elsewhere)}; the placement's device "
                             f"is {self.device}")
        self.models[model.name] = model

    def add_trained(self, name: str, chunk, optimizer) -> None:
        """A model an optimizer trains (``chunk``: DDP- or FSDP2-wrapped; ``optimizer``: megalite's); its weights
        and gradients stay on the device, its optimizer state follows ``offload_optimizer``."""
        model = _Model(name, "trained", chunk.module, PHASES, optimizer=optimizer)
        self._add(model)
        if self.config.offload_optimizer:
            model.offloaders["optimizer"] = Offloader(optimizer_tensors(optimizer), self.device, writeback=True)

    def add_frozen(self, name: str, module: torch.nn.Module, phases=("scoring",), on_demand: bool = False) -> None:
        """A model no optimizer changes, used in ``phases``.  ``on_demand``: moved by :meth:`using` around
        each use rather than at phase boundaries (a model served from another thread, e.g. the scoring server's
        teacher)."""
        model = _Model(name, "frozen", module, tuple(phases), on_demand=on_demand)
        self._add(model)
        if self.config.offload_frozen_models:
            model.offloaders["weights"] = Offloader(module_tensors(module), self.device, writeback=False)
            if on_demand:
                model.offloaders["weights"].offload()
                model.offloaders["weights"].synchronize()  # frees the device copy now, not at the first use

    def add_target(self, name: str, module: torch.nn.Module, target: PolyakTarget, phases=("scoring",)) -> None:
        """A target network: ``target`` (its master copy, on the host) and ``module``, the weights that score
        on the device (in ``phases``; parked in between under ``offload_frozen_models``, with the master
        itself as its pool).  :meth:`update_target` moves it."""
        if not isinstance(target, PolyakTarget):
            raise ValueError(f"target {name!r} must be a PolyakTarget, got {type(target).__name__}")
        model = _Model(name, "target", module, tuple(phases), target=target)
        self._add(model)
        if self.config.offload_frozen_models:
            model.offloaders["weights"] = Offloader(module_tensors(module), self.device, writeback=False,
                                                    pool=target.params)
            model.offloaders["weights"].offload()  # parked on the master, so the first load copies it
        else:
            target.load_into(module)

    def plan(self) -> list[tuple[str, str, dict[str, str]]]:
        """``(model, state, {phase: DEVICE or POOL})`` for every piece of state of every model."""
        rows = []
        for model in self.models.values():
            offloaded = bool(model.offloaders)
            if model.kind == "trained":
                rows.append((model.name, "weights", {p: DEVICE for p in PHASES}))
                rows.append((model.name, "grads", {p: DEVICE for p in PHASES}))
                rows.append((model.name, "optimizer", {p: POOL if offloaded and p != "training" else DEVICE
                                                       for p in PHASES}))
                continue
            rows.append((model.name, "weights", {p: DEVICE if p in model.phases or not offloaded else POOL
                                                 for p in PHASES}))
            if model.kind == "target":
                rows.append((model.name, "polyak master", {p: POOL for p in PHASES}))
        return rows

    def table(self) -> str:
        """The plan as one readable table (printed at start by rank 0)."""
        pool = "pinned host memory" if torch.cuda.is_available() else "host memory"
        head = (f"placement: device {self.device}, pool in {pool}; "
                f"offload_frozen_models={self.config.offload_frozen_models}, "
                f"offload_optimizer={self.config.offload_optimizer}")
        rows = [("model", "state", *PHASES)]
        for name, state, where in self.plan():
            served = " (on demand)" if self.models[name].on_demand else ""
            rows.append((name + served, state, *(where[p] for p in PHASES)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([head] + lines)

    def _moves(self, phase: str):
        """``(offloader, where the plan wants its state in phase)`` for every phase-managed offloader."""
        for name, state, where in self.plan():
            offloader = self.models[name].offloaders.get(state)
            if offloader is not None and not self.models[name].on_demand:
                yield offloader, where[phase]

    @contextmanager
    def phase(self, name: str):
        """Run a phase: state moves to where the plan puts it, and the phase's memory is recorded."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {list(PHASES)}")
        if self._phase is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._phase!r}")
        start = time.perf_counter()
        moves = list(self._moves(name))
        leaving = [o for o, wanted in moves if wanted == POOL and not o.parked]
        for offloader in leaving:
            offloader.offload()
        for offloader in leaving:
            offloader.synchronize()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        for offloader, wanted in moves:
            if wanted == DEVICE and offloader.parked:
                offloader.load()
        self._metrics["time_offload_s"] = self._metrics.get("time_offload_s", 0.0) + time.perf_counter() - start
        self._phase = name
        try:
            self._record(name, self.resident_bytes())
            yield
            self._record(name, self.resident_bytes())
            if cuda:
                self._record(name, {"peak": torch.cuda.max_memory_allocated(self.device)})
        finally:
            self._phase = None

    def using(self, name: str):
        """Context for one use of an on-demand model: loaded inside, parked after (when offloaded)."""
        offloader = self.models[name].offloaders.get("weights")
        return offloader.on_device() if offloader is not None else nullcontext()

    def update_target(self, name: str, source: torch.nn.Module) -> None:
        """One Polyak step of target ``name`` towards ``source`` (on the host), and the device copy follows:
        refreshed now when it is resident, at its next load when parked (its pool is the master)."""
        model = self.models[name]
        if model.kind != "target":
            raise ValueError(f"{name!r} is a {model.kind} model, not a target")
        offloader = model.offloaders.get("weights")
        if offloader is not None:
            offloader.synchronize()
        model.target.update(source)
        if offloader is None or not offloader.parked:
            model.target.load_into(model.module)

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every model's tensors, every pool's tensors)."""
        tensors, pools = [], []
        for model in self.models.values():  # FSDP2 parameters are DTensors: count their local shards
            params, buffers = model.tensors()  # the registration's lists (walked afresh only under FSDP2)
            tensors += params + buffers
            tensors += [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
            if model.optimizer is not None:
                tensors += list(optimizer_tensors(model.optimizer)().values())
            for offloader in model.offloaders.values():
                pools += offloader.pool_tensors()
            if model.target is not None:
                pools += model.target.host_tensors()
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors], pools

    def resident_bytes(self) -> dict[str, int]:
        """``{"device": bytes on the compute device, "pool": bytes parked in host pools}``, each storage once."""
        tensors, pools = self._tensors()
        parked = _storages(pools)
        on_device = _storages(tensors, self.device)
        return {"device": sum(n for key, n in on_device.items() if key not in parked), "pool": sum(parked.values())}

    def _record(self, phase: str, values: dict[str, int]) -> None:
        for kind, value in values.items():
            key = f"mem_{phase}_{kind}_bytes"
            self._metrics[key] = max(self._metrics.get(key, 0.0), float(value))

    def take_metrics(self) -> dict[str, float]:
        """The per-phase memory (largest over repeated phases) and the time spent moving state since the last
        call, then reset."""
        metrics, self._metrics = self._metrics, {}
        return metrics


def _storages(tensors: list[torch.Tensor], device: torch.device | None = None) -> dict[tuple, int]:
    """``{(device, storage address): storage bytes}`` of ``tensors`` (those on ``device`` when given): a storage
    counted once however many tensors view it.  One loop, no call per tensor: it runs twice per phase."""
    found = {}
    for tensor in tensors:
        where = tensor.device
        if device is None or where == device:
            storage = tensor.untyped_storage()
            found[(where, storage.data_ptr())] = storage.nbytes()
    return found
