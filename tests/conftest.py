"""Fixtures shared by every test package: the tiny indexed dataset the training-loop tests train on; the imports
run_distributed's fork server does once for every rank."""

import numpy as np
import pytest

from megalite import testing
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from tests.training.helpers import VOCAB

# What the multi-rank test modules import, imported once by run_distributed's fork server instead of by every rank
# of every run (transformers and its GPT-2 model, or Megatron-Core, take a rank over a second of CPU each).
testing.preload("pytest", "megalite.models", "megalite.moe", "megalite.pipeline", "megalite.training.gpt",
                "megalite.checkpoint.hf", "megalite.inference", "megalite.rlhf.trainer", "transformers",
                "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "megatron.core")


def write_arithmetic_documents(prefix: str, count: int, seed: int, vocab: int, lengths: tuple[int, int],
                               eod: int | None = None) -> str:
    """An indexed dataset of ``count`` arithmetic sequences mod ``vocab`` (start, step and length drawn in that
    order from ``RandomState(seed)``, length in ``[lengths)``), each followed by ``eod`` when given."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(prefix) as builder:
        for _ in range(count):
            start, step = rng.randint(0, vocab), rng.randint(1, 4)
            document = (start + step * np.arange(rng.randint(*lengths))) % vocab
            builder.add_document(document if eod is None else np.append(document, eod))
    return prefix


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small indexed dataset of token ids below VOCAB: arithmetic sequences, some structure to learn."""
    return write_arithmetic_documents(str(tmp_path_factory.mktemp("data") / "tiny"), 200, 0, VOCAB, (8, 40))
