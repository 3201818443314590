"""The on-disk checkpoint format: torch.distributed.checkpoint (DCP) chunks of global tensors, JSON state,
and a manifest of content hashes.

Layout under a save directory::

    latest                        the newest verified iteration, as text
    iter_0000100/.metadata        DCP: every global tensor's shape, dtype and saved chunks
    iter_0000100/__0_0.distcp     DCP: the chunks rank 0 wrote (one file per writing rank)
    iter_0000100/megalite.json    format tag, iteration, world size and rank 0's state (config, layout, ...)
    iter_0000100/rank_00000.json  each rank's own state (RNG streams), plain JSON
    iter_0000100/manifest.json    size of every other file and the sha256 of each of its 16 MiB blocks

Tensors are stored under their global names (see :mod:`megalite.checkpoint.sharding`) as DCP chunks
(:class:`TensorShard`: a box of a global tensor at an offset), so ``dcp_to_torch_save`` or any DCP
loader sees whole global tensors, and a reader can fetch any region under any layout.  Nothing is
pickled by megalite: state is JSON, each chunk is a ``torch.save`` record holding one plain storage,
copied from the file into place without unpickling anything (other records are refused), and the
DCP ``.metadata`` is unpickled with an allow-list of DCP's own metadata classes.

Writes are atomic and verified: every rank writes into ``iter_N.tmp`` and hashes its files while
fsyncing them; rank 0 collects the hashes, writes the manifest, renames the directory and only then
replaces ``latest``, fsyncing along the way.  A save killed at any moment leaves the previous checkpoint and pointer
intact; a failed write (disk full, I/O error) removes the partial directory and raises one
:class:`CheckpointWriteError`.  Loading checks the manifest first, so a missing, truncated or
altered file is one ValueError naming it, before anything is read into a model.  Hashes cover blocks
of :data:`HASH_BLOCK` bytes, so the ranks that load a checkpoint together each hash an equal share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import mmap
import os
import pickle
import re
import shutil
import struct
import sys
import threading
import warnings
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalite.checkpoint.sharding import box_slices, intersect

FORMAT = "megalite"
FORMAT_VERSION = 4
LATEST = "latest"
MANIFEST = "manifest.json"
META = "megalite.json"
DCP_METADATA = ".metadata"
HASH_BLOCK = 16 << 20
"""Files are hashed in blocks of this many bytes, so the ranks that load together can share the work."""
FLUSH_EVERY = 64 << 20
"""A data file being written starts flushing to disk every this many bytes."""

ARCHITECTURE_FIELDS = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "num_query_groups", "max_position_embeddings", "position_embedding_type", "rotary_base",
                       "normalization", "norm_eps", "activation", "add_bias_linear",
                       "untie_embeddings_and_output_weights", "moe_layer_freq")
MOE_ARCHITECTURE_FIELDS = ("num_experts", "ffn_hidden_size", "topk", "activation", "add_bias", "router_order")


class CheckpointWriteError(OSError):
    """A save failed (disk full, I/O error); its partial directory was removed and ``latest`` is unchanged."""


@dataclasses.dataclass(frozen=True)
class TensorShard:
    """``tensor`` is the box of global tensor ``name`` (shape ``global_shape``) that starts at ``offset``.

    The one unit the format stores: TP/EP/ZeRO-1 pieces and DTensor local shards all become these.
    """

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def rank_state_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.json")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, value, sync: bool = True) -> None:
    with open(path, "w") as f:
        json.dump(value, f, allow_nan=True)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def _block_digests(data) -> list[str]:
    """The sha256 of each :data:`HASH_BLOCK`-byte block of the buffer ``data``: a file's content hash."""
    with memoryview(data) as view:
        return [hashlib.sha256(view[start:start + HASH_BLOCK]).hexdigest() for start in range(0, len(view), HASH_BLOCK)]


