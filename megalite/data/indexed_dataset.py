"""Memory-mapped token datasets in Megatron-Core's indexed format: ``PREFIX.bin`` + ``PREFIX.idx``.

The ``.idx`` file is a little-endian header followed by three arrays, exactly
as Megatron-Core's ``IndexedDatasetBuilder`` writes it::

    magic             9 bytes   b"MMIDIDX\\x00\\x00"
    version           uint64    1
    dtype code        uint8     Megatron's codes: 1 uint8, 2 int8, 3 int16, 4 int32,
                                5 int64, 6 float64, 7 float32, 8 uint16
    sequence count    uint64
    document count    uint64    sequence count + 1 (document boundaries, see below)
    sequence_lengths  int32[sequence count]    tokens per sequence
    sequence_pointers int64[sequence count]    byte offset of each sequence in .bin
    document_indices  int64[document count]    0, then the sequence count after each document

The ``.bin`` file is every sequence's tokens back to back.  megalite writes one
sequence per document (as Megatron's preprocess_data does without sentence
splitting) and trains on sequences, as Megatron's GPTDataset does.  The
format stores no vocabulary, so token ids are checked against it batch by
batch (:class:`~megalite.data.gpt_dataset.GPTDataset`).
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
_CODES = {np.dtype(t): c for c, t in _DTYPES.items()}


def index_file(prefix: str) -> str:
    return prefix + ".idx"


def data_file(prefix: str) -> str:
    return prefix + ".bin"


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 for fewer than 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def _token_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _CODES or not np.issubdtype(dtype, np.integer):
        names = ", ".join(np.dtype(t).name for t in _DTYPES.values() if np.issubdtype(t, np.integer))
        raise ValueError(f"token dtype must be one of {names}, got {dtype.name}")
    return dtype


class IndexedDatasetBuilder:
    """Writes documents to ``prefix.bin``/``prefix.idx``, byte-identical to Megatron-Core's builder.

    Data goes to temporary files that :meth:`finalize` renames into place, so a
    reader never sees a half-written dataset.  Used as a context manager it
    finalizes on success and deletes the temporary files on error.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = _token_dtype(dtype)
        self._info = np.iinfo(self.dtype)
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        self._bin_tmp = f"{data_file(prefix)}.tmp{os.getpid()}"
        self._idx_tmp = f"{index_file(prefix)}.tmp{os.getpid()}"
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []

    def add_document(self, ids) -> None:
        """Append one document of token ids (any integer sequence, may be empty)."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {array.shape}")
        if array.size:
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
            low, high = int(array.min()), int(array.max())
            if low < self._info.min or high > self._info.max:
                raise ValueError(f"token ids span [{low}, {high}], outside {self.dtype.name}'s range "
                                 f"[{self._info.min}, {self._info.max}]")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(array.size))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], len(sizes), len(documents)))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._bin_tmp, data_file(self.prefix))
        os.replace(self._idx_tmp, index_file(self.prefix))

    def discard(self) -> None:
        """Close and delete the temporary files without writing the dataset."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``; ``ds[i]`` is sequence (document) ``i``.

    Opening validates the header and checks every length and pointer against
    the files' sizes, raising FileNotFoundError or ValueError that names the file.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path!r} does not exist")
        idx_bytes = os.path.getsize(idx_path)
        if idx_bytes < _HEADER.size:
            raise ValueError(f"{idx_path}: {idx_bytes} bytes is shorter than the {_HEADER.size}-byte header")
        with open(idx_path, "rb") as f:
            magic, version, code, num_seqs, num_docs = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r}; not a Megatron indexed dataset")
        if version != VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version}, expected {VERSION}")
        if code not in _DTYPES or not np.issubdtype(_DTYPES[code], np.integer):
            raise ValueError(f"{idx_path}: dtype code {code} is not an integer token type; expected one of "
                             f"{sorted(c for c, t in _DTYPES.items() if np.issubdtype(t, np.integer))}")
        expected = _HEADER.size + 4 * num_seqs + 8 * num_seqs + 8 * num_docs
        if idx_bytes != expected:
            raise ValueError(f"{idx_path}: {idx_bytes} bytes, expected {expected} for {num_seqs} sequences and "
                             f"{num_docs} document indices (truncated or corrupt)")
        self.dtype = np.dtype(_DTYPES[code])
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        start = _HEADER.size
        self.sizes = index[start:start + 4 * num_seqs].view(np.int32)
        start += 4 * num_seqs
        self.pointers = index[start:start + 8 * num_seqs].view(np.int64)
        self.document_indices = index[start + 8 * num_seqs:].view(np.int64)
        itemsize = self.dtype.itemsize
        if num_seqs and (self.sizes.min() < 0 or not np.array_equal(
                self.pointers[1:] - self.pointers[:-1], self.sizes[:-1].astype(np.int64) * itemsize)
                or self.pointers[0] != 0):
            raise ValueError(f"{idx_path}: sequence pointers disagree with the sequence lengths")
        self.num_tokens = int(self.sizes.astype(np.int64).sum())
        bin_bytes = os.path.getsize(bin_path)
        expected = self.num_tokens * itemsize
        if bin_bytes != expected:
            raise ValueError(f"{bin_path}: {bin_bytes} bytes, expected {expected} "
                             f"({self.num_tokens} tokens of {self.dtype.name}; truncated or corrupt)")
        if self.num_tokens:
            self._tokens = np.memmap(bin_path, mode="r", dtype=self.dtype)
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def tokens(self) -> np.ndarray:
        """Every sequence's tokens back to back, as ``.bin`` holds them (memory-mapped, read-only)."""
        return self._tokens

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``i`` (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i = int(i) % n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"offset {offset} and length {length} do not fit document {i} of {size} tokens")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return np.array(self._tokens[start:start + length])

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])
