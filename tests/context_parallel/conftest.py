"""The packed dataset of the context-parallel trainer tests: short documents ending with eod tokens."""

import pytest

from tests.conftest import write_arithmetic_documents

BYTE_EOD = 256
"""The byte tokenizer's end-of-document id (no --tokenizer-model)."""


@pytest.fixture(scope="session")
def packed_data(tmp_path_factory):
    """Short documents ending with eod, so every 16-token sample packs several of them."""
    return write_arithmetic_documents(str(tmp_path_factory.mktemp("packed") / "packed"), 300, 1, 64, (2, 9),
                                      eod=BYTE_EOD)
