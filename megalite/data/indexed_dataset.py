"""Memory-mapped token datasets: a ``.bin`` of token ids and an ``.idx`` describing it.

The ``.idx`` file is a fixed little-endian header followed by two arrays::

    magic        8 bytes   b"MGLTIDX\\0"
    version      uint64    1
    dtype code   uint8     (+7 bytes padding)
    num_docs     uint64
    num_tokens   uint64
    max_token_id int64     -1 when there are no tokens
    sizes        int32[num_docs]       tokens per document
    offsets      int64[num_docs + 1]   token offset of each document in .bin

The ``.bin`` file is the documents' tokens back to back in the header's dtype.
Storing ``max_token_id`` lets a trainer check a tokenizer's vocabulary against
the data before training, without reading the tokens.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MGLTIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sQB7xQQq")
_DTYPES = {1: np.uint8, 2: np.uint16, 3: np.int32, 4: np.int64, 5: np.uint32}
_CODES = {np.dtype(t): c for c, t in _DTYPES.items()}


def index_file(prefix: str) -> str:
    return prefix + ".idx"


def data_file(prefix: str) -> str:
    return prefix + ".bin"


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest supported dtype that holds every id below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2 ** 16 else np.int32)


def _token_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _CODES:
        names = ", ".join(np.dtype(t).name for t in _DTYPES.values())
        raise ValueError(f"token dtype must be one of {names}, got {dtype.name}")
    return dtype


class IndexedDatasetBuilder:
    """Writes documents to ``prefix.bin``/``prefix.idx``.

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
        self._max = -1

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
            self._max = max(self._max, high)
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(array.size))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], len(sizes), int(offsets[-1]), self._max))
            f.write(sizes.tobytes())
            f.write(offsets.tobytes())
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
    """Read-only view of ``prefix.bin``/``prefix.idx``; ``ds[i]`` is document ``i``.

    Opening validates the header and checks every size against the files'
    lengths, raising FileNotFoundError or ValueError that names the file.
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
            magic, version, code, num_docs, num_tokens, max_id = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r}; not a megalite index")
        if version != VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version}, expected {VERSION}")
        if code not in _DTYPES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}, expected one of {sorted(_DTYPES)}")
        expected = _HEADER.size + 4 * num_docs + 8 * (num_docs + 1)
        if idx_bytes != expected:
            raise ValueError(f"{idx_path}: {idx_bytes} bytes, expected {expected} for {num_docs} documents")
        self.dtype = np.dtype(_DTYPES[code])
        self.max_token_id = int(max_id)
        self.num_tokens = int(num_tokens)
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = index[_HEADER.size:_HEADER.size + 4 * num_docs].view(np.int32)
        self.doc_offsets = index[_HEADER.size + 4 * num_docs:].view(np.int64)
        if self.doc_offsets[0] != 0 or self.doc_offsets[-1] != num_tokens:
            raise ValueError(f"{idx_path}: document offsets run from {self.doc_offsets[0]} to "
                             f"{self.doc_offsets[-1]}, expected 0 to {num_tokens}")
        if not np.array_equal(np.diff(self.doc_offsets), self.sizes):
            raise ValueError(f"{idx_path}: document sizes disagree with the document offsets")
        bin_bytes = os.path.getsize(bin_path)
        expected = num_tokens * self.dtype.itemsize
        if bin_bytes != expected:
            raise ValueError(f"{bin_path}: {bin_bytes} bytes, expected {expected} "
                             f"({num_tokens} tokens of {self.dtype.name})")
        if num_tokens:
            self._tokens = np.memmap(bin_path, mode="r", dtype=self.dtype)
        else:
            self._tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of document ``i`` (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i = int(i) % n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"offset {offset} and length {length} do not fit document {i} of {size} tokens")
        start = int(self.doc_offsets[i]) + offset
        return np.array(self._tokens[start:start + length])

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if the data holds an id that a ``vocab_size`` vocabulary lacks."""
        if self.max_token_id >= vocab_size:
            raise ValueError(f"{index_file(self.prefix)}: the data's largest token id is {self.max_token_id}, "
                             f"but the tokenizer's vocabulary has only {vocab_size} ids")

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])
