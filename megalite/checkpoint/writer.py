"""Atomic, verified checkpoint writes, in the foreground or on a background thread.

Every rank writes into ``iter_N.tmp`` and hashes its files as it writes them (each block on a helper thread
once it is written) and fsyncs them; rank 0 collects the
hashes, writes the manifest, renames the directory and only then replaces ``latest``, fsyncing along
the way.  A save killed at any moment leaves the previous checkpoint and pointer intact; a failed
write (disk full, I/O error) removes the partial directory and raises one :class:`CheckpointWriteError`
on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from megalite.checkpoint.files import (DCP_METADATA, FORMAT, FORMAT_VERSION, LATEST, META, fsync, iteration_dir,
                                       rank_state_file, read_latest, write_json)
from megalite.checkpoint.integrity import HASH_BLOCK, hash_and_sync, hash_block, write_manifest
from megalite.checkpoint.ranks import NO_GROUP, all_gather_object, broadcast_from_zero, rank_and_size
from megalite.checkpoint.storage import ShardSavePlanner, TensorShard, first_line, quiet_single_process, without_zip_crc

FLUSH_EVERY = 64 << 20
"""A data file being written starts flushing to disk every this many bytes."""


class _FlushingStream:
    """A write stream that starts flushing what it has written to disk every :data:`FLUSH_EVERY` bytes and hashes
    each :data:`HASH_BLOCK` of the file as soon as it is written.

    A background ``fdatasync`` overlaps the disk writes with the rest of the serialization, so the
    fsync before publishing only waits for the tail instead of the whole file; a second thread reads each
    finished block back from the page cache and hashes it (sha256 releases the GIL), so the manifest's hashes
    cost the save no pass of their own.  DCP writes a file front to back: a seek gives up the hashes (the
    file is then hashed after the write).
    """

    def __init__(self, stream, path, pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor], errors: list[OSError]):
        self._stream, self._path, self._errors = stream, path, errors
        self._flush_pool, self._hash_pool = pools
        self._unflushed, self._flush, self._written, self._blocks = 0, None, 0, []
        self._reader: int | None = None
        self._sequential = True

    def write(self, data):
        try:
            written = self._stream.write(data)
        except OSError as err:  # torch.save reports only a short write ("unexpected pos"): keep the cause
            self._errors.append(err)
            raise
        nbytes = memoryview(data).nbytes
        self._unflushed += nbytes
        self._written += nbytes
        if self._sequential and self._written >= (len(self._blocks) + 1) * HASH_BLOCK:
            self._stream.flush()
            self._hash_blocks(self._written // HASH_BLOCK)
        if self._unflushed >= FLUSH_EVERY and (self._flush is None or self._flush.done()):
            self._stream.flush()
            self._flush, self._unflushed = self._flush_pool.submit(os.fdatasync, self._stream.fileno()), 0
        return written

    def _hash_blocks(self, count: int) -> None:
        """Queue the hashing of the written (and flushed) blocks up to ``count``."""
        if self._reader is None:
            self._reader = os.open(self._path, os.O_RDONLY)
        while len(self._blocks) < count:
            self._blocks.append(self._hash_pool.submit(hash_block, self._reader, len(self._blocks)))

    def seek(self, *args):
        self._sequential = False
        return self._stream.seek(*args)

    def digests(self) -> list[str] | None:
        """The file's block digests once every write is done (None after a seek)."""
        if not self._sequential:
            return None
        if not self._stream.closed:  # DCP may close the file itself, which flushes it
            self._stream.flush()
            if self._stream.tell() != self._written:
                return None
        self._hash_blocks(-(-self._written // HASH_BLOCK))
        return [block.result() for block in self._blocks]

    def wait(self) -> None:
        """Wait for the background flush and hashing (the read descriptor is closed after)."""
        try:
            if self._flush is not None:
                self._flush.result()
            for block in self._blocks:
                block.exception()
        finally:
            if self._reader is not None:
                os.close(self._reader)
                self._reader = None

    def close(self) -> None:
        self.wait()
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _FlushingFileSystem(FileSystem):
    """DCP's local file system, writing through :class:`_FlushingStream`; ``write_errors`` keeps what the
    streams' writes raised, ``digests`` the block digests of each file written to its end (by file name)."""

    def __init__(self):
        super().__init__()
        self.write_errors: list[OSError] = []
        self.digests: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-flush") as flush_pool, \
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-hash") as hash_pool:
                flushing = _FlushingStream(stream, path, (flush_pool, hash_pool), self.write_errors)
                try:
                    yield flushing
                    digests = flushing.digests()
                    if digests is not None:
                        self.digests[os.path.basename(path)] = digests
                finally:
                    flushing.wait()


class _FlushingWriter(dcp.FileSystemWriter):
    """DCP's file writer, flushing each data file to disk as it goes; the final fsync of every file is
    :func:`hash_and_sync`'s.  ``serial``: resolve each tensor only after writing the one before (no copying
    ahead from a GPU), as lazily made shards need (:class:`~megalite.checkpoint.storage.ShardSavePlanner`)."""

    def __init__(self, path: str, serial: bool = False):
        super().__init__(path, sync_files=False, **({"per_thread_copy_ahead": 0} if serial else {}))
        self.fs = _FlushingFileSystem()


class CheckpointWriteError(OSError):
    """A save failed (disk full, I/O error); its partial directory was removed and ``latest`` is unchanged."""


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _no_space(err: BaseException, write_errors: list[OSError]) -> bool:
    """Whether the failed write ``err`` (DCP wraps each rank's error) ran out of disk space or quota."""
    seen, pending = [], [err, *write_errors]
    while pending:
        e = pending.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        pending += [e.__cause__, e.__context__, *(f[0] for f in (getattr(e, "failures", None) or {}).values()
                                                  if isinstance(f, tuple))]
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in seen)


