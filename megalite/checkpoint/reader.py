"""Reading a checkpoint: :class:`CheckpointReader`, verified files and region reads under any layout."""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.files import FORMAT, META, rank_state_file, read_json
from megalite.checkpoint.integrity import data_blocks, is_data_file, read_manifest, verify_blocks, verify_files
from megalite.checkpoint.locate import checkpoint_format, resolve_directory
from megalite.checkpoint.ranks import all_gather_object, rank_and_size
from megalite.checkpoint.sharding import box_slices, intersect
from megalite.checkpoint.storage import Region, RegionLoadPlanner, first_line, quiet_single_process
from megalite.checkpoint.stored_chunks import SafeReader, StoredChunks, overlapping_views, read_dcp_metadata
from megalite.models.architecture import compare_architecture, config_from_dict


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
        small = [name for name in manifest["files"] if not is_data_file(name)]
        problem = verify_files(self.directory, manifest, small if verify else [META])
        if verify:
            problem = problem or verify_files(self.directory, manifest, hashed=False)
        self.agree(problem)
        self.manifest = manifest
        meta = read_json(os.path.join(self.directory, META), "checkpoint state")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{self.directory}/{META} is not megalite checkpoint state")
        _check_state(os.path.join(self.directory, META), meta)
        self.state: dict = meta
        self.iteration: int = meta["iteration"]
        self.world_size: int = meta["world_size"]
        self.config_dict = meta.get("config")
        self.layout = meta.get("layout") or {}
        if self.config_dict is not None:
            try:
                config_from_dict(self.config_dict)
            except (TypeError, ValueError, KeyError) as err:
                raise ValueError(self.field_error("config", f"is not a GPTConfig this megalite can build: {err}"))

    def field_error(self, field: str, problem: str, rank: int | None = None) -> str:
        """The one error line for a bad ``field`` of this checkpoint's state (rank 0's, or ``rank``'s own file)."""
        return field_error(os.path.join(self.directory, META) if rank is None else rank_state_file(self.directory, rank),
                           field, problem)

    def agree(self, problem: str | None, *, data: bool = False) -> None:
        """Raise ValueError with the first rank's problem, on every rank (collective readers) or here.

        With ``data`` (after :meth:`read_regions` with ``hashed=False``) the data files are hashed
        first, an equal share of their blocks by each rank of a collective reader's group (all of
        them by a lone reader), and a failed hash is reported before any other problem (it is what
        made a read fail).
        """
        corrupt = None
        if data:
            rank, world = rank_and_size(self.group) if self.collective else (0, 1)
            blocks = data_blocks(self.manifest)
            corrupt = verify_blocks(self.directory, self.manifest,
                                    blocks[rank * len(blocks) // world:(rank + 1) * len(blocks) // world])
        if self.collective:
            reports = all_gather_object((corrupt, problem), self.group)
            corrupt = next((c for c, _ in reports if c), None)
            problem = next((p for _, p in reports if p), None)
        if corrupt or problem:
            raise ValueError(corrupt or problem)

    def verify_all(self) -> None:
        """Check every file's hash (``inspect`` does; loading checks the files it reads, or its share)."""
        self.agree(verify_files(self.directory, self.manifest))

    @functools.cached_property
    def metadata(self) -> dcp_metadata.Metadata:
        return read_dcp_metadata(self.directory, self.manifest)

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
        state = read_json(rank_state_file(self.directory, rank), "checkpoint rank state")
        if not isinstance(state, dict):
            raise ValueError(f"checkpoint rank state {rank_state_file(self.directory, rank)} is not a JSON object")
        return state

    @property
    def config(self):
        """The saved GPTConfig, or None for a model without one."""
        return None if self.config_dict is None else config_from_dict(self.config_dict)

    def check_architecture(self, config) -> None:
        """ValueError naming every architecture field where the saved and the given GPTConfig differ."""
        if self.config_dict is None or config is None:
            return
        differences = compare_architecture(self.config, config)
        if differences:
            raise ValueError(f"checkpoint {self.directory} holds a different architecture: " + "; ".join(
                f"{d.field} is {d.saved!r} in the checkpoint but {d.current!r} in the model" for d in differences))

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
        chunks = StoredChunks(self.directory, self.manifest, self.metadata, hashed)
        views = []
        try:
            for name, offset, shape in boxes:
                self._check_box(name, offset, shape)
                want = tuple((o, o + n) for o, n in zip(offset, shape))
                views.append([(box_slices(common, tuple(offset)), view)
                              for common, view in overlapping_views(chunks, name, self.chunks(name), want)])
        except Exception as err:
            raise ValueError(f"reading {self.directory} failed: {first_line(err)}") from None
        for region in regions:
            self.check_region(region)
        if regions:
            self._fill(chunks, regions)
        return views

    def _fill(self, chunks: StoredChunks, regions) -> None:
        try:
            with quiet_single_process():
                dcp.load({}, storage_reader=SafeReader(chunks), planner=RegionLoadPlanner(list(regions)), no_dist=True)
        except (Exception, CheckpointException) as err:  # DCP wraps any rank's error in a BaseException
            raise ValueError(f"reading {self.directory} failed: {first_line(err)}") from None

    def read_each(self, names, dtype: torch.dtype | None = None):
        """``(name, whole global tensor)`` for each of ``names``, read when the caller takes it.

        For streaming a checkpoint through (conversion): each data file is mapped and hashed once, and the
        pages a tensor was copied from are dropped from this process's memory at once, so memory holds about
        the tensor being taken rather than the files.
        """
        chunks = StoredChunks(self.directory, self.manifest, self.metadata, hashed=True)
        for name in names:
            out = torch.empty(self.shapes[name] if self.has(name) else (),
                              dtype=dtype or (self.dtype(name) if self.has(name) else torch.float32))
            region = Region(name, (0,) * out.dim(), out)
            self.check_region(region)
            self._fill(chunks, [region])
            chunks.drop_pages()
            yield name, out

    def read_all(self, names, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Whole global tensors ``names``."""
        out = {name: torch.empty(self.shapes[name] if self.has(name) else (), dtype=dtype or (
            self.dtype(name) if self.has(name) else torch.float32)) for name in names}
        self.read_regions([Region(name, (0,) * t.dim(), t) for name, t in out.items()])
        return out

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole global tensor ``name``."""
        return self.read_all([name], dtype)[name]


def open_reader(path: str, *, group=None, collective: bool = False, verify: bool = True):
    """The reader of the checkpoint ``path`` names, whatever its format: a :class:`CheckpointReader`, or a
    :class:`megalite.checkpoint.megatron_dist.MegatronDistReader` for a Megatron-LM torch_dist checkpoint.

    A legacy Megatron-LM checkpoint (``mp_rank_XX/model_optim_rng.pt``) needs unpickling, which no load path
    does: the error says to convert it first.
    """
    from megalite.checkpoint.megatron_dist import MegatronDistReader

    directory = resolve_directory(path)
    kind = checkpoint_format(directory)
    if kind == "megatron_dist":
        return MegatronDistReader(directory, group=group, collective=collective, verify=verify)
    if kind == "megatron_legacy":
        raise ValueError(f"{directory} is a legacy Megatron-LM checkpoint (mp_rank_XX/model_optim_rng.pt), which only "
                         "unpickling can read: convert it first with tools/convert_checkpoint.py --from megatron "
                         "--allow-pickle")
    return CheckpointReader(directory, group=group, collective=collective, verify=verify)


def field_error(path: str, field: str, problem: str) -> str:
    """The one error line for a bad ``field`` of the JSON state file ``path`` (edited with its manifest)."""
    return f"checkpoint state {path}: field {field!r} {problem}"


def _is_count(value, least: int = 0) -> bool:
    return type(value) is int and value >= least


_STATE_FIELDS = {
    "iteration": ("a count", _is_count),
    "world_size": ("a positive count", lambda v: _is_count(v, 1)),
    "config": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "layout": ("an object of sizes and switches", lambda v: v is None or (isinstance(v, dict) and all(
        x is None or isinstance(x, (int, str)) for x in v.values()))),
    "optimizer": ("null or an object with num_steps (a count), scaler and param_groups (a list of objects)",
                  lambda v: v is None or (isinstance(v, dict) and _is_count(v.get("num_steps"))
                                          and (v.get("scaler") is None or isinstance(v.get("scaler"), dict))
                                          and isinstance(v.get("param_groups"), list)
                                          and all(isinstance(g, dict) for g in v["param_groups"]))),
    # The trainer's own fields (megalite.training.checkpointing), checked here so every reader fails alike.
    "consumed_samples": ("a count", _is_count),
    "scheduler": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "args": ("an object or null", lambda v: v is None or isinstance(v, dict)),
}


def _check_state(path: str, meta: dict) -> None:
    """ValueError naming ``path`` and the field when rank 0's state has a field of the wrong kind."""
    for field, (kind, valid) in _STATE_FIELDS.items():
        if field not in meta and field not in ("iteration", "world_size"):
            continue
        if not valid(meta.get(field)):
            raise ValueError(field_error(path, field, f"is {repr(meta.get(field))[:60]}, not {kind}"))
