"""Checkpoint tensors on torch.distributed.checkpoint (DCP): the units written and read, and DCP's planners.

Tensors are stored under their global names (see :mod:`megalite.checkpoint.sharding`) as DCP chunks
(:class:`TensorShard`: a box of a global tensor at an offset), so ``dcp_to_torch_save`` or any DCP
loader sees whole global tensors, and a reader can fetch any region (:class:`Region`) under any
layout.  Each chunk is a ``torch.save`` record holding exactly one plain storage (:func:`_exact_storage`),
which :mod:`megalite.checkpoint.stored_chunks` reads back without unpickling anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass(frozen=True)
class TensorShard:
    """``tensor`` is the box of global tensor ``name`` (shape ``global_shape``) that starts at ``offset``.

    The one unit the format stores: TP/EP/ZeRO-1 pieces and DTensor local shards all become these.
    With ``load``, ``tensor`` is a meta tensor (the box's shape and dtype) and ``load()`` makes the data when
    the writer reaches the shard, a tensor nothing else uses: the writer frees it once written, so a
    conversion holds one such tensor at a time (:class:`ShardSavePlanner`).
    """

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor
    load: Callable[[], torch.Tensor] | None = None


class ShardSavePlanner(DefaultSavePlanner):
    """Writes each :class:`TensorShard` as one DCP chunk of its global tensor."""

    def __init__(self, shards: list[TensorShard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shards = {(s.name, tuple(s.offset)): s for s in shards}
        self._loaded: torch.Tensor | None = None

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
        shard = self._shards[(write_item.index.fqn, tuple(write_item.index.offset))]
        if shard.load is None:
            return _exact_storage(shard.tensor.detach())
        self._release()
        data = shard.load().detach()
        if data.shape != shard.tensor.shape or data.dtype != shard.tensor.dtype:
            raise ValueError(f"{shard.name} was planned as {shard.tensor.dtype} {tuple(shard.tensor.shape)} but "
                             f"made as {data.dtype} {tuple(data.shape)}")
        data = data.contiguous()
        if not data.untyped_storage().resizable() or data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone()  # a storage of exactly its bytes that _release may free
        self._loaded = data
        return data

    def _release(self) -> None:
        """Free the data of the lazy shard resolved last.

        DCP's file writer keeps a reference to every tensor of a file until the whole file is written; with
        the serial loader (:func:`megalite.checkpoint.writer.write_checkpoint` asks for it when a shard is
        lazy) it resolves an item only after writing the one before, so that one's memory can go.
        """
        if self._loaded is not None:
            self._loaded.untyped_storage().resize_(0)
            self._loaded = None


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor whose storage holds exactly its bytes.

    ``torch.save`` writes a tensor's whole storage, so DCP clones any view of a larger one; a
    contiguous view (a ZeRO-1 box of a flat shard, a row block of a parameter) instead gets a
    storage that aliases just its bytes, and is written without a copy.  Every saved record is
    thus one C-contiguous storage of exactly the chunk, which
    :func:`megalite.checkpoint.stored_chunks._record_data` relies on.
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


class RegionLoadPlanner(DefaultLoadPlanner):
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


@contextlib.contextmanager
def without_zip_crc():
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
def quiet_single_process():
    """Silence DCP's notice that a call without a process group runs in one process (which is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def first_line(err: Exception) -> str:
    failures = getattr(err, "failures", None)
    if failures:  # {rank: (exception, traceback summary)}
        err = next(iter(failures.values()))[0]
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
