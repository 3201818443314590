"""Megatron's ``--mock-data``: synthetic documents that need no files, for smoke tests and benchmarks."""

from __future__ import annotations

import numpy as np

from megalite.data.gpt_dataset import SPLIT_NAMES, GPTDataset, split_documents


class MockIndexedDataset:
    """100,000 documents in the :class:`~megalite.data.indexed_dataset.IndexedDataset` interface.

    Megatron-Core's ``MockGPTLowLevelDataset``: document ``i`` has a length ``n_i`` drawn
    from ``[1, 4096)`` by a fixed-seed generator and holds ``1, 2, ..., n_i - 1``
    modulo ``vocab_size`` (the tokenizer's), then ``eod``.
    """

    prefix = "mock"

    def __init__(self, vocab_size: int, eod: int, num_docs: int = 100_000, max_length: int = 4096):
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(f"mock data needs a vocabulary of at least 2 ids holding eod, got {vocab_size} "
                             f"and eod {eod}")
        self.vocab_size, self.eod = vocab_size, eod
        self.sizes = np.random.default_rng(0).integers(1, max_length, size=num_docs, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sizes[i])
        tokens = np.append((np.arange(size - 1, dtype=np.int64) + 1) % self.vocab_size, self.eod)
        return tokens[offset:size if length is None else offset + length]


MOCK_SPLIT = "1,1,1"
"""Megatron-Core splits its mock documents evenly, whatever ``--split`` says."""


def build_mock_datasets(seq_length: int, seed: int, num_samples, vocab_size: int, eod: int,
                        cache_dir: str | None = None, tokenizer: dict | None = None):
    """(train, valid, test) GPT datasets over the mock documents, split in thirds as Megatron-Core splits them.

    Sample i of each is Megatron-Core's ``MockGPTDataset``'s for the same request, seed and tokenizer
    (``vocab_size`` and ``eod`` are the tokenizer's; ``tokenizer`` its Megatron identifiers, for the cache);
    a split asked for no samples is None."""
    indexed = MockIndexedDataset(vocab_size, eod)
    results = []
    for name, documents, wanted in zip(SPLIT_NAMES, split_documents(len(indexed), MOCK_SPLIT), num_samples):
        results.append(GPTDataset(indexed, documents, int(wanted), seq_length, seed, cache_dir, name=f"mock_{name}",
                                  vocab_size=vocab_size, split=MOCK_SPLIT, index_split=name, tokenizer=tokenizer,
                                  megatron_class="MockGPTDataset") if wanted > 0 and len(documents) else None)
    return tuple(results)
