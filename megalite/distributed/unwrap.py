"""The model inside the data-parallel wrappers, for code that reads its config, groups or weights."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` with every wrapper that holds it as ``.module`` peeled off.

    The wrappers are :class:`DistributedDataParallel`, :class:`FullyShardedDataParallel`
    and the RL reference model; a model itself has no ``module`` attribute.
    Checkpoints, the inference engine and the RL code all read the model through
    this one function.
    """
    while hasattr(model, "module"):
        model = model.module
    return model
