import os
import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.data.megatron_fixture import FIXTURE_PREFIX as FIXTURE


def _random_docs(seed, count=40, high=1000):
    rng = np.random.RandomState(seed)
    docs = [rng.randint(0, high, size=rng.randint(0, 30)) for _ in range(count)]
    docs[3] = np.zeros(0, dtype=np.int64)
    return docs


def _write(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix), dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize()
    return str(prefix)


def _naive_read(prefix):
    """Parse both files with struct alone, following Megatron-Core's documented layout."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", raw[9:17])
    code = raw[17]
    num_seqs, num_docs = struct.unpack("<QQ", raw[18:34])
    sizes = struct.unpack(f"<{num_seqs}i", raw[34:34 + 4 * num_seqs])
    pointers = struct.unpack(f"<{num_seqs}q", raw[34 + 4 * num_seqs:34 + 12 * num_seqs])
    documents = struct.unpack(f"<{num_docs}q", raw[34 + 12 * num_seqs:])
    fmt, width = {4: ("i", 4), 8: ("H", 2)}[code]
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    docs = [list(struct.unpack(f"<{sizes[i]}{fmt}", data[pointers[i]:pointers[i] + width * sizes[i]]))
            for i in range(num_seqs)]
    return version, documents, docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_matches_naive_reader(tmp_path, dtype):
    docs = _random_docs(0)
    prefix = _write(tmp_path / "ds", docs, dtype)
    version, documents, naive = _naive_read(prefix)
    ds = IndexedDataset(prefix)
    assert version == 1 and len(ds) == len(docs) == len(naive)
    assert list(documents) == list(range(len(docs) + 1))
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == naive[i] == doc.tolist()
    assert ds[-1].tolist() == docs[-1].tolist()
    long = max(range(len(docs)), key=lambda i: len(docs[i]))
    assert ds.get(long, 2, 5).tolist() == docs[long][2:7].tolist()
    assert ds.get(long, 4).tolist() == docs[long][4:].tolist()
    with pytest.raises(ValueError, match="do not fit"):
        ds.get(long, len(docs[long]) - 1, 2)
    with pytest.raises(IndexError):
        ds[len(docs)]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[long].tolist() == docs[long].tolist()
    assert len(IndexedDataset(_write(tmp_path / "empty", []))) == 0


def test_byte_identical_to_megatron_fixture(tmp_path):
    """The reader reads, and the builder rewrites byte for byte, files made by Megatron-Core's own builder."""
    ds = IndexedDataset(FIXTURE)
    assert (len(ds), ds.num_tokens, ds.dtype) == (207, 12616, np.dtype(np.uint16))
    copy = _write(tmp_path / "copy", [ds[i] for i in range(len(ds))])
    for suffix in (".bin", ".idx"):
        with open(copy + suffix, "rb") as mine, open(FIXTURE + suffix, "rb") as theirs:
            assert mine.read() == theirs.read(), suffix


def test_builder_rejects_ids_outside_the_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds"), np.uint16)
    with pytest.raises(ValueError, match="65536"):
        builder.add_document([1, 65536])
    with pytest.raises(ValueError, match="-1"):
        builder.add_document([-1])
    with pytest.raises(ValueError, match="integers"):
        builder.add_document([0.5])
    builder.discard()
    with pytest.raises(ValueError, match="float32"):
        IndexedDatasetBuilder(str(tmp_path / "f"), np.float32)
    with pytest.raises(ValueError, match="uint32"):
        IndexedDatasetBuilder(str(tmp_path / "f"), np.uint32)


def test_builder_context_manager_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "ds")) as builder:
            builder.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_missing_files(tmp_path):
    prefix = _write(tmp_path / "ds", [[1, 2]])
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx"):
        IndexedDataset(str(tmp_path / "nothere"))


def test_truncated_or_padded_bin(tmp_path):
    prefix = _write(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(ValueError, match=r"ds\.bin: 8 bytes, expected 10 \(5 tokens of uint16; truncated"):
        IndexedDataset(prefix)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match="12 bytes, expected 10"):
        IndexedDataset(prefix)


def test_corrupt_index(tmp_path):
    prefix = _write(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    with open(prefix + ".idx", "rb") as f:
        good = f.read()

    def check(raw, pattern):
        with open(prefix + ".idx", "wb") as f:
            f.write(raw)
        with pytest.raises(ValueError, match=pattern):
            IndexedDataset(prefix)

    check(b"MGLTIDX\x00\x00" + good[9:], r"bad magic b'MGLTIDX\\x00\\x00', expected b'MMIDIDX\\x00\\x00'")
    check(good[:9] + struct.pack("<Q", 7) + good[17:], "version 7")
    check(good[:17] + bytes([99]) + good[18:], "dtype code 99")
    check(good[:17] + bytes([7]) + good[18:], "dtype code 7 is not an integer")
    check(good[:-8], f"{len(good) - 8} bytes, expected {len(good)} for 2 sequences and 3 document indices")
    check(good[:10], "shorter than the 34-byte header")
    check(good[:34] + struct.pack("<i", 2) + good[38:], "pointers disagree")
