"""Megatron-LM ``torch_dist`` checkpoints (Megatron-Core ``dist_checkpointing``) read as megalite global tensors.

An iteration directory Megatron-LM writes with ``--ckpt-format torch_dist`` holds ``metadata.json``
(``sharded_backend: torch_dist``), ``common.pt`` (``args``, ``iteration``, ``checkpoint_version``: the
state no rank shards) and a torch.distributed.checkpoint directory (``.metadata`` and ``__R_I.distcp``).
Its tensors are already global and layout-free, in the layout megalite's own checkpoints use, under Megatron's
keys (stacked layers, expert and Transformer-Engine names, a padded vocabulary; with ``singleton_local_shards``
each expert and each SwiGLU fc1 half a tensor of its own), which :mod:`megalite.checkpoint.megatron_names` maps to
megalite's names (:meth:`MegatronDistReader.placed_chunks`: each saved chunk's place in megalite's tensor).

Megatron-Core's optimizer state per parameter, ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<parameter>``
in the parameter's layout, becomes megalite's ``optimizer.<exp_avg|exp_avg_sq|main>.<name>`` the same way;
the Adam step (``common_step``) and the parameter groups come from ``common.pt``'s ``optimizer`` entry, so
``--load`` resumes Adam where Megatron left it.  The distributed optimizer's flat per-bucket state
('dp_reshardable') is mapped to the same names (:mod:`megalite.checkpoint.megatron_distopt`).  A saved
optimizer state that cannot be resumed that way is left out with the reason in
:attr:`MegatronDistReader.optimizer_note` (:mod:`megalite.checkpoint.megatron_optim`).
Megatron-LM's RNG states are each rank's :meth:`MegatronDistReader.rank_state` (:mod:`megalite.checkpoint.megatron_rng`).

:class:`MegatronDistReader` answers the calls :func:`megalite.checkpoint.state.load_into` makes, so
``--load``, ``load_model`` and ``inspect`` read only the regions each rank holds, at any layout.
Nothing is unpickled beyond data: ``.metadata`` with an allow-list of DCP's classes, ``common.pt``
with every class replaced by an inert record and only small tensors read (:func:`read_common`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pickle
import zipfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.files import DCP_METADATA, open_regular
from megalite.checkpoint.locate import MEGATRON_DIST_METADATA, resolve_directory
from megalite.checkpoint.ranks import all_gather_object
from megalite.checkpoint.sharding import box_slices, intersect, place
from megalite.checkpoint.megatron_args import config_from_megatron_args
from megalite.checkpoint.megatron_distopt import PREFIX as DISTRIBUTED_PREFIX, distributed_optimizer, dp_reshardable
from megalite.checkpoint.megatron_names import Part, Source, map_names
from megalite.checkpoint.megatron_optim import resumable_optimizer
from megalite.checkpoint.megatron_pickle import read_sharded_object, unpickle_data
from megalite.checkpoint.storage import Region, RegionLoadPlanner, first_line, quiet_single_process
from megalite.checkpoint.stored_chunks import SafeReader, StoredChunks, _MetadataUnpickler, overlapping_views
from megalite.models.architecture import compare_architecture

COMMON = "common.pt"
# DCP's save-plan classes, which Megatron-Core's planner keeps in ``.metadata`` (plain dataclasses and an enum).
_PLAN_CLASSES = {("torch.distributed.checkpoint.planner", name)
                 for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}


class _MegatronMetadataUnpickler(_MetadataUnpickler):
    def find_class(self, module, name):
        if (module, name) in _PLAN_CLASSES:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)


def read_common(directory: str) -> dict:
    """``common.pt`` of a torch_dist directory as plain data (args as a dict), without running pickled code."""
    path = os.path.join(directory, COMMON)
    try:
        with open_regular(path, "Megatron-LM common state") as f, zipfile.ZipFile(f) as archive:
            common = unpickle_data(archive)
    except ValueError as err:
        raise ValueError(f"Megatron-LM common state {path} is unreadable: {err}") from None
    except Exception as err:  # zipfile and pickle raise many kinds on a truncated or foreign file
        raise ValueError(f"Megatron-LM common state {path} is unreadable (truncated or corrupt): {err}") from None
    if not isinstance(common, dict):
        raise ValueError(f"Megatron-LM common state {path} is not a dict")
    if isinstance(common.get("args"), argparse.Namespace):
        common["args"] = vars(common["args"])
    return common


def config_from_common_args(args: dict, where: str):
    """The GPTConfig of Megatron-LM's saved ``args`` (:func:`megatron_args.config_from_megatron_args`, the one
    mapping), naming ``where`` in its errors.  Without ``args.vocab_size`` (Megatron-LM then took it from the
    tokenizer) the padded size is the vocabulary: Megatron's softmax runs over every padded row, so that size
    reproduces its losses; the converter's ``--vocab-size`` is the way to drop the padding rows."""
    vocab = None if args.get("vocab_size") is not None else args.get("padded_vocab_size")
    try:
        return config_from_megatron_args(args, vocab)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


