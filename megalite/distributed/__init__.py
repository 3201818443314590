"""Data parallelism: bucketed gradient averaging (DDP, ZeRO-1), FSDP2 sharding, post-backward reductions."""

from megalite.distributed.config import DDPConfig, FSDPConfig
from megalite.distributed.data_parallel import DistributedDataParallel
from megalite.distributed.finalize import finalize_model_grads
from megalite.distributed.fsdp import FullyShardedDataParallel
from megalite.distributed.unwrap import unwrap

__all__ = ["DDPConfig", "FSDPConfig", "DistributedDataParallel", "FullyShardedDataParallel", "finalize_model_grads",
           "unwrap"]
