"""GPT pretraining samples cut from an indexed dataset, plus splitting and blending.

The sample order is Megatron-Core's, bit for bit (``GPTDataset`` and
``BlendedDataset`` of megatron/core/datasets), so a run continued from
Megatron sees the batches Megatron would have given.  A :class:`GPTDataset`
lays as many epochs of its documents end to end as the request needs,
shuffled by the seed, and cuts the stream into samples of ``seq_length + 1``
tokens (inputs plus the shifted label) that start every ``seq_length`` tokens,
so samples cross document boundaries and consecutive samples share one token.
Every whole sample those epochs hold is then shuffled by the same seed; when
the last epoch is needed for less than 80% of its samples it is shuffled
apart from the earlier epochs, in the documents and in the samples, so its
leftovers never mix into the epochs before it.  The three index arrays are
cached as ``.npy`` files keyed by a hash of everything they depend on, next to
a JSON record of what they were built from (the data files' paths, sizes and
mtimes, seed, sizes, the arrays' hashes): a cache whose record is missing or
differs, or whose arrays do not match their hashes, is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import torch

from megalite.data.indexed_dataset import IndexedDataset, data_file, index_file

_INDEX_VERSION = 2  # 2: Megatron-Core's shuffles
_SEPARATE_FINAL_EPOCH_BELOW = 0.80  # Megatron-Core's threshold, a fraction of one epoch's samples
_BLEND_SURPLUS = 0.005  # Megatron-Core's mid_level_dataset_surplus: extra samples each blended dataset is built with
_PARTS = ("doc_idx", "sample_idx", "shuffle_idx")


def _shuffled(array: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """``array`` shuffled in place by ``rng`` (the draws Megatron-Core makes for the same length)."""
    rng.shuffle(array)
    return array


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _load_cache(record_path: str, paths: list[str], built_from: dict):
    """The cached arrays when their record matches ``built_from`` and their hashes; else None (rebuild)."""
    try:
        with open(record_path) as f:
            record = json.load(f)
        if record.get("built_from") != built_from:
            return None
        arrays = [np.load(p, mmap_mode="r") for p in paths]
    except (OSError, ValueError):
        return None
    if [_digest(a) for a in arrays] != record.get("sha256"):
        return None
    return arrays


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples ``{"tokens": LongTensor[seq_length + 1]}`` from ``documents``.

    ``documents`` are ids of documents in ``indexed`` (one split).  As many
    epochs over them are used as ``num_samples`` needs; sample i is Megatron-Core's
    sample i for the same documents, request and seed.  With ``cache_dir`` the
    index arrays are loaded from, or saved to, ``cache_dir``.  With
    ``vocab_size`` every sample's ids are checked against it: indexed files
    carry no vocabulary, so an id out of range raises ValueError naming the
    dataset, the document and the id before it reaches a model.
    """

    def __init__(self, indexed: IndexedDataset, documents, num_samples: int, seq_length: int, seed: int,
                 cache_dir: str | None = None, name: str = "gpt", vocab_size: int | None = None):
        documents = np.asarray(documents, dtype=np.int64)
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if documents.ndim != 1 or len(documents) == 0:
            raise ValueError(f"dataset {name!r} needs a non-empty 1-D array of document ids, "
                             f"got shape {documents.shape}")
        if documents.min() < 0 or documents.max() >= len(indexed):
            raise ValueError(f"dataset {name!r}: document ids span [{documents.min()}, {documents.max()}], "
                             f"but {indexed.prefix} has {len(indexed)} documents")
        sizes = np.asarray(indexed.sizes)[documents].astype(np.int64)
        tokens_per_epoch = int(sizes.sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"dataset {name!r}: its {len(documents)} documents hold no tokens")
        self.indexed = indexed
        self.name = name
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.num_epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)

        key = hashlib.sha256(json.dumps({
            "version": _INDEX_VERSION, "name": name, "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed}).encode())
        key.update(documents.tobytes())
        key.update(sizes.tobytes())
        self.cache_key = key.hexdigest()[:16]
        cached = None
        if cache_dir is not None:
            stem = os.path.join(cache_dir, f"{name}_{self.cache_key}")
            paths = [f"{stem}_{part}.npy" for part in _PARTS]
            record_path = f"{stem}_built_from.json"
            built_from = self._built_from(indexed, documents, sizes)
            cached = _load_cache(record_path, paths, built_from)
        if cached is not None:
            self.doc_idx, self.sample_idx, self.shuffle_idx = cached
        else:
            rng = np.random.RandomState(seed)
            total, first_part = self._sample_counts(tokens_per_epoch)
            self.doc_idx = self._build_doc_idx(documents, rng, first_part < total)
            self.sample_idx = self._build_sample_idx(indexed, self.doc_idx, total, seq_length)
            self.shuffle_idx = np.concatenate([_shuffled(np.arange(first_part, dtype=np.int64), rng),
                                               _shuffled(np.arange(first_part, total, dtype=np.int64), rng)])
            if cache_dir is not None:
                os.makedirs(cache_dir, exist_ok=True)
                arrays = (self.doc_idx, self.sample_idx, self.shuffle_idx)
                for path, array in zip(paths, arrays):
                    _save_atomic(path, array)
                tmp = f"{record_path}.tmp{os.getpid()}"
                with open(tmp, "w") as f:  # written last: a record vouches for arrays already in place
                    json.dump({"built_from": built_from, "sha256": [_digest(a) for a in arrays]}, f, indent=1)
                os.replace(tmp, record_path)

    def _built_from(self, indexed: IndexedDataset, documents: np.ndarray, sizes: np.ndarray) -> dict:
        """What the index arrays depend on, as JSON: the data files as they are now, and every parameter."""
        files = {}
        for path in (data_file(indexed.prefix), index_file(indexed.prefix)):
            stat = os.stat(path)
            files[os.path.realpath(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return {"version": _INDEX_VERSION, "name": self.name, "files": files, "num_samples": self.num_samples,
                "seq_length": self.seq_length, "seed": self.seed, "num_epochs": self.num_epochs,
                "documents_sha256": _digest(documents), "sizes_sha256": _digest(sizes)}

    def _sample_counts(self, tokens_per_epoch: int) -> tuple[int, int]:
        """(whole samples in all epochs, samples shuffled together first).

        The second is the total unless the final epoch is separate: then it is
        the samples that end before the final epoch's last token, as Megatron counts them.
        """
        total = (self.num_epochs * tokens_per_epoch - 1) // self.seq_length
        if self.num_epochs == 1:
            return total, total
        before_final = ((self.num_epochs - 1) * tokens_per_epoch - 1) // self.seq_length
        per_epoch = (tokens_per_epoch - 1) // self.seq_length
        separate = self.num_samples - before_final < int(_SEPARATE_FINAL_EPOCH_BELOW * per_epoch)
        return total, before_final if separate else total

    def _build_doc_idx(self, documents: np.ndarray, rng: np.random.RandomState, separate: bool) -> np.ndarray:
        """The documents of every epoch: all epochs shuffled together, or the final one apart."""
        if not separate:
            return _shuffled(np.tile(documents, self.num_epochs), rng)
        return np.concatenate([_shuffled(np.tile(documents, self.num_epochs - 1), rng),
                               _shuffled(documents.copy(), rng)])

    @staticmethod
    def _build_sample_idx(indexed: IndexedDataset, doc_idx: np.ndarray, num_samples: int,
                          seq_length: int) -> np.ndarray:
        """Row i is (position in doc_idx, token offset) where sample i starts."""
        sizes = np.asarray(indexed.sizes)[doc_idx].astype(np.int64)
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        positions = np.arange(num_samples, dtype=np.int64) * seq_length
        slot = np.searchsorted(starts, positions, side="right") - 1
        return np.stack([slot, positions - starts[slot]], axis=1)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        slot, offset = (int(v) for v in self.sample_idx[self.shuffle_idx[idx]])
        needed = self.seq_length + 1
        pieces = []
        while needed:
            doc = int(self.doc_idx[slot])
            piece = self.indexed.get(doc, offset, min(needed, int(self.indexed.sizes[doc]) - offset))
            if self.vocab_size is not None and piece.size and (piece.max() >= self.vocab_size or piece.min() < 0):
                bad = int(piece.max() if piece.max() >= self.vocab_size else piece.min())
                raise ValueError(f"dataset {self.indexed.prefix}: document {doc} holds token id {bad}, outside "
                                 f"the vocabulary of {self.vocab_size} ids")
            pieces.append(piece)
            needed -= len(piece)
            slot, offset = slot + 1, 0
        return {"tokens": torch.from_numpy(np.concatenate(pieces).astype(np.int64))}


def _blend_choice(weights: np.ndarray, size: int) -> np.ndarray:
    """Megatron-Core's greedy blend: sample i goes to the dataset with the largest ``w * max(i, 1) - count``.

    Ties go to the lowest dataset index.  Sample i's dataset depends only on
    samples before it, so a longer blend starts with a shorter one.
    """
    choice = np.empty(size, dtype=np.int64)
    counts = np.zeros(len(weights), dtype=np.int64)
    for i in range(size):
        pick = int(np.argmax(weights * max(i, 1) - counts))
        choice[i] = pick
        counts[pick] += 1
    return choice


def normalize_weights(weights) -> np.ndarray:
    """Weights as float64 summing to one; ValueError if any is negative or all are zero."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights.tolist()}")
    return weights / weights.sum()


def blend_samples_needed(weights, size: int) -> list[int]:
    """How many samples each dataset is built with for a :class:`BlendedDataset` of ``size``.

    Megatron-Core's request, ``ceil(ceil(w * size) * (1 + surplus))``: a dataset's sample
    order depends on how many samples it is asked for, so the count is Megatron's too.
    """
    return [int(math.ceil(math.ceil(size * w) * (1 + _BLEND_SURPLUS))) for w in normalize_weights(weights).tolist()]


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``, in Megatron-Core's order.

    Sample i goes to the dataset furthest behind its share (see
    :func:`_blend_choice`), so dataset counts are within about one of
    ``weight * size``; the interleave is not shuffled (each dataset's own
    samples already are).  Dataset k serves its own samples 0, 1, 2, ... in order.
    """

    def __init__(self, datasets, weights, size: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        choice = _blend_choice(self.weights, size)
        self.dataset_index = choice
        self.dataset_sample_index = np.empty(size, dtype=np.int64)
        for k, dataset in enumerate(self.datasets):
            mine = choice == k
            count = int(mine.sum())
            if count > len(dataset):
                raise ValueError(f"blended dataset {k} must supply {count} samples but holds {len(dataset)}")
            self.dataset_sample_index[mine] = np.arange(count)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int):
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]


def parse_split(split: str) -> list[float]:
    """"949,50,1" -> train/valid/test fractions; missing parts count as zero."""
    try:
        parts = [float(p) for p in str(split).replace("/", ",").split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"split {split!r} must be up to three comma-separated numbers") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split {split!r} must be one to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_documents(num_docs: int, split: str = "949,50,1") -> list[np.ndarray]:
    """Document ids of the train, valid and test splits: consecutive ranges in that order."""
    bounds = np.round(np.cumsum([0.0] + parse_split(split)) * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(3)]


def parse_data_path(data_path: list[str]) -> tuple[list[float] | None, list[str]]:
    """["prefix"] or ["w1", "prefix1", "w2", "prefix2", ...] -> (weights, prefixes); weights None for one bare prefix.

    A weighted list is a blend even with one prefix, as in Megatron-Core (whose blend then
    asks its dataset for a few more samples, which can change that dataset's order).
    """
    if isinstance(data_path, str):
        data_path = data_path.split()
    if len(data_path) == 1:
        return None, list(data_path)
    if len(data_path) == 0 or len(data_path) % 2:
        raise ValueError(f"data_path must be one prefix or weight/prefix pairs, got {len(data_path)} items: "
                         f"{data_path}")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ValueError(f"data_path weights must be numbers, got {data_path[0::2]}") from None
    return weights, list(data_path[1::2])


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples, cache_dir: str | None = None,
                                    vocab_size: int | None = None):
    """(train, valid, test) datasets over one prefix or a weighted blend of prefixes.

    Each prefix is split by documents according to ``split``.  A split gets
    None when it is asked for no samples or, for valid and test, when it holds
    no documents; an empty train split that is asked for samples is an error.
    ``vocab_size`` turns on the per-sample token-id check (see :class:`GPTDataset`).
    """
    raw_weights, prefixes = parse_data_path(data_path)
    weights = None if raw_weights is None else normalize_weights(raw_weights)
    indexed = [IndexedDataset(p) for p in prefixes]
    splits = [split_documents(len(ds), split) for ds in indexed]
    results = []
    for part, name in enumerate(("train", "valid", "test")):
        wanted = int(train_valid_test_num_samples[part])
        if wanted <= 0:
            results.append(None)
            continue
        empty = [p for p, s in zip(prefixes, splits) if len(s[part]) == 0]
        if empty:
            if part == 0:
                raise ValueError(f"split {split!r} leaves no training documents in {empty[0]} "
                                 f"({len(indexed[prefixes.index(empty[0])])} documents)")
            results.append(None)
            continue
        # Megatron normalizes the weights once for the per-dataset counts and again inside the blend.
        counts = [wanted] if weights is None else blend_samples_needed(raw_weights, wanted)
        parts = [GPTDataset(ds, s[part], n, seq_length, seed, cache_dir,
                            name=f"{os.path.basename(p)}_{name}", vocab_size=vocab_size)
                 for ds, s, n, p in zip(indexed, splits, counts, prefixes)]
        results.append(parts[0] if weights is None else BlendedDataset(parts, weights, wanted))
    return tuple(results)
