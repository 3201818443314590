"""Megatron-Core's on-disk cache of a GPT dataset's index arrays (``--data-cache-path``), read and written.

Megatron-Core names a dataset by a JSON description of everything that identifies it (class, data
prefix, requested samples, split, seed, sequence length, split string and matrix, tokenizer) and
keeps, under ``{md5 of the description}-{class}-{split}-``, the files ``description.txt``,
``document_index.npy``, ``sample_index.npy`` and ``shuffle_index.npy`` (a ``BlendedDataset``: its datasets'
descriptions, split, weights and size; ``dataset_index.npy`` and ``dataset_sample_index.npy``; see
:func:`blend_description`).  megalite writes the same files
(so a Megatron-LM run with the same description loads them) and loads Megatron's: by the exact name,
else by any description in the directory that agrees on every field but the tokenizer (which does not
change the indices).  Beside its own files megalite writes ``megalite.json``, the arrays' SHA-256 and
the data files' sizes and modification times: when that record is present and disagrees the cache is
rebuilt; a cache without it (Megatron's) is trusted after a check of the arrays' shapes and dtypes, as
Megatron trusts it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections import OrderedDict

import numpy as np

def split_matrix(split: str) -> list:
    """Megatron-Core's split matrix of a ``--split`` string: ``[lo, hi]`` fractions per split, None when empty
    (its parsing and float arithmetic, so the description is Megatron's byte for byte)."""
    vector = [float(p) for p in re.findall(r"[.0-9]+", str(split))]
    vector = (vector + [0.0] * 3)[:3]
    vector = (np.array(vector, dtype=np.float64) / np.sum(np.array(vector, dtype=np.float64))).tolist()
    ends = [0]
    for part in vector:
        ends.append(ends[-1] + part)
    return [None if hi <= lo else [lo, hi] for lo, hi in zip(ends[:-1], ends[1:])]


def description(class_name: str, dataset_path: str | None, num_samples: int, index_split: str, seed: int,
                seq_length: int, split: str | None, tokenizer: dict | None) -> str:
    """The description Megatron-Core's ``MegatronDataset`` writes, byte for byte (``tokenizer``: its identifiers)."""
    fields = OrderedDict([("class", class_name), ("dataset_path", dataset_path), ("num_samples", num_samples),
                          ("index_split", index_split), ("random_seed", seed), ("sequence_length", seq_length),
                          ("split", split), ("split_matrix", None if split is None else split_matrix(split)),
                          ("tokenizer", tokenizer)])
    return json.dumps(fields, indent=4)


def blend_description(dataset_descriptions, index_split: str, weights, size: int) -> str:
    """The description Megatron-Core's ``BlendedDataset`` writes, byte for byte: its datasets' descriptions
    (as their own descriptions hold them), the split, the normalized weights and the blend's size."""
    fields = OrderedDict([("class", "BlendedDataset"),
                          ("datasets", [json.loads(text, object_pairs_hook=OrderedDict)
                                        for text in dataset_descriptions]),
                          ("split", index_split), ("weights", [float(w) for w in weights]), ("size", size)])
    return json.dumps(fields, indent=4)


_TEXT_TOKENIZER = "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"


def null_tokenizer_identifiers(vocab_size_without_eod: int) -> dict:
    """The identifiers of Megatron-Core's NullTokenizer (``--vocab-size`` as given, without its eod)."""
    return OrderedDict([("class", _TEXT_TOKENIZER), ("tokenizer_path", None),
                        ("vocab_size", str(vocab_size_without_eod))])


def hf_tokenizer_identifiers(tokenizer_model: str, vocab_file: str | None = None,
                             merge_file: str | None = None) -> dict:
    """The identifiers of Megatron-Core's HuggingFaceTokenizer for ``--tokenizer-model`` (Megatron-LM's defaults
    for the flags megalite does not have: no special tokens, slow tokenizer, no remote code)."""
    return OrderedDict([("class", _TEXT_TOKENIZER), ("tokenizer_path", tokenizer_model),
                        ("vocab_file", str(vocab_file)), ("merges_file", str(merge_file)),
                        ("additional_special_tokens", "[]"), ("use_fast", "False"), ("trust_remote_code", "False"),
                        ("include_special_tokens", "False")])


def _paths(cache_dir: str, stem: str, names) -> dict:
    return {part: os.path.join(cache_dir, f"{stem}-{part}")
            for part in ("description.txt", "megalite.json", *(f"{a}.npy" for a in names))}


def _stem(text: str, class_name: str, index_split: str) -> str:
    return f"{hashlib.md5(text.encode('utf-8')).hexdigest()}-{class_name}-{index_split}"


def _same_indices(a: dict, b: dict) -> bool:
    """Whether two descriptions give the same indices: every field but the tokenizer, data paths resolved
    (a blend's datasets alike)."""
    def key(d):
        if not isinstance(d, dict):
            return d
        path = d.get("dataset_path")
        return {**{k: v for k, v in d.items() if k != "tokenizer"},
                "dataset_path": None if path is None else os.path.realpath(path),
                "datasets": [key(part) for part in d.get("datasets", [])]}
    return key(a) == key(b)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def load(cache_dir: str, text: str, class_name: str, index_split: str, files: dict, shapes: dict):
    """The cached arrays named by ``shapes`` (in its order) for description ``text``, memory-mapped, or None.

    ``files``: the data files' current sizes and mtimes, checked against a megalite record; ``shapes``: each
    array's expected shape, checked always (a mismatch means another build, so the cache is not used).
    """
    wanted = json.loads(text)
    candidates = [_stem(text, class_name, index_split)]
    pattern = os.path.join(glob.escape(cache_dir), f"*-{class_name}-{index_split}-description.txt")
    for path in sorted(glob.glob(pattern)):
        candidates.append(os.path.basename(path)[:-len("-description.txt")])
    for stem in candidates:
        paths = _paths(cache_dir, stem, shapes)
        try:
            with open(paths["description.txt"]) as f:
                if not _same_indices(json.load(f), wanted):
                    continue
            arrays = [np.load(paths[f"{a}.npy"], mmap_mode="r", allow_pickle=False) for a in shapes]
        except (OSError, ValueError):
            continue
        if any(arr.shape != shapes[name] or arr.dtype.kind not in "iu" for name, arr in zip(shapes, arrays)):
            continue
        if os.path.exists(paths["megalite.json"]):
            try:
                with open(paths["megalite.json"]) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if record.get("files") != files or record.get("sha256") != [digest(a) for a in arrays]:
                continue
        return tuple(arrays)
    return None


def save(cache_dir: str, text: str, class_name: str, index_split: str, files: dict, arrays: dict) -> None:
    """Write ``arrays`` (name to array) under Megatron-Core's names, with the description and megalite's record,
    each file atomically."""
    os.makedirs(cache_dir, exist_ok=True)
    paths = _paths(cache_dir, _stem(text, class_name, index_split), arrays)

    def replace(path, write):
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)

    for name, array in arrays.items():
        replace(paths[f"{name}.npy"], lambda f, a=array: np.save(f, a, allow_pickle=False))
    record = json.dumps({"files": files, "sha256": [digest(a) for a in arrays.values()]}, indent=1).encode()
    replace(paths["megalite.json"], lambda f: f.write(record))
    replace(paths["description.txt"], lambda f: f.write(text.encode("utf-8")))  # last: it makes the cache a hit