class MegatronDistReader:
    """A Megatron-LM torch_dist checkpoint seen as megalite's global tensors (the interface of
    :class:`megalite.checkpoint.reader.CheckpointReader` that loading, ``inspect`` and conversion use).

    ``path`` is a Megatron-LM save directory (its ``latest_checkpointed_iteration.txt``) or iteration
    directory.  Every data file the DCP metadata names must exist, else ValueError naming it.  With
    ``collective`` the ranks of ``group`` share every outcome (:meth:`agree`), so all fail alike.
    """

    def __init__(self, path: str, *, group=None, collective: bool = False, verify: bool = True):
        self.directory = resolve_directory(path)
        self.group, self.collective = group, collective
        problem = None
        try:
            self._open()
        except ValueError as err:
            problem = str(err)
        self.agree(problem)

    def _open(self) -> None:
        where = self.directory
        backend = _read_json(os.path.join(where, MEGATRON_DIST_METADATA))
        if backend.get("sharded_backend") not in ("torch_dist", "torch"):
            raise ValueError(f"{where}/{MEGATRON_DIST_METADATA}: sharded_backend {backend.get('sharded_backend')!r} "
                             "is not torch_dist, the only Megatron-Core backend megalite reads")
        common = read_common(where)
        args = common.get("args")
        if not isinstance(args, dict):
            raise ValueError(f"{where}/{COMMON} holds no Megatron-LM args, so the architecture is unknown")
        self.args = args
        self.iteration = int(common.get("iteration") or 0)
        self.config_dict = None
        self._config = config_from_common_args(args, f"{where}/{COMMON}")
        tp, pp = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
        self.world_size = int(args.get("world_size") or tp * pp)
        # The keys of megalite's trainer layout, so that a run at Megatron's layout restores its RNG states.
        self.layout = {"tp": tp, "pp": pp, "dp": args.get("data_parallel_size"),
                       "cp": args.get("context_parallel_size") or 1, "ep": args.get("expert_model_parallel_size", 1),
                       "vpp": args.get("virtual_pipeline_model_parallel_size"),
                       "distributed_optimizer": bool(args.get("use_distributed_optimizer")),
                       "fsdp2": bool(args.get("use_torch_fsdp2"))}
        self.state = {"format": "megatron_dist", "iteration": self.iteration, "world_size": self.world_size,
                      "optimizer": None, "scheduler": None, "args": None,
                      "consumed_samples": int(args.get("consumed_train_samples") or 0),
                      "megatron_checkpoint_version": common.get("checkpoint_version"),
                      "megatron_scheduler": plain_dict(common.get("opt_param_scheduler"))}
        metadata_path = os.path.join(where, DCP_METADATA)
        try:
            with open_regular(metadata_path, "checkpoint metadata") as f:
                self.metadata = _MegatronMetadataUnpickler(f).load()
        except ValueError:
            raise
        except Exception as err:
            raise ValueError(f"checkpoint metadata {metadata_path} is unreadable (truncated, corrupt or unsafe): "
                             f"{err}") from None
        if not isinstance(self.metadata, dcp_metadata.Metadata):
            raise ValueError(f"checkpoint metadata {metadata_path} is not DCP metadata")
        for relative in sorted({info.relative_path for info in self.metadata.storage_data.values()}):
            if os.path.basename(relative) != relative or not os.path.isfile(os.path.join(where, relative)):
                raise ValueError(f"Megatron-LM checkpoint {where} is incomplete: shard file {relative}, named in its "
                                 f"{DCP_METADATA}, is missing")
        self._sources = map_names(self.metadata, self._config.vocab_size, where)
        self._flat = {}
        saved = common.get("optimizer")
        if dp_reshardable(saved):
            self.state["optimizer"], self.optimizer_note = self._distributed_optimizer(dp_reshardable(saved))
        else:
            self.state["optimizer"], self.optimizer_note = resumable_optimizer(
                saved, {name: source.shape for name, source in self._sources.items()})
        self.state["optimizer_note"] = self.optimizer_note

    def _distributed_optimizer(self, prefixes: list[str]) -> tuple[dict | None, str | None]:
        """Map the distributed optimizer's flat bucket state onto megalite's optimizer tensors
        (:mod:`megalite.checkpoint.megatron_distopt`): ``(megalite's optimizer JSON state, None)`` or
        ``(None, why not)``."""
        md = self.metadata.state_dict_metadata
        model = {name: source for name, source in self._sources.items() if not name.startswith("optimizer.")}
        buckets = {key: m.size[0] for key, m in md.items()
                   if key.startswith(tuple(p + DISTRIBUTED_PREFIX for p in prefixes))
                   and isinstance(m, dcp_metadata.TensorStorageMetadata)}
        try:
            saved = [read_sharded_object(self.directory, self.metadata, f"{p}{DISTRIBUTED_PREFIX}0.optimizer/shard_0_1")
                     for p in prefixes]
        except Exception as err:  # zipfile and pickle raise many kinds on a damaged object
            raise ValueError(f"Megatron-LM distributed optimizer state in {self.directory} is unreadable: "
                             f"{type(err).__name__}: {err}") from None
        self._flat, meta, note = distributed_optimizer(self.args, self._config, self.megatron_shapes(), buckets, saved)
        for name, parts in self._flat.items():
            shape = model[name.split(".", 2)[2]].shape
            self._sources[name] = Source((Part(parts[0][0], (), (0,) * len(shape), False),), shape)
        return meta, note

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every model tensor's global shape as Megatron holds it (megalite names; the vocabulary padded; a tensor
        saved in singleton shards (:mod:`megalite.checkpoint.megatron_names`) as the whole Megatron-Core holds)."""
        md = self.metadata.state_dict_metadata
        return {name: tuple(md[parts[0].key].size[len(parts[0].lead):]) if len(parts) == 1 and not parts[0].expert
                else shape for name, (parts, shape) in self._sources.items() if not name.startswith("optimizer.")}

    def flat_tensor(self, name: str, chunks: StoredChunks | None = None) -> torch.Tensor:
        """The distributed optimizer's state tensor ``name`` (a key of :attr:`_flat`), its model-parallel ranks'
        local shards each gathered from the DP ranks' shares of its flat bucket and placed in the global tensor
        (a copy)."""
        chunks = chunks or StoredChunks(self.directory, {"files": {}}, self.metadata, hashed=False)
        out = torch.empty(self._sources[name].shape, dtype=self.dtype(name))
        placed = 0
        for key, start, shape, pieces, transposed in self._flat[name]:
            local = torch.empty(math.prod(shape), dtype=out.dtype)
            filled = 0
            for ((lo, hi),), view in overlapping_views(chunks, key, self.metadata.state_dict_metadata[key].chunks,
                                                       ((start, start + local.numel()),)):
                local[lo - start:hi - start] = view
                filled += hi - lo
            if filled != local.numel():
                raise ValueError(f"Megatron-LM checkpoint {self.directory}: {key} covers only {filled} of the "
                                 f"{local.numel()} elements of a shard of {name}")
            local = local.view(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2) if transposed else local.view(shape)
            placed += place(out, local, pieces)
        if placed != out.numel():
            raise ValueError(f"Megatron-LM checkpoint {self.directory}: its buckets hold only {placed} of the "
                             f"{out.numel()} elements of {name}")
        return out

    # The interface load_into, inspect and the converters use.
    @property
    def config(self):
        return self._config

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: source.shape for name, source in self._sources.items()}

    def has(self, name: str) -> bool:
        return name in self._sources

    def dtype(self, name: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[self._sources[name].parts[0].key].properties.dtype

    def chunks(self, name: str) -> list:
        """The saved chunks of ``name`` in megalite's coordinates."""
        return [dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size))
                for _, _, offset, size in self.placed_chunks(name)]

    def placed_chunks(self, name: str) -> list[tuple[Part, dcp_metadata.ChunkStorageMetadata, tuple, tuple]]:
        """``[(part, saved chunk, its offset, its shape)]``: every saved chunk of model or optimizer tensor ``name``
        (a key of :data:`_sources`), placed in megalite's global tensor (its vocabulary rows uncut)."""
        md, placed = self.metadata.state_dict_metadata, []
        for part in self._sources[name].parts:
            lead = len(part.lead)
            for chunk in md[part.key].chunks:
                if all(o <= i < o + s for o, s, i in zip(chunk.offsets, chunk.sizes, part.lead)):
                    offset = (0,) * part.expert + tuple(chunk.offsets)[lead:]
                    placed.append((part, chunk, tuple(p + o for p, o in zip(part.offset, offset)),
                                   (1,) * part.expert + tuple(chunk.sizes)[lead:]))
        return placed

    @staticmethod
    def chunk_view(chunks: StoredChunks, part: Part, chunk, shape: tuple[int, ...]) -> torch.Tensor:
        """The saved ``chunk`` of ``part`` (:meth:`placed_chunks`) of shape ``shape`` in megalite's tensor, as a view of
        the memory-mapped shard file."""
        view = chunks.tensor(dcp_metadata.MetadataIndex(part.key, chunk.offsets))
        for dim, index in enumerate(part.lead):
            view = view.narrow(dim, index - chunk.offsets[dim], 1)
        return view.reshape(shape)

    def check_architecture(self, config) -> None:
        if config is None:
            return
        differences = compare_architecture(self._config, config)
        if differences:
            raise ValueError(f"Megatron-LM checkpoint {self.directory} holds a different architecture: " + "; ".join(
                f"{d.field} is {d.saved!r} in the checkpoint but {d.current!r} in the model" for d in differences))

    def field_error(self, field: str, problem: str, rank: int | None = None) -> str:
        return f"Megatron-LM checkpoint {self.directory}/{COMMON}: field {field!r} {problem}"

    def rank_state(self, rank: int) -> dict:
        """``{"megatron_rng": ...}`` (:func:`megalite.checkpoint.megatron_rng.read_rng_state`) when the checkpoint
        holds Megatron-LM's RNG states for ``rank`` of its layout, else ``{}``."""
        from megalite.checkpoint.megatron_rng import read_rng_state

        rng = read_rng_state(self.directory, self.metadata, self.layout, rank)
        return {} if rng is None else {"megatron_rng": rng}

    def agree(self, problem: str | None, *, data: bool = False) -> None:
        """Raise ValueError with the first rank's problem, on every rank (collective readers) or here."""
        if self.collective:
            problem = next((p for p in all_gather_object(problem, self.group) if p), None)
        if problem:
            raise ValueError(problem)

    def verify_all(self) -> None:
        """Megatron-LM writes no hashes: check that every shard file is present and non-empty."""
        for relative in sorted({info.relative_path for info in self.metadata.storage_data.values()}):
            if os.path.getsize(os.path.join(self.directory, relative)) == 0:
                raise ValueError(f"Megatron-LM checkpoint {self.directory}: shard file {relative} is empty")

    def _check(self, name: str, offset, shape) -> None:
        if not self.has(name):
            raise ValueError(f"Megatron-LM checkpoint {self.directory} has no tensor {name!r}")
        saved = self._sources[name].shape
        if len(offset) != len(saved) or any(o + n > s for o, n, s in zip(offset, shape, saved)):
            raise ValueError(f"{name}: region at {offset} of shape {tuple(shape)} lies outside the saved global shape "
                             f"{saved}")

    def _regions(self, region: Region) -> list[Region]:
        """``region`` of megalite's tensor as regions of Megatron's saved tensors, each ``out`` a view of its part of
        ``region.out``."""
        self._check(region.name, region.offset, region.out.shape)
        md, out, filled = self.metadata.state_dict_metadata, [], 0
        want = tuple((o, o + n) for o, n in zip(region.offset, region.out.shape))
        for part in self._sources[region.name].parts:
            size = (1,) * part.expert + tuple(md[part.key].size)[len(part.lead):]
            common = intersect(want, tuple((o, o + n) for o, n in zip(part.offset, size)))
            if common is None:
                continue
            view = region.out[box_slices(common, tuple(region.offset))]
            start = tuple(lo - o for (lo, _), o in zip(common, part.offset))[part.expert:]
            inner = tuple(hi - lo for lo, hi in common)[part.expert:]
            out.append(Region(part.key, part.lead + start, view.view((1,) * len(part.lead) + inner)))
            filled += view.numel()
        if filled != region.out.numel():
            raise ValueError(f"Megatron-LM checkpoint {self.directory}: its parts of {region.name} cover only {filled} "
                             f"of the {region.out.numel()} elements of region {want}")
        return out

    def read_views(self, boxes, regions=(), *, hashed: bool = True):
        """The boxes ``(name, offset, shape)`` as ``[[(index, view)]]``, views of the memory-mapped shard files
        (no copy; the caller copies them and must not write to them), and fill ``regions``; as
        :meth:`CheckpointReader.read_views`."""
        chunks = StoredChunks(self.directory, {"files": {}}, self.metadata, hashed=False)
        requests = [part for r in regions if r.name not in self._flat for part in self._regions(r)]
        views = []
        try:
            for region in (r for r in regions if r.name in self._flat):
                region.out.copy_(self.flat_tensor(region.name, chunks)[box_slices(
                    tuple((o, o + n) for o, n in zip(region.offset, region.out.shape)))])
            for name, offset, shape in boxes:
                self._check(name, tuple(offset), shape)
                box = tuple((o, o + n) for o, n in zip(offset, shape))
                if name in self._flat:
                    views.append([(box_slices(box, tuple(offset)), self.flat_tensor(name, chunks)[box_slices(box)])])
                    continue
                parts, filled = [], 0
                for part, chunk, at, size in self.placed_chunks(name):
                    common = intersect(box, tuple((o, o + n) for o, n in zip(at, size)))
                    if common is not None:
                        view = self.chunk_view(chunks, part, chunk, size)[box_slices(common, at)]
                        parts.append((box_slices(common, tuple(offset)), view))
                        filled += view.numel()
                if filled != math.prod(shape):
                    raise ValueError(f"tensor {name!r} region {box} is covered for only {filled} of "
                                     f"{math.prod(shape)} elements")
                views.append(parts)
            if requests:
                with quiet_single_process():
                    dcp.load({}, storage_reader=SafeReader(chunks), planner=RegionLoadPlanner(requests), no_dist=True)
        except (Exception, CheckpointException) as err:  # DCP wraps errors in a BaseException
            raise ValueError(f"reading Megatron-LM checkpoint {self.directory} failed: {first_line(err)}") from None
        return views

    def read_regions(self, regions, *, hashed: bool = True) -> None:
        self.read_views([], regions, hashed=hashed)

    def read_all(self, names, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(self.shapes[name], dtype=dtype or self.dtype(name)) for name in names}
        self.read_regions([Region(name, (0,) * t.dim(), t) for name, t in out.items()])
        return out

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.read_all([name], dtype)[name]


def plain_dict(value) -> dict | None:
    """``value`` when it is a dict of plain scalars (Megatron's ``OptimizerParamScheduler.state_dict()``), else None."""
    if isinstance(value, dict) and all(isinstance(v, (int, float, str, bool, type(None))) for v in value.values()):
        return dict(value)
    return None


def _read_json(path: str) -> dict:
    try:
        with open_regular(path, "Megatron-Core checkpoint metadata") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"Megatron-Core checkpoint metadata {path} is unreadable: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"Megatron-Core checkpoint metadata {path} is not a JSON object")
    return value
