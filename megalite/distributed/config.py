"""Configuration of data-parallel gradient reduction."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DDPConfig:
    """How :class:`~megalite.distributed.DistributedDataParallel` reduces gradients.

    bucket_size: elements per communication bucket; None puts every gradient in one bucket.
    grad_reduce_in_fp32: accumulate and reduce gradients in fp32 even for bf16/fp16 parameters.
    overlap_grad_reduce: start a bucket's reduction during backward as soon as it is complete.
    use_distributed_optimizer: pad buckets to a multiple of the DP size and reduce-scatter them,
        so each rank receives only the gradient shard its ZeRO-1 optimizer updates.
    shard_collectives: how ZeRO-1 buffers move shards. "scatter_gather" reduce-scatters grads and
        all-gathers params; "reduce_broadcast" all-reduces grads and broadcasts each rank's param shard,
        the same bytes in collectives that gloo runs about twice as fast; "auto" picks
        "reduce_broadcast" on gloo and "scatter_gather" otherwise.
    """

    bucket_size: int | None = 40_000_000
    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = True
    use_distributed_optimizer: bool = False
    shard_collectives: str = "auto"

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements or None, got {self.bucket_size}")
        if self.shard_collectives not in ("auto", "scatter_gather", "reduce_broadcast"):
            raise ValueError(f"shard_collectives must be auto, scatter_gather or reduce_broadcast, "
                             f"got {self.shard_collectives!r}")


@dataclass
class FSDPConfig:
    """How :class:`~megalite.distributed.FullyShardedDataParallel` shards a model chunk (torch FSDP2).

    reshard_after_forward: free the gathered parameters after each forward and gather them again
        in backward (less memory, one more all-gather per layer).
    param_dtype: the dtype parameters are gathered and computed in (None: their own, fp32); the
        sharded main weights and the optimizer state stay fp32.
    grad_reduce_in_fp32: reduce-scatter gradients in fp32 even when ``param_dtype`` is bf16/fp16
        (Megatron's ``--accumulate-allreduce-grads-in-fp32``); fp32 training always reduces in fp32.
    """

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    grad_reduce_in_fp32: bool = False
