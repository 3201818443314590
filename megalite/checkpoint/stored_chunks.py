"""Stored checkpoint chunks read without unpickling: memory-mapped, hash-checked, copied into place.

A chunk :mod:`megalite.checkpoint.storage` writes is a ``torch.save`` record holding one plain storage of
exactly its bytes; :class:`StoredChunks` finds those bytes in the record's zip layout and views them in the
memory-mapped file, refusing any other record, and DCP's ``.metadata`` is unpickled with an allow-list of
DCP's own metadata classes (:func:`read_dcp_metadata`), so loading a checkpoint runs no code from it.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import re
import struct
import sys
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from megalite.checkpoint.files import DCP_METADATA, MANIFEST, open_regular
from megalite.checkpoint.integrity import check_file, is_data_file, mapped_digests
from megalite.checkpoint.sharding import intersect


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only its metadata classes and torch dtypes/layouts (no code)."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _RecordView(io.RawIOBase):
    """A read-only file over bytes ``[start, start + length)`` of ``data`` (one DCP record in a memory map)."""

    def __init__(self, data, start: int, length: int):
        super().__init__()
        self._data, self._start, self._length, self._pos = data, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, pos + {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence])
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        start = self._start + self._pos
        buffer[:count] = self._data[start:start + count]
        self._pos += count
        return count


_STORAGE_ENTRY = re.compile(r"[^/]+/data/\d+")
_ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")


def _record_data(data, start: int, length: int, nbytes: int) -> int | None:
    """Where the tensor bytes of the ``torch.save`` record ``data[start:start + length]`` begin, or None.

    A record megalite writes is a zip archive holding one uncompressed C-contiguous storage of
    exactly the chunk (:func:`megalite.checkpoint.storage._exact_storage`), so its bytes are used in
    place, without unpickling the record.  Anything else (not such an archive, a storage of other than
    ``nbytes`` bytes, another byte order) gives None.
    """
    try:
        with zipfile.ZipFile(_RecordView(data, start, length)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    storages = [e for e in entries if _STORAGE_ENTRY.fullmatch(e.filename)]
    order = [e for e in entries if e.filename.endswith("/byteorder")]
    if len(storages) != 1 or storages[0].file_size != nbytes:
        return None
    begin = _entry_data(data, start, length, storages[0])
    byteorder = _entry_data(data, start, length, order[0]) if order else None
    if begin is None or (order and (byteorder is None or data[byteorder:byteorder + order[0].file_size]
                                    != sys.byteorder.encode())):
        return None
    return begin


def _entry_data(data, start: int, length: int, entry: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the uncompressed zip ``entry`` of the archive ``data[start:start + length]`` begin."""
    header = start + entry.header_offset
    if entry.compress_type != zipfile.ZIP_STORED or entry.header_offset + _ZIP_LOCAL_HEADER.size > length:
        return None
    magic, name_length, extra_length = _ZIP_LOCAL_HEADER.unpack(data[header:header + _ZIP_LOCAL_HEADER.size])
    begin = header + _ZIP_LOCAL_HEADER.size + name_length + extra_length
    if magic != b"PK\x03\x04" or begin + entry.file_size > start + length:
        return None
    return begin


