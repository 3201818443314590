"""What a TrainingService worker is built from, as plain data: the layout, the spec, the loss by name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig
from megalite.training.nan_guard import NanGuardConfig

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
    """Everything a worker needs, as data: configs, the loss by name, the layout, the checkpoint directory.

    ``nan_guard`` is the trainer's non-finite guard (:mod:`megalite.training.nan_guard`), applied in
    ``optim_step`` and ``save``."""

    model: GPTConfig
    optimizer: OptimizerConfig
    loss_fn: str
    parallel: ParallelLayout
    checkpoint_dir: str
    seed: int = 1234
    with_gpus: bool = False
    nan_guard: NanGuardConfig = field(default_factory=NanGuardConfig)


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers meet: the driver's TCPStore (``host:port``) for ``world`` ranks."""

    host: str
    port: int
    world: int


def resolve_objective(loss_fn: str):
    """The objective for a registered name or ``"module:attribute"`` (called with no arguments)."""
    target = OBJECTIVES.get(loss_fn, loss_fn)
    module_name, sep, attribute = target.partition(":")
    if not sep:
        raise ValueError(f"loss_fn {loss_fn!r} is neither a registered name {sorted(OBJECTIVES)} "
                         f"nor 'module:attribute'")
    return getattr(importlib.import_module(module_name), attribute)()
