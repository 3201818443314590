"""The packed dataset of the context-parallel trainer tests: short documents ending with eod tokens."""

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder

BYTE_EOD = 256
"""The byte tokenizer's end-of-document id (no --tokenizer-model)."""


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory):
    """Short documents ending with eod, so every 16-token sample packs several of them."""
    prefix = str(tmp_path_factory.mktemp("packed") / "packed")
    rng = np.random.RandomState(1)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(300):
            start, step = rng.randint(0, 64), rng.randint(1, 4)
            builder.add_document(np.append((start + step * np.arange(rng.randint(2, 9))) % 64, BYTE_EOD))
    return prefix
