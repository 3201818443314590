"""Context parallelism (each CP rank holds ``s/cp`` tokens of every sequence) and packed-sequence attention."""

from megalite.context_parallel.attention import check_heads, context_parallel_attention
from megalite.context_parallel.batch import prepare_batch
from megalite.context_parallel.blockwise import DEFAULT_TILE
from megalite.context_parallel.config import ContextParallelConfig, PackedSequenceConfig
from megalite.context_parallel.sequence_split import (COMM_TYPES, check_comm_type, check_context_parallel, chunk_indices,
                                              document_ids, reset_position_ids, slice_for_rank)

__all__ = ["COMM_TYPES", "DEFAULT_TILE", "ContextParallelConfig", "PackedSequenceConfig", "check_comm_type",
           "check_context_parallel", "check_heads", "chunk_indices", "context_parallel_attention", "document_ids",
           "prepare_batch", "reset_position_ids", "slice_for_rank"]
