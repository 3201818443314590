import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder

VOCAB = 64


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small indexed dataset of arithmetic token sequences below VOCAB."""
    prefix = str(tmp_path_factory.mktemp("ckpt_data") / "tiny")
    rng = np.random.RandomState(0)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(100):
            start, step, length = rng.randint(0, VOCAB), rng.randint(1, 4), rng.randint(8, 30)
            builder.add_document((start + step * np.arange(length)) % VOCAB)
    return prefix