def _sha256(path: str) -> list[str]:
    """The content hash of file ``path`` (the sha256 of each block, see :func:`_block_digests`)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _block_digests(data)


def _hash_and_sync(directory: str, names: list[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files ``names``, fsyncing them meanwhile.

    The hashing reads the page cache while the disk flushes, so it costs the save little time.
    """
    paths = [os.path.join(directory, name) for name in names]
    with ThreadPoolExecutor(max_workers=1) as pool:
        synced = pool.submit(lambda: [_fsync(path) for path in paths])
        files = {name: {"size": os.path.getsize(path), "sha256": _sha256(path)} for name, path in zip(names, paths)}
        synced.result()
    return files


def check_jsonable(value, what: str) -> None:
    """ValueError when ``value`` is not plain JSON data (dicts, lists, strings, numbers, booleans, None)."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be plain JSON data: {err}") from None


class _FlushingStream:
    """A write stream that starts flushing what it has written to disk every :data:`FLUSH_EVERY` bytes.

    A background ``fdatasync`` overlaps the disk writes with the rest of the serialization, so the
    fsync before publishing only waits for the tail instead of the whole file.
    """

    def __init__(self, stream, pool: ThreadPoolExecutor):
        self._stream, self._pool, self._unflushed, self._flush = stream, pool, 0, None

    def write(self, data):
        written = self._stream.write(data)
        self._unflushed += memoryview(data).nbytes
        if self._unflushed >= FLUSH_EVERY and (self._flush is None or self._flush.done()):
            self._stream.flush()
            self._flush, self._unflushed = self._pool.submit(os.fdatasync, self._stream.fileno()), 0
        return written

    def wait(self) -> None:
        if self._flush is not None:
            self._flush.result()

    def close(self) -> None:
        self.wait()
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _FlushingFileSystem(FileSystem):
    """DCP's local file system, writing through :class:`_FlushingStream`."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-flush") as pool:
                flushing = _FlushingStream(stream, pool)
                try:
                    yield flushing
                finally:
                    flushing.wait()


class _FlushingWriter(dcp.FileSystemWriter):
    """DCP's file writer, flushing each data file to disk as it goes; the final fsync of every file is
    :func:`_hash_and_sync`'s."""

    def __init__(self, path: str):
        super().__init__(path, sync_files=False)
        self.fs = _FlushingFileSystem()


