"""Megatron's ``--mock-data``: synthetic documents that need no files, for smoke tests and benchmarks."""

from __future__ import annotations

import numpy as np

from megalite.data.gpt_dataset import GPTDataset, split_documents


class MockIndexedDataset:
    """100,000 documents in the :class:`~megalite.data.indexed_dataset.IndexedDataset` interface.

    As Megatron-Core's mock dataset: document ``i`` has a length ``n_i`` drawn
    from ``[1, 4096)`` by a fixed-seed generator and holds ``1, 2, ..., n_i - 1``
    then ``eod``; here the ids wrap so they stay inside ``vocab_size``.
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
        tokens = np.append(1 + np.arange(size - 1, dtype=np.int64) % (self.vocab_size - 1), self.eod)
        return tokens[offset:size if length is None else offset + length]


def build_mock_datasets(split: str, seq_length: int, seed: int, num_samples, vocab_size: int, eod: int,
                        cache_dir: str | None = None):
    """(train, valid, test) GPT datasets over the mock documents, split like ``--split``; None where empty."""
    indexed = MockIndexedDataset(vocab_size, eod)
    results = []
    for name, documents, wanted in zip(("train", "valid", "test"), split_documents(len(indexed), split),
                                       num_samples):
        results.append(GPTDataset(indexed, documents, int(wanted), seq_length, seed, cache_dir, name=f"mock_{name}",
                                  vocab_size=vocab_size) if wanted > 0 and len(documents) else None)
    return tuple(results)
