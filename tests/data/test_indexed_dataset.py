import os
import pickle
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


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
    """Parse both files with struct alone, following the documented layout."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:8] == b"MGLTIDX\x00"
    (version,) = struct.unpack("<Q", raw[8:16])
    code = raw[16]
    num_docs, num_tokens, max_id = struct.unpack("<QQq", raw[24:48])
    sizes = struct.unpack(f"<{num_docs}i", raw[48:48 + 4 * num_docs])
    offsets = struct.unpack(f"<{num_docs + 1}q", raw[48 + 4 * num_docs:])
    fmt = {1: "B", 2: "H", 3: "i", 4: "q", 5: "I"}[code]
    with open(prefix + ".bin", "rb") as f:
        tokens = struct.unpack(f"<{num_tokens}{fmt}", f.read())
    docs = [list(tokens[offsets[i]:offsets[i] + sizes[i]]) for i in range(num_docs)]
    return version, max_id, docs


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_matches_naive_reader(tmp_path, dtype):
    docs = _random_docs(0)
    prefix = _write(tmp_path / "ds", docs, dtype)
    version, max_id, naive = _naive_read(prefix)
    ds = IndexedDataset(prefix)
    assert version == 1 and len(ds) == len(docs) == len(naive)
    assert ds.dtype == np.dtype(dtype)
    assert ds.max_token_id == max_id == max(int(d.max()) for d in docs if len(d))
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.doc_offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()
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


def test_empty_dataset_and_vocab_check(tmp_path):
    empty = IndexedDataset(_write(tmp_path / "empty", []))
    assert len(empty) == 0 and empty.max_token_id == -1
    ds = IndexedDataset(_write(tmp_path / "ds", [[1, 2, 300], [7]]))
    ds.check_vocab(301)
    with pytest.raises(ValueError, match="largest token id is 300.*only 300 ids"):
        ds.check_vocab(300)


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
    with pytest.raises(ValueError, match=r"ds\.bin: 8 bytes, expected 10 \(5 tokens of uint16\)"):
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

    check(b"NOTANIDX" + good[8:], "bad magic")
    check(good[:8] + struct.pack("<Q", 7) + good[16:], "version 7")
    check(good[:16] + bytes([99]) + good[17:], "dtype code 99")
    check(good[:-8], f"{len(good) - 8} bytes, expected {len(good)} for 2 documents")
    check(good[:10], "shorter than the 48-byte header")
    sizes_at = 48
    check(good[:sizes_at] + struct.pack("<i", 2) + good[sizes_at + 4:], "sizes disagree")