def _no_space_message(save_dir: str, needed: int) -> str:
    return f"no space left on {save_dir} (needed about {-(-needed // 2 ** 20)} MiB)"


def write_checkpoint(save_dir: str, iteration: int, shards: list[TensorShard], state: dict | None,
                     rank_state: dict | None = None, *, group=None, collective: bool = True) -> str:
    """Write this rank's shards and state for ``iteration``, verify, and publish atomically.

    Collective over ``group`` (default: the default group, when one exists) unless
    ``collective`` is False (one process writes a whole checkpoint).  ``state`` is
    stored once, from group rank 0 (config, layout, scheduler, ...); ``rank_state`` per rank.
    Both must be plain JSON data.  Returns the final iteration directory; raises
    :class:`CheckpointWriteError` on every rank when any rank's write failed.
    """
    rank, world = rank_and_size(group) if collective else (0, 1)
    if not collective:
        group = NO_GROUP
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
    started = all_gather_object((error, sum(shard.tensor.nbytes for shard in shards)), group)
    errors = [e for e, _ in started if e]
    if errors:
        raise CheckpointWriteError(f"saving iteration {iteration} failed: {errors[0]}")
    needed = sum(nbytes for _, nbytes in started)

    files, error, writer = {}, None, None
    try:
        writer = _FlushingWriter(tmp, serial=any(shard.load is not None for shard in shards))
        with quiet_single_process(), without_zip_crc():
            dcp.save({}, storage_writer=writer, planner=ShardSavePlanner(shards),
                     process_group=None if group is NO_GROUP else group, no_dist=world == 1)
        if rank == 0:
            write_json(os.path.join(tmp, META), {"format": FORMAT, "version": FORMAT_VERSION,
                                                  "iteration": iteration, "world_size": world, **(state or {})},
                        sync=False)
        write_json(rank_state_file(tmp, rank), rank_state or {}, sync=False)
        mine = sorted(n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")) + [os.path.basename(
            rank_state_file(tmp, rank))] + ([META, DCP_METADATA] if rank == 0 else [])
        files = hash_and_sync(tmp, mine, writer.fs.digests)
    except (Exception, CheckpointException) as err:  # DCP wraps any rank's error in a BaseException
        if _no_space(err, writer.fs.write_errors if writer is not None else []):
            error = _no_space_message(save_dir, needed)
        else:
            error = f"{type(err).__name__}: {first_line(err)}"
    reports = all_gather_object((error, files), group)
    errors = [e for e, _ in reports if e]
    if not errors:
        failure = None
        if rank == 0:
            try:
                write_manifest(tmp, iteration, {name: entry for _, rank_files in reports
                                                for name, entry in rank_files.items()})
                _publish(save_dir, tmp, final, iteration)
            except OSError as err:
                failure = _no_space_message(save_dir, needed) if _no_space(err, []) else f"{type(err).__name__}: {err}"
        failure = broadcast_from_zero(failure, group)
        errors = [failure] if failure else []
    if errors:
        if rank == 0:
            _remove(tmp)
        previous = read_latest(save_dir)
        raise CheckpointWriteError(f"saving iteration {iteration} to {save_dir} failed: {errors[0]}; the partial "
                                   f"{os.path.basename(tmp)} was removed and latest still names "
                                   f"{'no checkpoint' if previous is None else f'iteration {previous}'}")
    return final


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Move the complete ``tmp`` directory to ``final``, then point ``latest`` at it."""
    fsync(tmp)
    previous = None
    if os.path.exists(final):
        previous = final + ".old"
        _remove(previous)
        os.rename(final, previous)
    os.rename(tmp, final)
    fsync(save_dir)
    pointer = os.path.join(save_dir, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    fsync(save_dir)
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
