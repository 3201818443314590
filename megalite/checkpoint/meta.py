"""A model's shapes without its values: ``GPTModel`` built on the meta device, and what checkpoint readers ask of it.

Used by the readers and converters that place another checkpoint's tensors (global shapes, tensor-parallel split
dimensions); it imports nothing else of :mod:`megalite.checkpoint`, so every reader can use it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from megalite.models import GPTModel


class _NoDrawsOnMeta(TorchFunctionMode):
    """Random fills of meta tensors do nothing: they hold no values, and torch's meta kernel for a draw imports
    its compiler the first time (seconds), which a shapes-only model need not pay."""

    DRAWS = (torch.nn.init.normal_, torch.Tensor.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if func in self.DRAWS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def meta_model(config):
    """``GPTModel(config)`` on the meta device (shapes and parameter attributes, no storage, no random draws)."""
    with torch.device("meta"), _NoDrawsOnMeta():
        return GPTModel(config)


def split_dims(config) -> dict[str, int | None]:
    """The tensor-parallel split dimension (``partition_dim``) of every model tensor of ``config``, None where
    each tensor rank holds all of it: what :func:`megalite.checkpoint.sharding.global_param` needs of a local shard read from a file."""
    return {name: getattr(t, "partition_dim", None) if getattr(t, "tensor_model_parallel", False) else None
            for name, t in meta_model(config).state_dict(keep_vars=True).items()}
