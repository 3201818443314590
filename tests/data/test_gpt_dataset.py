import functools
import hashlib
import json
import os

import numpy as np
import pytest

from megalite.data import gpt_dataset
from megalite.data.gpt_dataset import (BlendedDataset, GPTDataset, build_train_valid_test_datasets,
                                       split_documents)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_indexed(prefix, seed, count=30, low=0, high=500):
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for i in range(count):
            builder.add_document(rng.randint(low, high, size=0 if i % 7 == 3 else rng.randint(1, 12)))
    return IndexedDataset(str(prefix))


def test_samples_equal_a_naive_concatenation(tmp_path):
    indexed = make_indexed(tmp_path / "ds", seed=0)
    documents = np.arange(5, 25)
    seq = 7
    ds = GPTDataset(indexed, documents, num_samples=60, seq_length=seq, seed=3)
    tokens_per_epoch = int(indexed.sizes[documents].sum())
    assert ds.num_epochs == -(-(60 * seq + 1) // tokens_per_epoch) > 1
    # Megatron's order: the epochs' documents are shuffled together, and the shuffle covers every whole
    # sample those epochs hold, not only the 60 asked for.
    assert sorted(np.asarray(ds.doc_idx).tolist()) == sorted(np.tile(documents, ds.num_epochs).tolist())
    epochs = np.asarray(ds.doc_idx).reshape(ds.num_epochs, len(documents))
    assert not all((e == epochs[0]).all() for e in epochs[1:])
    held = (ds.num_epochs * tokens_per_epoch - 1) // seq
    assert held > 60 and sorted(np.asarray(ds.shuffle_idx).tolist()) == list(range(held))
    stream = np.concatenate([indexed[d] for d in ds.doc_idx])
    seen = []
    for idx in range(len(ds)):
        sample = ds[idx]["tokens"]
        j = int(ds.shuffle_idx[idx])
        assert sample.dtype.is_floating_point is False and sample.shape == (seq + 1,)
        assert sample.tolist() == stream[j * seq:j * seq + seq + 1].tolist()
        seen.append(j)
    assert seen != sorted(seen)
    assert len(ds) == held  # Megatron's length: every whole sample of the epochs built
    with pytest.raises(IndexError):
        ds[held]


def _stem(dataset) -> str:
    """The file-name stem Megatron-Core gives a dataset's cached indices: the md5 of its description."""
    return f"{hashlib.md5(dataset.description.encode()).hexdigest()}-GPTDataset-train-"


def _counting_builds(monkeypatch) -> list:
    builds = []
    original_build = GPTDataset._build_doc_idx

    def counted(self, *args):
        builds.append(1)
        return original_build(self, *args)

    monkeypatch.setattr(GPTDataset, "_build_doc_idx", counted)
    return builds


def test_determinism_and_cache(tmp_path, monkeypatch):
    indexed = make_indexed(tmp_path / "ds", seed=1)
    docs = np.arange(len(indexed))
    cache = str(tmp_path / "cache")
    a = GPTDataset(indexed, docs, 40, 5, seed=7, cache_dir=cache, name="train")
    files = sorted(os.listdir(cache))
    assert files == [_stem(a) + name for name in ("description.txt", "document_index.npy", "megalite.json",
                                                  "sample_index.npy", "shuffle_index.npy")]
    builds = _counting_builds(monkeypatch)
    b = GPTDataset(indexed, docs, 40, 5, seed=7, cache_dir=cache, name="train")
    assert builds == []
    fresh = GPTDataset(indexed, docs, 40, 5, seed=7)
    other = GPTDataset(indexed, docs, 40, 5, seed=8, cache_dir=cache, name="train")
    assert len(os.listdir(cache)) == 10 and _stem(other) != _stem(a) and builds == [1, 1]
    assert _stem(GPTDataset(indexed, docs, 41, 5, seed=7)) != _stem(a)
    fewer = GPTDataset(indexed, docs[:-1], 40, 5, seed=7, cache_dir=cache)  # same description, other documents
    assert _stem(fewer) == _stem(a) and builds == [1, 1, 1, 1]
    for i in range(40):
        assert a[i]["tokens"].tolist() == b[i]["tokens"].tolist() == fresh[i]["tokens"].tolist()
    assert [other[i]["tokens"].tolist() for i in range(40)] != [a[i]["tokens"].tolist() for i in range(40)]


def cached_samples(prefix, cache=None) -> list:
    """The 40 samples (seq 5, seed 7) of every document of the indexed dataset at ``prefix``, through the index
    cache in ``cache`` (None: built afresh, uncached)."""
    indexed = IndexedDataset(str(prefix))
    ds = GPTDataset(indexed, np.arange(len(indexed)), 40, 5, seed=7, cache_dir=cache and str(cache), name="train")
    return [ds[i]["tokens"].tolist() for i in range(40)]


def test_a_wrong_or_stale_cache_is_rebuilt(tmp_path, monkeypatch):
    """A cache whose arrays were changed (a plausible permutation) or whose data files changed since megalite
    built it is rebuilt, and the samples are those of an uncached dataset; one without megalite's record
    (Megatron's) is used as Megatron uses it."""
    indexed = make_indexed(tmp_path / "ds", seed=1)
    docs = np.arange(len(indexed))
    cache = tmp_path / "cache"
    expected = cached_samples(tmp_path / "ds")
    stem = _stem(GPTDataset(indexed, docs, 40, 5, seed=7, cache_dir=str(cache), name="train"))
    shuffle, record = cache / f"{stem}shuffle_index.npy", cache / f"{stem}megalite.json"
    builds = _counting_builds(monkeypatch)
    load = functools.partial(cached_samples, tmp_path / "ds", cache)
    assert load() == expected and builds == []  # a valid cache is used as is
    np.save(shuffle, np.load(shuffle)[::-1].copy())  # another permutation: plausible, but not this dataset's
    assert load() == expected and builds == [1]
    before = json.loads(record.read_text())["files"]
    os.utime(tmp_path / "ds.bin", ns=(1, 1))  # the data file changed since the cache was built
    assert load() == expected and builds == [1, 1]
    assert json.loads(record.read_text())["files"] != before
    record.unlink()  # as Megatron-Core writes it
    assert load() == expected and builds == [1, 1]
    np.save(shuffle, np.load(shuffle)[:-1].copy())  # a shape no build of this description has
    assert load() == expected and builds == [1, 1, 1]


def test_bad_gpt_dataset_arguments(tmp_path):
    indexed = make_indexed(tmp_path / "ds", seed=2, count=10)
    with pytest.raises(ValueError, match=r"span \[0, 10\].*has 10 documents"):
        GPTDataset(indexed, np.arange(11), 5, 4, seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        GPTDataset(indexed, np.arange(0), 5, 4, seed=0)
    with pytest.raises(ValueError, match="hold no tokens"):
        GPTDataset(indexed, np.array([3]), 5, 4, seed=0)
    with pytest.raises(ValueError, match="seq_length"):
        GPTDataset(indexed, np.arange(10), 5, 0, seed=0)


def test_split_fractions():
    train, valid, test = split_documents(1000, "949,50,1")
    assert (len(train), len(valid), len(test)) == (949, 50, 1)
    assert np.concatenate([train, valid, test]).tolist() == list(range(1000))
    assert [len(s) for s in split_documents(10, "90,10")] == [9, 1, 0]
    assert [len(s) for s in split_documents(10, "1,1,1")] == [3, 4, 3]
    assert [len(s) for s in split_documents(7, "0.5,0.5,0")] == [4, 3, 0]
    for bad in ("a,b", "1,-1", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="split"):
            split_documents(10, bad)


class _Numbers:
    def __init__(self, tag, size):
        self.tag, self.size = tag, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        assert 0 <= i < self.size
        return (self.tag, i)


def test_blend_weights():
    parts = [_Numbers(k, 600) for k in range(3)]
    blend = BlendedDataset(parts, [5, 3, 2], size=1000)
    items = [blend[i] for i in range(len(blend))]
    for k, share in enumerate((0.5, 0.3, 0.2)):
        mine = sorted(i for tag, i in items if tag == k)
        assert abs(len(mine) - share * 1000) <= 1
        assert mine == list(range(len(mine)))
    # Megatron's greedy rule, error w * max(i, 1) - count, ties to the lowest index, no shuffle:
    # i=0 and i=1 both use max(i, 1) = 1, so dataset 1 (error 0.3) follows dataset 0 (now -0.5); the
    # rule w * (i + 1) - count would give dataset 0 twice at i=3 and i=4 instead.
    assert [tag for tag, _ in items[:10]] == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    shorter = BlendedDataset(parts, [5, 3, 2], size=300)
    assert [shorter[i] for i in range(300)] == items[:300]
    with pytest.raises(ValueError, match="must supply 501 samples but holds 400"):
        BlendedDataset([_Numbers(0, 400), _Numbers(1, 600)], [1, 1], size=1001)
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        BlendedDataset(parts[:2], [1, 1, 1], size=10)
    with pytest.raises(ValueError, match="non-negative"):
        BlendedDataset(parts[:2], [1, -1], size=10)


def test_build_train_valid_test_blend(tmp_path):
    make_indexed(tmp_path / "low", seed=3, count=200, low=0, high=100)
    make_indexed(tmp_path / "high", seed=4, count=200, low=100, high=200)
    low, high = str(tmp_path / "low"), str(tmp_path / "high")
    train, valid, test = build_train_valid_test_datasets(
        ["0.7", low, "0.3", high], "90,10,0", seq_length=4, seed=5,
        train_valid_test_num_samples=[200, 20, 10], cache_dir=str(tmp_path / "cache"))
    assert test is None and len(train) == 200 and len(valid) == 20
    sources = []
    for i in range(len(train)):
        tokens = train[i]["tokens"]
        assert tokens.shape == (5,)
        assert bool((tokens < 100).all()) or bool((tokens >= 100).all())
        sources.append(int(tokens[0] >= 100))
    assert abs(sum(sources) - 60) <= 1
    valid_docs = split_documents(200, "90,10,0")[1]
    for part in valid.datasets:
        assert sorted(set(np.asarray(part.doc_idx).tolist())) == valid_docs.tolist()

    single, _, _ = build_train_valid_test_datasets([low], "949,50,1", 4, 5, [30, 0, 0])
    train_tokens = int(np.asarray(IndexedDataset(low).sizes)[split_documents(200, "949,50,1")[0]].sum())
    assert isinstance(single, GPTDataset) and len(single) == (train_tokens - 1) // 4 > 30  # Megatron's: the epoch
    with pytest.raises(ValueError, match="weight/prefix pairs, got 3 items"):
        build_train_valid_test_datasets(["1", low, "2"], "949,50,1", 4, 5, [30, 0, 0])
    with pytest.raises(FileNotFoundError, match=r"missing\.idx"):
        build_train_valid_test_datasets([str(tmp_path / "missing")], "949,50,1", 4, 5, [30, 0, 0])
    with pytest.raises(ValueError, match="no training documents"):
        build_train_valid_test_datasets([low], "0,1,0", 4, 5, [30, 0, 0])


def test_blend_request_covers_the_greedy_counts():
    for weights in ([0.7, 0.3], [1, 1, 1], [0.01, 0.99]):
        for size in (1, 7, 100, 333):
            need = gpt_dataset.blend_samples_needed(weights, size)
            parts = [_Numbers(k, n) for k, n in enumerate(need)]
            BlendedDataset(parts, weights, size)
