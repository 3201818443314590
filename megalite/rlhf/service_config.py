"""What a TrainingService worker is built from, as plain data (the layout, the spec, the loss by name), and the
driver's checks of the model, optimizer and batches it is given, so bad input fails before any worker sees it."""

from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass, field
from typing import Callable

import torch

from megalite.models import GPTConfig
from megalite.optim import OptimizerConfig
from megalite.training.nan_guard import NanGuardConfig

OBJECTIVES = {"language_model": "megalite.rlhf.objectives:LanguageModelObjective",
              "ppo_actor": "megalite.rlhf.objectives:PPOActorObjective",
              "ppo_critic": "megalite.rlhf.objectives:PPOCriticObjective"}
STRATEGIES = ("megalite", "ddp", "fsdp2")  # megalite's GPT (TP/PP/DP); a user's module under DDP or FSDP2


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
    ``optim_step`` and ``save``.  With ``strategy="megalite"`` the model is a ``GPTConfig``; with ``"ddp"`` or
    ``"fsdp2"`` a picklable zero-argument factory of a user's ``nn.Module``, and the optimizer an
    ``OptimizerConfig`` or a picklable factory ``params -> torch.optim.Optimizer``
    (:mod:`megalite.rlhf.service_module`)."""

    model: GPTConfig | Callable
    optimizer: OptimizerConfig | Callable
    loss_fn: str
    parallel: ParallelLayout
    checkpoint_dir: str
    seed: int = 1234
    with_gpus: bool = False
    nan_guard: NanGuardConfig = field(default_factory=NanGuardConfig)
    strategy: str = "megalite"

    @property
    def user_model(self) -> bool:
        """Whether the model is the caller's own module (not megalite's GPT)."""
        return self.strategy != "megalite"


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


def check_model(strategy: str, model, optimizer, parallel: ParallelLayout, pickled: bool) -> None:
    """Raise ValueError, in the driver, for a model/optimizer/layout that ``strategy`` cannot build.

    ``pickled``: the workers receive the spec through pickle (local processes), so factories must be
    importable (module-level functions, classes, ``functools.partial`` of them), not lambdas or closures.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"TrainingService strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "megalite":
        if not isinstance(model, GPTConfig) or not isinstance(optimizer, OptimizerConfig):
            raise ValueError(f"strategy='megalite' trains megalite's GPT: model must be a GPTConfig and optimizer an "
                             f"OptimizerConfig, got {type(model).__name__} and {type(optimizer).__name__}; "
                             f"for your own nn.Module pass a factory with strategy='fsdp2' or 'ddp'")
        return
    if isinstance(model, GPTConfig) or not callable(model):
        raise ValueError(f"strategy={strategy!r} trains your own nn.Module: model must be a zero-argument factory "
                         f"returning it, got {type(model).__name__} (megalite's GPT takes strategy='megalite')")
    if not isinstance(optimizer, OptimizerConfig) and not callable(optimizer):
        raise ValueError(f"optimizer must be an OptimizerConfig or a factory params -> torch.optim.Optimizer, "
                         f"got {type(optimizer).__name__}")
    if parallel.tp != 1 or parallel.pp != 1:
        raise ValueError(f"strategy={strategy!r} shards a user's module over data parallelism only; got "
                         f"tp={parallel.tp}, pp={parallel.pp} (tensor and pipeline parallelism need megalite's GPT)")
    for what, factory in (("model", model), ("optimizer", optimizer)):
        if pickled and callable(factory):
            try:
                pickle.dumps(factory)
            except Exception as error:  # noqa: BLE001 - any pickling failure means the same to the caller
                raise ValueError(f"the {what} factory {factory!r} cannot be sent to the workers ({error}); use a "
                                 f"module-level function or a functools.partial of one") from None


def check_batch(spec: ServiceSpec, batch: dict) -> None:
    """Raise ValueError, in the driver, for a ``forward_backward`` batch the workers could not split or embed.

    Every entry is a tensor of the same ``B`` rows, ``B`` divisible by ``dp x micro_batch_size``.  megalite's GPT
    also needs integer ``input_ids [B, s]`` inside its vocabulary; a user's objective names its own keys.
    """
    if not isinstance(batch, dict) or not batch or (not spec.user_model and "input_ids" not in batch):
        raise ValueError("forward_backward needs a dict batch of [B, ...] tensors"
                         + ("" if spec.user_model else " with 'input_ids' [B, s]"))
    first = "input_ids" if "input_ids" in batch else next(iter(batch))
    lead = batch[first]
    rows = lead.shape[0] if isinstance(lead, torch.Tensor) and lead.dim() >= 1 else None
    for key, value in batch.items():
        if rows is None or not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != rows:
            raise ValueError(f"batch[{key!r}] has shape {tuple(getattr(value, 'shape', ()))}; every entry "
                             f"needs the same rows as batch[{first!r}] {tuple(getattr(lead, 'shape', ()))}")
    layout = spec.parallel
    if rows % (layout.dp * layout.micro_batch_size):
        raise ValueError(f"batch of {rows} sequences is not divisible by dp={layout.dp} x "
                         f"micro_batch_size={layout.micro_batch_size}")
    if spec.user_model:
        return
    if lead.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [B, s], got shape {tuple(lead.shape)}")
    if lead.is_floating_point() or lead.is_complex():
        raise ValueError(f"batch['input_ids'] must hold integer token ids, got {lead.dtype}")
    vocab = spec.model.vocab_size  # the padded rows past it are no tokens
    bad = lead[(lead < 0) | (lead >= vocab)]
    if bad.numel():
        raise ValueError(f"batch['input_ids'] holds token id {int(bad[0])}, outside the vocabulary of {vocab} ids")
