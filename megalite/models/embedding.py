"""Token (vocab-parallel) and learned absolute position embeddings."""

from __future__ import annotations

import torch
from torch import nn

from megalite.models.init import vocab_init
from megalite.tensor_parallel import VocabParallelEmbedding, get_rng_tracker, scatter_to_sequence_parallel_region


class GPTEmbedding(nn.Module):
    """``word_embeddings(ids) + position_embeddings(positions)`` -> ``[s, b, h]`` with dropout.

    The word embedding's padding rows (``vocab_size`` up to the padded size)
    are zero.  Under sequence parallelism the output is this rank's sequence
    block ``[s/tp, b, h]``.
    """

    def __init__(self, config, padded_vocab_size: int, *, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, config.hidden_size, tp_group=tp_group,
            init_method=vocab_init(config.init_method_std, config.vocab_size))
        if config.position_embedding_type == "learned_absolute":
            weight = torch.empty(config.max_position_embeddings, config.hidden_size)
            torch.nn.init.normal_(weight, mean=0.0, std=config.init_method_std)
            self.position_embeddings = nn.Embedding.from_pretrained(weight, freeze=False)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``position_ids`` ``[b, s]`` -> embeddings ``[s, b, h]`` (``[s/tp, b, h]`` under SP)."""
        x = self.word_embeddings(input_ids.t())
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids.t())
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        if self.training and self.dropout > 0.0:
            if self.sequence_parallel:
                with get_rng_tracker().fork():
                    return torch.nn.functional.dropout(x, self.dropout, True)
            x = torch.nn.functional.dropout(x, self.dropout, True)
        return x
