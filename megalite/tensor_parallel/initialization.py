"""Layout-independent initialization of sharded weights.

Every TP rank fills the full (master) weight from the default torch generator
and keeps its own contiguous block, so a given seed yields the same full weight
whatever the TP size, and the generator advances identically on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

InitMethod = Callable[[torch.Tensor], object]


def normal_init(std: float = 0.02) -> InitMethod:
    """An init method that fills a tensor in place from N(0, std^2)."""

    def init(tensor: torch.Tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init


def sharded_master_weight(shape: tuple[int, ...], partition_dim: int, rank: int, size: int,
                          init_method: InitMethod | None, dtype: torch.dtype,
                          device) -> torch.Tensor:
    """Initialize the full ``shape`` weight on CPU in fp32, return block ``rank`` of ``size``.

    The master weight is built on CPU so the same seed gives the same values on
    every device; the shard is then cast to ``dtype`` and moved to ``device`` as
    a copy of its own (a view would keep the whole master weight alive on CPU).
    """
    master = torch.empty(shape, dtype=torch.float32)
    (init_method or normal_init())(master)
    shard = master.chunk(size, dim=partition_dim)[rank]
    return shard.to(dtype=dtype, device=device, memory_format=torch.contiguous_format, copy=True)


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int) -> torch.nn.Parameter:
    """Tag ``param`` as a TP shard along ``partition_dim`` (see docs/development.md)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    return param
