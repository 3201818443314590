"""Tensor parallelism: sharded layers, their collectives, vocab-parallel losses, RNG and recompute.

Depends only on torch and :mod:`megalite.topology`, so it can be used inside
any ``nn.Module``.
"""

from megalite.tensor_parallel.cross_entropy import (vocab_parallel_cross_entropy, vocab_parallel_entropy,
                                                    vocab_parallel_log_probs)
from megalite.tensor_parallel.initialization import normal_init
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linear
from megalite.tensor_parallel.mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                                               gather_from_tensor_parallel_region,
                                               reduce_from_tensor_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region,
                                               scatter_to_tensor_parallel_region)
from megalite.tensor_parallel.random import (MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker,
                                             model_parallel_seed)
from megalite.tensor_parallel.recompute import recompute
from megalite.tensor_parallel.utils import divide
from megalite.tensor_parallel.vocab_embedding import VocabParallelEmbedding, pad_vocab_size

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "column_parallel_linear", "VocabParallelEmbedding",
    "pad_vocab_size", "normal_init", "divide",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy", "vocab_parallel_log_probs", "vocab_parallel_entropy",
    "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed", "MODEL_PARALLEL_RNG", "recompute",
]