class _ShardSavePlanner(DefaultSavePlanner):
    """Writes each :class:`TensorShard` as one DCP chunk of its global tensor."""

    def __init__(self, shards: list[TensorShard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shards = {(s.name, tuple(s.offset)): s for s in shards}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (name, offset), shard in self._shards.items():
            offsets = torch.Size(offset)
            items.append(WriteItem(
                index=dcp_metadata.MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=shard.tensor.size()),
                    properties=dcp_metadata.TensorProperties(dtype=shard.tensor.dtype),
                    size=torch.Size(shard.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return _exact_storage(self._shards[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach())


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor whose storage holds exactly its bytes.

    ``torch.save`` writes a tensor's whole storage, so DCP clones any view of a larger one; a
    contiguous view (a ZeRO-1 box of a flat shard, a row block of a parameter) instead gets a
    storage that aliases just its bytes, and is written without a copy.  Every saved record is
    thus one C-contiguous storage of exactly the chunk, which :func:`_record_data` relies on.
    """
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    view = tensor.untyped_storage()[start:start + tensor.nbytes]
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(view, 0, tensor.shape)


@dataclasses.dataclass(frozen=True)
class Region:
    """Read the box of global tensor ``name`` that starts at ``offset`` into ``out`` (any dtype)."""

    name: str
    offset: tuple[int, ...]
    out: torch.Tensor


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads :class:`Region` requests from the saved chunks that overlap them."""

    def __init__(self, regions: list[Region]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for i, region in enumerate(self._regions):
            chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(region.offset), sizes=region.out.size())
            for item in create_read_items_for_chunk_list(region.name, self.metadata.state_dict_metadata[region.name],
                                                         [chunk]):
                index = dcp_metadata.MetadataIndex(region.name, item.dest_index.offset, i)
                items.append(dataclasses.replace(item, dest_index=index))
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        out = self._regions[read_item.dest_index.index].out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, start, length)
        return out

    def commit_tensor(self, read_item, tensor) -> None:
        pass


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
    exactly the chunk (:func:`_exact_storage`), so its bytes are used in place, without
    unpickling the record.  Anything else (not such an archive, a storage of other than ``nbytes``
    bytes, another byte order) gives None.
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


class _Chunks:
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
            with open(path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: views may be writable
            if self.hashed:
                problem = check_file(path, self.manifest, len(data), lambda: _block_digests(data))
                if problem:
                    raise ValueError(problem)
            self._maps[relative] = data
        return self._maps[relative]

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


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the allow-listed metadata unpickler, copying each chunk from :class:`_Chunks`
    straight into its destination (one copy, any dtype)."""

    def __init__(self, chunks: _Chunks):
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


def read_dcp_metadata(directory: str) -> dcp_metadata.Metadata:
    path = os.path.join(directory, DCP_METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"{directory} has no DCP metadata file {DCP_METADATA}") from None
    except Exception as err:
        raise ValueError(f"checkpoint metadata {path} is unreadable (truncated, corrupt or unsafe): {err}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"checkpoint metadata {path} is not DCP metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


_NO_GROUP = object()
"""Marks a write by one process inside a distributed run: no collective at all."""


def _group_rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized() or group is _NO_GROUP:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(value, group):
    """Every rank's ``value`` (in-memory exchange between the job's own ranks)."""
    if _group_rank_and_size(group)[1] == 1:
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(save_dir: str, iteration: int, shards: list[TensorShard], state: dict | None,
                     rank_state: dict | None = None, *, group=None, collective: bool = True) -> str:
    """Write this rank's shards and state for ``iteration``, verify, and publish atomically.

    Collective over ``group`` (default: the default group, when one exists) unless
    ``collective`` is False (one process writes a whole checkpoint).  ``state`` is
    stored once, from group rank 0 (config, layout, scheduler, ...); ``rank_state`` per rank.
    Both must be plain JSON data.  Returns the final iteration directory; raises
    :class:`CheckpointWriteError` on every rank when any rank's write failed.
    """
    rank, world = _group_rank_and_size(group) if collective else (0, 1)
    if not collective:
        group = _NO_GROUP
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _remove(tmp)
            os.makedirs(tmp)
        except OSError as err:
            error = f"cannot create {tmp}: {err}"
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        raise CheckpointWriteError(f"saving iteration {iteration} failed: {errors[0]}")

    files, error = {}, None
    try:
        writer = _FlushingWriter(tmp)
        with _quiet_single_process(), _without_zip_crc():
            dcp.save({}, storage_writer=writer, planner=_ShardSavePlanner(shards),
                     process_group=None if group is _NO_GROUP else group, no_dist=world == 1)
        if rank == 0:
            _write_json(os.path.join(tmp, META), {"format": FORMAT, "version": FORMAT_VERSION,
                                                  "iteration": iteration, "world_size": world, **(state or {})},
                        sync=False)
        _write_json(rank_state_file(tmp, rank), rank_state or {}, sync=False)
        mine = sorted(n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")) + [os.path.basename(
            rank_state_file(tmp, rank))] + ([META, DCP_METADATA] if rank == 0 else [])
        files = _hash_and_sync(tmp, mine)
    except (Exception, CheckpointException) as err:  # DCP wraps any rank's error in a BaseException
        error = f"{type(err).__name__}: {_first_line(err)}"
    reports = _all_gather((error, files), group)
    errors = [e for e, _ in reports if e]
    if not errors:
        failure = None
        if rank == 0:
            try:
                manifest = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": iteration,
                            "block_size": HASH_BLOCK, "files": {}}
                for _, rank_files in reports:
                    manifest["files"].update(rank_files)
                _write_json(os.path.join(tmp, MANIFEST), manifest)
                _publish(save_dir, tmp, final, iteration)
            except OSError as err:
                failure = f"{type(err).__name__}: {err}"
        failure = _broadcast_from_zero(failure, group)
        errors = [failure] if failure else []
    if errors:
        if rank == 0:
            _remove(tmp)
        previous = read_latest(save_dir)
        raise CheckpointWriteError(f"saving iteration {iteration} to {save_dir} failed: {errors[0]}; the partial "
                                   f"{os.path.basename(tmp)} was removed and latest still names "
                                   f"{'no checkpoint' if previous is None else f'iteration {previous}'}")
    return final


@contextlib.contextmanager
def _without_zip_crc():
    """On the main thread, ``torch.save`` skips the zip CRC32 of each record (a second pass over every byte).

    The manifest's sha256 already covers every file and ``torch.load`` does not check the CRC.  The
    option is process-wide, so a background write (which runs beside training) leaves it alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


@contextlib.contextmanager
def _quiet_single_process():
    """Silence DCP's notice that a call without a process group runs in one process (which is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _first_line(err: Exception) -> str:
    failures = getattr(err, "failures", None)
    if failures:  # {rank: (exception, traceback summary)}
        err = next(iter(failures.values()))[0]
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _broadcast_from_zero(value, group):
    if _group_rank_and_size(group)[1] == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Move the complete ``tmp`` directory to ``final``, then point ``latest`` at it."""
    _fsync(tmp)
    previous = None
    if os.path.exists(final):
        previous = final + ".old"
        _remove(previous)
        os.rename(final, previous)
    os.rename(tmp, final)
    _fsync(save_dir)
    pointer = os.path.join(save_dir, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    _fsync(save_dir)
    if previous is not None:
        _remove(previous)


class AsyncSaver:
    """Runs checkpoint writes on a background thread, at most one in flight.

    Construct it on every rank at the same point (it creates a gloo group of its own, so the
    write's collectives never interleave with training's).  :meth:`stage` copies the shards to
    save into CPU buffers it keeps from one save to the next (so later copies find their memory
    ready); :meth:`submit` waits for the previous write, then starts ``fn(group)``; :meth:`wait`
    blocks until the write in flight is published and re-raises its error.
    """

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-checkpoint")
        self._future: Future | None = None
        self._staging: dict[tuple, torch.Tensor] = {}

    def stage(self, shards: list[TensorShard]) -> list[TensorShard]:
        """The shards with their tensors copied into this saver's buffers; call it with no write in flight."""
        if self.in_flight:
            raise RuntimeError("AsyncSaver.stage would overwrite the buffers of the write in flight; wait() first")
        staging, staged = {}, []
        for shard in shards:
            key = (shard.name, shard.offset)
            buffer = self._staging.get(key)
            if buffer is None or buffer.shape != shard.tensor.shape or buffer.dtype != shard.tensor.dtype:
                buffer = torch.empty(shard.tensor.shape, dtype=shard.tensor.dtype)
            staging[key] = buffer.copy_(shard.tensor)
            staged.append(dataclasses.replace(shard, tensor=buffer))
        self._staging = staging
        return staged

    def submit(self, fn) -> None:
        self.wait()
        self._future = self._executor.submit(fn, self.group)

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self) -> None:
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def read_latest(save_dir: str) -> int | None:
    """The iteration named by ``save_dir/latest``, or None when there is none."""
    pointer = os.path.join(save_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint pointer {pointer} is corrupt: {text[:40]!r} is not an iteration number")
    return int(text)


def resolve_directory(path: str) -> str:
    """The iteration directory of ``path``: a save directory (its ``latest``) or an iteration directory."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    iteration = read_latest(path)
    if iteration is None:
        if not os.path.isfile(os.path.join(path, MANIFEST)) and not os.path.isfile(os.path.join(path, DCP_METADATA)):
            raise ValueError(f"{path} holds no checkpoint: no 'latest' file and no {MANIFEST}")
        return path
    directory = iteration_dir(path, iteration)
    if not os.path.isdir(directory):
        raise ValueError(f"{path}/latest names iteration {iteration}, but {directory} does not exist")
    return directory


def _read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is unreadable (truncated or corrupt): {err}") from None


def read_manifest(directory: str) -> dict:
    """The manifest of a megalite checkpoint directory; ValueError for a foreign DCP directory."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(directory, DCP_METADATA)):
            raise ValueError(f"{directory} is a torch.distributed.checkpoint directory but not a megalite checkpoint "
                             f"(no {MANIFEST} or {META})")
        raise ValueError(f"{directory} holds no checkpoint: {MANIFEST} is missing")
    manifest = _read_json(path, "checkpoint manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} is not a megalite checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {manifest.get('version')}, this megalite reads {FORMAT_VERSION}")
    if manifest.get("block_size") != HASH_BLOCK:
        raise ValueError(f"{path} hashes blocks of {manifest.get('block_size')} bytes, this megalite {HASH_BLOCK}")
    return manifest


def check_file(path: str, manifest: dict, size: int, sha256) -> str | None:
    """The problem with file ``path`` of size ``size`` against the manifest (``sha256()`` gives its block
    digests), or None."""
    entry = manifest["files"].get(os.path.basename(path))
    if entry is None:
        return f"checkpoint file {path} is not listed in the manifest"
    if size != entry["size"]:
        return f"checkpoint file {path} has {size} bytes, the manifest records {entry['size']} (truncated or corrupt)"
    if sha256() != entry["sha256"]:
        return _corrupt(path)
    return None


def _corrupt(path: str) -> str:
    return f"checkpoint file {path} fails its content hash check (corrupt or altered); nothing was loaded"


def verify_blocks(directory: str, manifest: dict, blocks: list[tuple[str, int]]) -> str | None:
    """The first file among ``blocks`` (``(file name, block index)``, files of the recorded size) whose
    block fails its hash, or None."""
    by_file: dict[str, list[int]] = {}
    for name, index in blocks:
        by_file.setdefault(name, []).append(index)
    for name, indices in sorted(by_file.items()):
        path, digests = os.path.join(directory, name), manifest["files"][name]["sha256"]
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, \
                memoryview(data) as view:
            for index in indices:
                block = view[index * HASH_BLOCK:(index + 1) * HASH_BLOCK]
                intact = index < len(digests) and hashlib.sha256(block).hexdigest() == digests[index]
                block.release()  # the map closes below
                if not intact:
                    return _corrupt(path)
    return None


def verify_files(directory: str, manifest: dict, names=None, hashed: bool = True) -> str | None:
    """The first problem (missing file, wrong size, and with ``hashed`` wrong hash) among ``names`` (default:
    all), or None."""
    for name in sorted(manifest["files"] if names is None else names):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"checkpoint file {path} is missing"
        problem = check_file(path, manifest, os.path.getsize(path), (lambda: _sha256(path)) if hashed else (
            lambda: manifest["files"][name]["sha256"]))
        if problem:
            return problem
    return None


class CheckpointReader:
    """One checkpoint: its verified files, JSON state, global tensor shapes, and region reads through DCP.

    ``path`` is a save directory (its ``latest`` iteration is read) or an iteration directory.
    On opening, every file listed in the manifest must exist with its size, and the small files
    (metadata, JSON state) must match their hashes.  A data file's hash is checked when it is
    read, before its tensors are used; or, for a collective load, once by one rank of the group
    (:meth:`agree` with ``data``).  With ``collective`` (every rank of ``group`` opens the same
    checkpoint) the ranks share the outcome of opening and of :meth:`agree`, so all fail alike.
    Every problem raises ValueError naming the file.
    """

    def __init__(self, path: str, *, group=None, collective: bool = False, verify: bool = True):
        self.directory = resolve_directory(path)
        self.group, self.collective = group, collective
        manifest = read_manifest(self.directory)
        small = [name for name in manifest["files"] if not name.startswith("__")]
        problem = verify_files(self.directory, manifest, small if verify else [META])
        if verify:
            problem = problem or verify_files(self.directory, manifest, hashed=False)
        self.agree(problem)
        self.manifest = manifest
        meta = _read_json(os.path.join(self.directory, META), "checkpoint state")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{self.directory}/{META} is not megalite checkpoint state")
        self.state: dict = meta
        self.iteration: int = meta["iteration"]
        self.world_size: int = meta["world_size"]
        self.config_dict = meta.get("config")
        self.layout = meta.get("layout") or {}

    def agree(self, problem: str | None, *, data: bool = False) -> None:
        """Raise ValueError with the first rank's problem, on every rank (collective readers) or here.

        With ``data`` (after :meth:`read_regions` with ``hashed=False``) the data files are hashed
        first, an equal share of their blocks by each rank of a collective reader's group (all of
        them by a lone reader), and a failed hash is reported before any other problem (it is what
        made a read fail).
        """
        corrupt = None
        if data:
            rank, world = _group_rank_and_size(self.group) if self.collective else (0, 1)
            blocks = [(name, index) for name in sorted(n for n in self.manifest["files"] if n.startswith("__"))
                      for index in range(-(-self.manifest["files"][name]["size"] // HASH_BLOCK))]
            corrupt = verify_blocks(self.directory, self.manifest,
                                    blocks[rank * len(blocks) // world:(rank + 1) * len(blocks) // world])
        if self.collective:
            reports = _all_gather((corrupt, problem), self.group)
            corrupt = next((c for c, _ in reports if c), None)
            problem = next((p for _, p in reports if p), None)
        if corrupt or problem:
            raise ValueError(corrupt or problem)

    def verify_all(self) -> None:
        """Check every file's hash (``inspect`` does; loading checks the files it reads, or its share)."""
        self.agree(verify_files(self.directory, self.manifest))

    @functools.cached_property
    def metadata(self) -> dcp_metadata.Metadata:
        return read_dcp_metadata(self.directory)

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(md.size) for name, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, dcp_metadata.TensorStorageMetadata)}

    def dtype(self, name: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[name].properties.dtype

    def chunks(self, name: str) -> list:
        return list(self.metadata.state_dict_metadata[name].chunks)

    def rank_state(self, rank: int) -> dict:
        """The JSON state that ``rank`` saved for itself (e.g. its RNG streams)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"checkpoint {self.directory} was saved by {self.world_size} ranks, not rank {rank}")
        return _read_json(rank_state_file(self.directory, rank), "checkpoint rank state")

    @property
    def config(self):
        """The saved GPTConfig, or None for a model without one."""
        return None if self.config_dict is None else config_from_dict(self.config_dict)

    def check_architecture(self, config) -> None:
        """ValueError naming the first difference between the saved and the given GPTConfig."""
        if self.config_dict is None or config is None:
            return
        mismatch = architecture_mismatch(self.config_dict, config)
        if mismatch:
            raise ValueError(f"checkpoint {self.directory} holds a different architecture: {mismatch}")

    def has(self, name: str) -> bool:
        return name in self.metadata.state_dict_metadata

    def check_region(self, region: Region) -> None:
        """ValueError unless the saved chunks cover the whole requested region."""
        self._check_box(region.name, region.offset, tuple(region.out.shape))

    def _check_box(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if not self.has(name):
            raise ValueError(f"checkpoint {self.directory} has no tensor {name!r}")
        saved = self.shapes[name]
        want = tuple((o, o + s) for o, s in zip(offset, shape))
        if len(saved) != len(shape) or any(hi > size for (_, hi), size in zip(want, saved)):
            raise ValueError(f"{name}: region {want} lies outside the saved global shape {saved}")
        filled = 0
        for chunk in self.chunks(name):
            common = intersect(want, tuple((o, o + s) for o, s in zip(chunk.offsets, chunk.sizes)))
            if common is not None:
                filled += math.prod(hi - lo for lo, hi in common)
        if filled != math.prod(shape):
            raise ValueError(f"checkpoint {self.directory}: tensor {name!r} region {want} is covered for only "
                             f"{filled} of {math.prod(shape)} elements")

    def read_regions(self, regions: list[Region], *, hashed: bool = True) -> None:
        """Fill every region's ``out`` (checked first: nothing is read when one is not covered).

        Local to this rank (no collective); a collective caller then calls :meth:`agree`.  With
        ``hashed`` each data file read is hashed before its bytes are used; without, the caller
        must call ``agree(..., data=True)`` before it uses any ``out``.
        """
        self.read_views([], regions, hashed=hashed)

    def read_views(self, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]], regions: list[Region] = (), *,
                   hashed: bool = True) -> list[list[tuple[tuple[slice, ...], torch.Tensor]]]:
        """The boxes ``(name, offset, shape)`` of global tensors as views of the files, and fill ``regions``.

        Each box is a list ``[(index, view)]``, one per saved chunk it overlaps: ``view`` (in the
        stored dtype) is the part ``box[index]``, a view of the memory-mapped file (no copy: the
        caller copies it where it belongs, and must not write to it).  Hashing and agreement as
        for :meth:`read_regions`.
        """
        chunks = _Chunks(self.directory, self.manifest, self.metadata, hashed)
        views = []
        try:
            for name, offset, shape in boxes:
                self._check_box(name, offset, shape)
                want, parts = tuple((o, o + n) for o, n in zip(offset, shape)), []
                for chunk in self.chunks(name):
                    common = intersect(want, tuple((o, o + n) for o, n in zip(chunk.offsets, chunk.sizes)))
                    if common is None:
                        continue
                    view = chunks.tensor(dcp_metadata.MetadataIndex(name, chunk.offsets))
                    for dim, (lo, hi) in enumerate(common):
                        view = view.narrow(dim, lo - chunk.offsets[dim], hi - lo)
                    parts.append((box_slices(common, tuple(offset)), view))
                views.append(parts)
        except Exception as err:
            raise ValueError(f"reading {self.directory} failed: {_first_line(err)}") from None
        for region in regions:
            self.check_region(region)
        if regions:
            try:
                with _quiet_single_process():
                    dcp.load({}, storage_reader=_SafeReader(chunks), planner=_RegionLoadPlanner(list(regions)),
                             no_dist=True)
            except (Exception, CheckpointException) as err:  # DCP wraps any rank's error in a BaseException
                raise ValueError(f"reading {self.directory} failed: {_first_line(err)}") from None
        return views

    def read_all(self, names, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Whole global tensors ``names``."""
        out = {name: torch.empty(self.shapes[name] if self.has(name) else (), dtype=dtype or (
            self.dtype(name) if self.has(name) else torch.float32)) for name in names}
        self.read_regions([Region(name, (0,) * t.dim(), t) for name, t in out.items()])
        return out

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole global tensor ``name``."""
        return self.read_all([name], dtype)[name]


def config_to_dict(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


def config_from_dict(values: dict):
    """The GPTConfig (with its MoEConfig) saved by :func:`config_to_dict`."""
    from megalite.models import GPTConfig

    values = dict(values)
    if values.get("moe") is not None:
        from megalite.moe import MoEConfig

        values["moe"] = MoEConfig(**values["moe"])
    return GPTConfig(**values)


def architecture_mismatch(saved: dict, config) -> str | None:
    """The first architecture field where ``saved`` (a config dict) and ``config`` differ, in words."""
    current = config_to_dict(config)
    for name in ARCHITECTURE_FIELDS:
        if saved.get(name) != current.get(name):
            return f"{name} is {saved.get(name)!r} in the checkpoint but {current.get(name)!r} in the model"
    saved_moe, moe = saved.get("moe"), current.get("moe")
    if (saved_moe is None) != (moe is None):
        return (f"the checkpoint {'has' if saved_moe else 'has no'} MoE layers but the model "
                f"{'has' if moe else 'has none'}")
    for name in MOE_ARCHITECTURE_FIELDS if moe is not None else ():
        if saved_moe.get(name) != moe.get(name):
            return f"moe.{name} is {saved_moe.get(name)!r} in the checkpoint but {moe.get(name)!r} in the model"
    return None
