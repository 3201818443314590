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
Megatron-Core's (same values, dtypes and shapes), cached as Megatron caches
them (:mod:`megalite.data.megatron_cache`), and the dataset's length is
Megatron's: every whole sample of those epochs, at least the request.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from megalite.data import megatron_cache
from megalite.data.indexed_dataset import IndexedDataset, data_file, index_file

_SEPARATE_FINAL_EPOCH_BELOW = 0.80  # Megatron-Core's threshold, a fraction of one epoch's samples
_BLEND_SURPLUS = 0.005  # Megatron-Core's mid_level_dataset_surplus: extra samples each blended dataset is built with
SPLIT_NAMES = ("train", "valid", "test")


def _shuffled(array: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """``array`` shuffled in place by ``rng`` (the draws Megatron-Core makes for the same length)."""
    rng.shuffle(array)
    return array


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``{"tokens": LongTensor[seq_length + 1]}`` from ``documents``, at least ``num_samples`` of them.

    ``documents`` are ids of documents in ``indexed`` (one split).  As many
    epochs over them are used as ``num_samples`` needs; sample i is Megatron-Core's
    sample i for the same documents, request and seed, and ``len()`` is Megatron's
    (every whole sample in those epochs).  With ``cache_dir`` the index arrays are
    loaded from, or saved to, ``cache_dir`` in Megatron-Core's layout (without it, loaded from
    Megatron-LM's default ``{prefix}/cache/GPTDataset_indices`` when that exists); ``split``
    (the ``--split`` string), ``index_split`` (train, valid or test), ``tokenizer``
    (Megatron's identifiers of the tokenizer, see :mod:`megalite.data.megatron_cache`)
    and ``megatron_class`` complete Megatron's description of the dataset.  With
    ``vocab_size`` every sample's ids are checked against it: indexed files
    carry no vocabulary, so an id out of range raises ValueError naming the
    dataset, the document and the id before it reaches a model.
    """

    def __init__(self, indexed: IndexedDataset, documents, num_samples: int, seq_length: int, seed: int,
                 cache_dir: str | None = None, name: str = "gpt", vocab_size: int | None = None, *,
                 split: str | None = None, index_split: str = "train", tokenizer: dict | None = None,
                 megatron_class: str = "GPTDataset"):
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
        all_sizes = np.asarray(indexed.sizes)
        tokens_per_epoch = int(all_sizes[documents].astype(np.int64).sum())
        if tokens_per_epoch == 0:
            raise ValueError(f"dataset {name!r}: its {len(documents)} documents hold no tokens")
        self.indexed = indexed
        self.name = name
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.num_epochs = math.ceil((num_samples * seq_length + 1) / tokens_per_epoch)
        total, first_part = self._sample_counts(tokens_per_epoch)
        self.description = megatron_cache.description(
            megatron_class, None if megatron_class.startswith("Mock") else indexed.prefix, num_samples, index_split,
            seed, seq_length, split, tokenizer)
        shapes = {"document_index": (self.num_epochs * len(documents),), "sample_index": (total + 1, 2),
                  "shuffle_index": (total,)}
        files = self._data_files(indexed, documents)
        # Without a cache directory, Megatron-LM caches beside the data; megalite reads that one, writes none.
        read_dir = cache_dir if cache_dir is not None or megatron_class != "GPTDataset" else \
            os.path.join(indexed.prefix, "cache", "GPTDataset_indices")
        cached = None if read_dir is None or not os.path.isdir(read_dir) else megatron_cache.load(
            read_dir, self.description, megatron_class, index_split, files, shapes)
        if cached is not None:
            self.doc_idx, self.sample_idx, self.shuffle_idx = cached
        else:
            rng = np.random.RandomState(seed)
            self.doc_idx = self._build_doc_idx(documents, rng, first_part < total)
            self.sample_idx = self._build_sample_idx(all_sizes, self.doc_idx, total, seq_length)
            dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
            self.shuffle_idx = np.concatenate([_shuffled(np.arange(first_part, dtype=dtype), rng),
                                               _shuffled(np.arange(first_part, total, dtype=dtype), rng)])
            if cache_dir is not None:
                megatron_cache.save(cache_dir, self.description, megatron_class, index_split, files,
                                    dict(zip(shapes, (self.doc_idx, self.sample_idx, self.shuffle_idx))))

    @staticmethod
    def _data_files(indexed: IndexedDataset, documents: np.ndarray) -> dict:
        """What megalite's cache record checks beyond Megatron's description: the data files as they are now
        (sizes and mtimes; none for in-memory data) and the documents."""
        files = {"documents": megatron_cache.digest(documents)}
        for path in (data_file(indexed.prefix), index_file(indexed.prefix)):
            if os.path.exists(path):
                stat = os.stat(path)
                files[os.path.realpath(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        return files

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
        """The documents of every epoch (int32, as Megatron's): all epochs shuffled together, or the final one apart."""
        documents = documents.astype(np.int32)
        if not separate:
            return _shuffled(np.tile(documents, self.num_epochs), rng)
        return np.concatenate([_shuffled(np.tile(documents, self.num_epochs - 1), rng),
                               _shuffled(documents.copy(), rng)])

    @staticmethod
    def _build_sample_idx(all_sizes: np.ndarray, doc_idx: np.ndarray, num_samples: int,
                          seq_length: int) -> np.ndarray:
        """Megatron's sample index: row i is (position in doc_idx, token offset) where sample i starts, and row
        ``num_samples`` where the last one ends; int32 unless the document index or a document is too long."""
        sizes = all_sizes[doc_idx].astype(np.int64)
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
        slot = np.searchsorted(starts, positions, side="right") - 1
        dtype = np.int32 if max(len(doc_idx), int(all_sizes.max())) <= np.iinfo(np.int32).max else np.int64
        return np.stack([slot, positions - starts[slot]], axis=1).astype(dtype)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
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


def _blend_counts(weights, size: int, surplus: float) -> list[int]:
    """Megatron-Core's per-dataset sample counts of a blend of ``size``: ``ceil(ceil(w * size) * (1 + surplus))``."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalize_weights(weights).tolist()]


def blend_samples_needed(weights, size: int) -> list[int]:
    """How many samples each dataset is built with for a :class:`BlendedDataset` of ``size``.

    Megatron-Core's request, with its surplus: a dataset's sample order depends on how many samples it is
    asked for, so the count is Megatron's too.
    """
    return _blend_counts(weights, size, _BLEND_SURPLUS)


def blend_size(weights, size: int) -> int:
    """The size Megatron-Core gives a blend asked for ``size`` samples: the sum of its datasets' shares, each
    rounded up (so at least ``size``); its cached indices are named by it."""
    return sum(_blend_counts(weights, size, 0.0))


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``, in Megatron-Core's order.

    Sample i goes to the dataset furthest behind its share (see
    :func:`_blend_choice`), so dataset counts are within about one of
    ``weight * size``; the interleave is not shuffled (each dataset's own
    samples already are).  Dataset k serves its own samples 0, 1, 2, ... in order.
    ``dataset_index`` (int16) and ``dataset_sample_index`` (int64) are Megatron-Core's arrays.
    With ``cache_dir`` (the datasets are :class:`GPTDataset`) they are loaded from, or saved to, the
    cache as Megatron-Core's ``BlendedDataset`` keeps them there, named by its description
    (``index_split``: train, valid or test).
    """

    def __init__(self, datasets, weights, size: int, cache_dir: str | None = None, index_split: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ValueError(f"a blend holds fewer than {np.iinfo(np.int16).max} datasets, got {len(datasets)}")
        if size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.description = None if cache_dir is None else megatron_cache.blend_description(
            [dataset.description for dataset in self.datasets], index_split, self.weights.tolist(), size)
        shapes = {"dataset_index": (size,), "dataset_sample_index": (size,)}
        cached = None if cache_dir is None or not os.path.isdir(cache_dir) else megatron_cache.load(
            cache_dir, self.description, "BlendedDataset", index_split, {}, shapes)
        if cached is not None:
            self.dataset_index, self.dataset_sample_index = cached
            return
        self.dataset_index = _blend_choice(self.weights, size).astype(np.int16)
        self.dataset_sample_index = np.empty(size, dtype=np.int64)
        for k, dataset in enumerate(self.datasets):
            mine = self.dataset_index == k
            count = int(mine.sum())
            if count > len(dataset):
                raise ValueError(f"blended dataset {k} must supply {count} samples but holds {len(dataset)}")
            self.dataset_sample_index[mine] = np.arange(count)
        if cache_dir is not None:
            megatron_cache.save(cache_dir, self.description, "BlendedDataset", index_split, {},
                                dict(zip(shapes, (self.dataset_index, self.dataset_sample_index))))

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int):
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


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
                                    vocab_size: int | None = None, tokenizer: dict | None = None):
    """(train, valid, test) datasets over one prefix or a weighted blend of prefixes.

    Each prefix is split by documents according to ``split``.  A split gets
    None when it is asked for no samples or, for valid and test, when it holds
    no documents; an empty train split that is asked for samples is an error.
    ``vocab_size`` turns on the per-sample token-id check; ``tokenizer`` (Megatron's
    identifiers of it) names the cached indices as Megatron does (see :class:`GPTDataset`).
    """
    raw_weights, prefixes = parse_data_path(data_path)
    weights = None if raw_weights is None else normalize_weights(raw_weights)
    indexed = [IndexedDataset(p) for p in prefixes]
    splits = [split_documents(len(ds), split) for ds in indexed]
    results = []
    for part, name in enumerate(SPLIT_NAMES):
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
        parts = [GPTDataset(ds, s[part], n, seq_length, seed, cache_dir, name=f"{os.path.basename(p)}_{name}",
                            vocab_size=vocab_size, split=split, index_split=name, tokenizer=tokenizer)
                 for ds, s, n, p in zip(indexed, splits, counts, prefixes)]
        results.append(parts[0] if weights is None else
                       BlendedDataset(parts, weights, blend_size(raw_weights, wanted), cache_dir, name))
    return tuple(results)
