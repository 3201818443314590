"""The manifest: every file's size and the sha256 of each of its :data:`HASH_BLOCK`-byte blocks.

The writer hashes each file while it is fsynced (:func:`hash_and_sync`) and rank 0 writes the
manifest (:func:`write_manifest`).  A reader checks sizes and the small files' hashes on opening
and each data file's hash before its bytes are used; hashes cover blocks, so the ranks that load a
checkpoint together each hash an equal share (:func:`data_blocks`).  Every problem is a message
naming the file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

from megalite.checkpoint.files import (DCP_METADATA, FORMAT, FORMAT_VERSION, MANIFEST, META, fsync, is_regular,
                                       open_regular, read_json, write_json)

HASH_BLOCK = 16 << 20
"""Files are hashed in blocks of this many bytes, so the ranks that load together can share the work."""


def block_digests(data) -> list[str]:
    """The sha256 of each :data:`HASH_BLOCK`-byte block of the buffer ``data``: a file's content hash."""
    with memoryview(data) as view:
        return [hashlib.sha256(view[start:start + HASH_BLOCK]).hexdigest() for start in range(0, len(view), HASH_BLOCK)]


HASH_READ = 1 << 20
""":func:`hash_block` reads its block in pieces of this many bytes: a writer hashing beside its writes holds one
piece, not a block."""


def hash_block(fd: int, index: int) -> str:
    """The sha256 of block ``index`` of the open file ``fd`` (one entry of :func:`block_digests`), read with
    ``pread`` (the writer's own stream position is untouched) a piece at a time."""
    digest, start, end = hashlib.sha256(), index * HASH_BLOCK, (index + 1) * HASH_BLOCK
    for offset in range(start, end, HASH_READ):
        wanted = min(HASH_READ, end - offset)
        piece = os.pread(fd, wanted, offset)
        digest.update(piece)
        if len(piece) < wanted:  # the end of the file
            break
    return digest.hexdigest()


def file_digests(path: str) -> list[str]:
    """The content hash of file ``path`` (the sha256 of each block, see :func:`block_digests`).

    Each hashed block is dropped from this process's mapping at once (the page cache keeps it), so hashing a
    file adds about one block to the resident memory, not the file's size.
    """
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return mapped_digests(data)


def mapped_digests(data: mmap.mmap) -> list[str]:
    """The content hash of a memory-mapped file, dropping each hashed block from the mapping at once (the page
    cache keeps it; a later read maps it again), so hashing adds about one block to the resident memory."""
    digests = []
    for start in range(0, len(data), HASH_BLOCK):
        length = min(HASH_BLOCK, len(data) - start)
        digests += block_digests(memoryview(data)[start:start + length])
        first_page = start - start % mmap.PAGESIZE  # madvise needs a page-aligned start
        data.madvise(mmap.MADV_DONTNEED, first_page, start + length - first_page)
    return digests


def hash_and_sync(directory: str, names: list[str], known: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of the files ``names``, fsyncing them meanwhile.

    ``known``: block digests the writer computed as it wrote (see ``writer._FlushingStream``), used for a file
    whose size they cover exactly; other files are hashed here.  The hashing reads the page cache while the
    disk flushes, so it costs the save little time.
    """
    known = known or {}
    paths = [os.path.join(directory, name) for name in names]
    with ThreadPoolExecutor(max_workers=1) as pool:
        synced = pool.submit(lambda: [fsync(path) for path in paths])
        files = {}
        for name, path in zip(names, paths):
            size = os.path.getsize(path)
            digests = known.get(name)
            if digests is None or len(digests) != -(-size // HASH_BLOCK):
                digests = file_digests(path)
            files[name] = {"size": size, "sha256": digests}
        synced.result()
    return files


def write_manifest(directory: str, iteration: int, files: dict[str, dict]) -> None:
    """Write (and fsync) the manifest of ``directory`` from every rank's :func:`hash_and_sync` result."""
    write_json(os.path.join(directory, MANIFEST), {"format": FORMAT, "version": FORMAT_VERSION,
                                                   "iteration": iteration, "block_size": HASH_BLOCK,
                                                   "files": files})


def read_manifest(directory: str) -> dict:
    """The manifest of a megalite checkpoint directory; ValueError for a foreign DCP directory."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        if os.path.lexists(os.path.join(directory, DCP_METADATA)):
            raise ValueError(f"{directory} is a torch.distributed.checkpoint directory but not a megalite checkpoint "
                             f"(no {MANIFEST} or {META})")
        raise ValueError(f"{directory} holds no checkpoint: {MANIFEST} is missing")
    manifest = read_json(path, "checkpoint manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} is not a megalite checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {manifest.get('version')}, this megalite reads {FORMAT_VERSION}")
    if manifest.get("block_size") != HASH_BLOCK:
        raise ValueError(f"{path} hashes blocks of {manifest.get('block_size')} bytes, this megalite {HASH_BLOCK}")
    for name, entry in manifest["files"].items():
        if not is_plain_name(name):
            raise ValueError(f"{path} lists {name[:80]!r}, which is not a file name inside the checkpoint directory")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get("sha256"), list)):
            raise ValueError(f"{path}: the entry of {name} is not {{\"size\": bytes, \"sha256\": [block hashes]}}")
    return manifest


def is_plain_name(name) -> bool:
    """Whether ``name`` names a file directly inside a directory (no separator, not ``.`` or ``..``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def is_data_file(name) -> bool:
    """Whether ``name`` is the name of a DCP data file (``__<rank>_<n>.distcp``) in a checkpoint directory."""
    return is_plain_name(name) and name.startswith("__")


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
        try:
            source = open_regular(path)
        except ValueError as err:  # a problem to share with the other ranks, not to raise alone
            return str(err)
        with source as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, memoryview(data) as view:
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
        if not is_regular(path):
            return f"checkpoint file {path} is {'not a regular file' if os.path.lexists(path) else 'missing'}"
        problem = check_file(path, manifest, os.path.getsize(path), (lambda: file_digests(path)) if hashed else (
            lambda: manifest["files"][name]["sha256"]))
        if problem:
            return problem
    return None


def data_blocks(manifest: dict) -> list[tuple[str, int]]:
    """``(file name, block index)`` of every block of the data files, in a fixed order (for sharing out)."""
    return [(name, index) for name in sorted(n for n in manifest["files"] if is_data_file(n))
            for index in range(-(-manifest["files"][name]["size"] // HASH_BLOCK))]