class StoredChunks:
    """The stored chunks of one checkpoint as tensors over its memory-mapped data files.

    Each file is mapped once; with ``hashed`` its hash is checked against the manifest before any
    of its bytes are used (a collective load instead shares the hashing, :meth:`CheckpointReader.agree`).
    A chunk is a view of the map (no copy; the map lives as long as a view of it).  Nothing is
    unpickled: a record that is not one plain storage of the chunk is refused.
    """

    def __init__(self, directory: str, manifest: dict, metadata: dcp_metadata.Metadata, hashed: bool):
        self.directory, self.manifest, self.metadata, self.hashed = directory, manifest, metadata, hashed
        self._maps: dict[str, mmap.mmap] = {}
        self._tensors: dict = {}

    def _map(self, relative: str) -> mmap.mmap:
        if relative not in self._maps:
            path = os.path.join(self.directory, relative)
            with open_regular(path) as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: views may be writable
            if self.hashed:
                problem = check_file(path, self.manifest, len(data), lambda: mapped_digests(data))
                if problem:
                    raise ValueError(problem)
            self._maps[relative] = data
        return self._maps[relative]

    def drop_pages(self) -> None:
        """Drop the pages read so far from this process's mappings (the page cache keeps them; a later read maps
        them again): reading a checkpoint tensor by tensor then holds about one tensor, not the files.  The
        views are only read (the mappings are private but never written), so nothing is lost."""
        for data in self._maps.values():
            data.madvise(mmap.MADV_DONTNEED)

    def tensor(self, index: dcp_metadata.MetadataIndex) -> torch.Tensor:
        """The whole stored chunk of tensor ``index.fqn`` at ``index.offset``."""
        key = (index.fqn, tuple(index.offset))
        if key not in self._tensors:
            info = self.metadata.storage_data[dcp_metadata.MetadataIndex(index.fqn, index.offset)]
            if info.transform_descriptors:
                raise ValueError(f"{self.directory}/{info.relative_path} uses DCP storage transforms, which megalite "
                                 "checkpoints never use")
            md = self.metadata.state_dict_metadata[index.fqn]
            sizes = next(c.sizes for c in md.chunks if tuple(c.offsets) == key[1])
            dtype = md.properties.dtype
            nbytes = math.prod(sizes) * torch.empty((), dtype=dtype).element_size()
            data = self._map(info.relative_path)
            begin = _record_data(data, info.offset, info.length, nbytes)
            if begin is None:
                raise ValueError(f"checkpoint file {self.directory}/{info.relative_path} holds no plain record of "
                                 f"{index.fqn} at byte {info.offset} (corrupt, altered, or another byte order)")
            self._tensors[key] = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=begin).view(
                dtype).view(sizes)
        return self._tensors[key]


def overlapping_views(chunks: StoredChunks, name: str, saved, want) -> list:
    """``[(common box, view)]``: for each saved chunk of stored tensor ``name`` that overlaps the box ``want``, the
    common part (global coordinates) and that part as a view of the memory-mapped file (no copy)."""
    out = []
    for chunk in saved:
        common = intersect(want, tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.sizes)))
        if common is None:
            continue
        view = chunks.tensor(dcp_metadata.MetadataIndex(name, chunk.offsets))
        for dim, (lo, hi) in enumerate(common):
            view = view.narrow(dim, lo - chunk.offsets[dim], hi - lo)
        out.append((common, view))
    return out


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the allow-listed metadata unpickler, copying each chunk from :class:`StoredChunks`
    straight into its destination (one copy, any dtype)."""

    def __init__(self, chunks: StoredChunks):
        super().__init__(chunks.directory)
        self.chunks = chunks

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        return self.chunks.metadata

    def read_data(self, plan: LoadPlan, planner) -> torch.futures.Future:
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise ValueError(f"{self.path} holds non-tensor data, which megalite checkpoints never store")
            source = self.chunks.tensor(item.storage_index)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def read_dcp_metadata(directory: str, manifest: dict) -> dcp_metadata.Metadata:
    """The DCP metadata of ``directory``, every data file it names being a data file of ``manifest``.

    So every byte a load reads lies in a file of the checkpoint directory that the manifest's hashes cover
    (a ``relative_path`` pointing elsewhere, e.g. at another run's file, is refused).
    """
    path = os.path.join(directory, DCP_METADATA)
    source = open_regular(path, "checkpoint metadata")
    try:
        with source as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as err:
        raise ValueError(f"checkpoint metadata {path} is unreadable (truncated, corrupt or unsafe): {err}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"checkpoint metadata {path} is not DCP metadata")
    for info in metadata.storage_data.values():
        relative = getattr(info, "relative_path", None)
        if not (is_data_file(relative) and relative in manifest["files"]):
            raise ValueError(f"checkpoint metadata {path} names the data file {str(relative)[:80]!r}, which is not "
                             f"a data file of this directory listed in its {MANIFEST}")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata
