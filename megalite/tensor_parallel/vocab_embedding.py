"""Word embedding with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite import topology
from megalite.tensor_parallel import mappings
from megalite.tensor_parallel.initialization import InitMethod, mark_tensor_parallel, sharded_master_weight
from megalite.tensor_parallel.utils import divide


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Smallest size >= ``vocab_size`` that is a multiple of ``make_vocab_size_divisible_by * tp_size``."""
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp_size < 1:
        raise ValueError(f"pad_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, tp_size={tp_size}")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows (the vocabulary) are split across TP ranks.

    Each rank looks up the ids that fall in its shard ``[vocab_start_index,
    vocab_end_index)`` and contributes zeros for the others; the partial
    results are summed over TP.  With ``reduce_scatter_embeddings=True`` the sum
    is reduce-scattered along dim 0 instead, so ids must be sequence-first
    ``[s, b]`` and the output is the sequence-parallel shard ``[s/tp, b, h]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group=None,
                 init_method: InitMethod | None = None, reduce_scatter_embeddings: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group = topology.resolve_group(tp_group, "tp")
        self.tp_size = topology.group_size(self.tp_group)
        self.tp_rank = topology.group_rank(self.tp_group)
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "num_embeddings")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and self.tp_size > 1
        self.weight = mark_tensor_parallel(nn.Parameter(sharded_master_weight(
            (num_embeddings, embedding_dim), 0, self.tp_rank, self.tp_size, init_method, params_dtype, device)), 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return mappings.reduce_from_tensor_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"
