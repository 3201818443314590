"""Fixtures shared by every test package: the tiny indexed dataset the training-loop tests train on."""

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests.training.helpers import VOCAB


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small indexed dataset of token ids below VOCAB: arithmetic sequences, some structure to learn."""
    prefix = str(tmp_path_factory.mktemp("data") / "tiny")
    rng = np.random.RandomState(0)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(200):
            start, step = rng.randint(0, VOCAB), rng.randint(1, 4)
            length = rng.randint(8, 40)
            builder.add_document((start + step * np.arange(length)) % VOCAB)
    return prefix
