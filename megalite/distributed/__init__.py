"""Data parallelism: bucketed gradient averaging and the post-backward gradient reductions."""

from megalite.distributed.config import DDPConfig
from megalite.distributed.data_parallel import DistributedDataParallel
from megalite.distributed.finalize import finalize_model_grads

__all__ = ["DDPConfig", "DistributedDataParallel", "finalize_model_grads"]
