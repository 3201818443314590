"""Adapter-only checkpoints in megalite's checkpoint format, and adapters as global tensors.

An adapter tensor's global form is what a single-process model's adapter would hold, named
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` after its base layer.  Its TP pieces follow
the base weight's layout (:func:`megalite.checkpoint.sharding.global_param` with the base weight's
name, so the SwiGLU fc1's B is stored as ``[gate; up]`` rows like fc1 itself), so an adapter
checkpoint saved under one layout loads under any other, on top of the base model's checkpoint.
:func:`check_model` checks adapter settings against a model's global shapes before any model or process group exists.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite import topology
from megalite.checkpoint import CheckpointReader, global_shapes
from megalite.checkpoint.state import OPTIMIZER_KEYS
from megalite.checkpoint.sharding import GlobalParam, ShardContext, box_slices, global_param
from megalite.checkpoint.storage import Region, TensorShard
from megalite.checkpoint.writer import write_checkpoint
from megalite.lora.adapter import LoRAModel
from megalite.lora.config import LoRAConfig
from megalite.models.architecture import config_to_dict


def check_model(config: LoRAConfig, model_config) -> None:
    """What :func:`megalite.lora.apply_lora` would refuse on ``model_config``'s model, found from its global shapes
    alone (no model built, no collective): a rank larger than a target layer allows.  ValueError."""
    for name, shape in global_shapes(model_config).items():
        module = name[:-len(".weight")]
        if name.endswith(".weight") and config.targets(module):
            config.check_rank(module, *shape)


def _model_config(lora: LoRAModel):
    return getattr(lora.model_chunks[0], "config", None) if lora.model_chunks else None


def adapter_layouts(lora: LoRAModel, ctx: ShardContext | None = None):
    """``(global name, local parameter, GlobalParam)`` of every adapter tensor on this rank."""
    ctx = ShardContext.from_groups() if ctx is None else ctx
    config = _model_config(lora)
    for module, adapter in lora.named_adapters():
        for which, param in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
            gp = global_param(f"{module}.weight", param, config, ctx)
            name = f"{module}.{which}.weight"
            yield name, param, dataclasses.replace(gp, name=name)


def _box(piece) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in piece.local)


def _global_slices(gp: GlobalParam, piece) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(piece.offset, _box(piece)))


@torch.no_grad()
def load_global_adapters(lora: LoRAModel, tensors: dict[str, torch.Tensor], ctx: ShardContext | None = None) -> None:
    """Set this rank's adapter shards from whole global tensors (e.g. a single-process run's); ``ctx``: this rank's
    coordinates (default: the current topology's)."""
    for name, param, gp in adapter_layouts(lora, ctx):
        if name not in tensors:
            raise ValueError(f"adapter tensor {name} is missing")
        if tuple(tensors[name].shape) != gp.shape:
            raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, expected {gp.shape}")
        for piece in gp.pieces:
            param[box_slices(piece.local)] = tensors[name][_global_slices(gp, piece)]


def local_shard(lora: LoRAModel, name: str, tensor: torch.Tensor, ctx: ShardContext | None = None) -> torch.Tensor:
    """This rank's shard of the global adapter tensor ``name`` (e.g. a reference gradient); ``ctx`` as in
    :func:`load_global_adapters`."""
    for global_name, param, gp in adapter_layouts(lora, ctx):
        if global_name == name:
            out = torch.empty_like(param)
            for piece in gp.pieces:
                out[box_slices(piece.local)] = tensor[_global_slices(gp, piece)]
            return out
    raise KeyError(name)


def global_adapters(lora: LoRAModel) -> dict[str, torch.Tensor]:
    """Every adapter as a global tensor, from a single-process (tp = 1) LoRAModel."""
    if topology.group_size(topology.resolve_group(None, "tp")) > 1:
        raise ValueError("global_adapters needs tp = 1; under TP save the adapters and read the checkpoint")
    return {name: param.detach().clone() for name, param, _ in adapter_layouts(lora)}


def _moment_layouts(lora: LoRAModel):
    """``(Adam key, adapter tensor name, local adapter, GlobalParam)`` of every optimizer moment of the adapters:
    the adapters are fp32 and their optimizer unsharded, so each moment is laid out like its adapter and
    stored as ``optimizer.<key>.<adapter tensor name>`` (as :mod:`megalite.checkpoint.state` names them)."""
    for name, param, gp in adapter_layouts(lora):
        for key in OPTIMIZER_KEYS:
            yield key, name, param, dataclasses.replace(gp, name=f"optimizer.{key}.{name}")


def _check_unsharded(optimizer) -> None:
    if any((shard.lo, shard.hi) != (0, shard.param.numel()) for shard in optimizer.shards):
        raise ValueError("adapter checkpoints hold unsharded optimizer state only (no ZeRO-1)")


def save_adapters(save_dir: str, iteration: int, lora: LoRAModel, *, optimizer=None, extra: dict | None = None,
                  rank_extra: dict | None = None, group=None) -> str:
    """Write the adapters only (each global tensor once) as a megalite checkpoint; returns its directory.

    Collective over ``group`` (default: the default process group when one exists; the RL trainer's ranks beside
    rollout ranks pass their own); the state records the LoRA settings
    and the base model's config, so :func:`load_adapters` can check it is loaded on the right base.
    ``optimizer`` (built on ``DistributedDataParallel(lora)``): its Adam moments and step count are
    saved too, so a run resumes; ``extra``/``rank_extra``: JSON state stored once / per rank.
    """
    ctx = ShardContext.from_groups()
    dp_rank = topology.group_rank(topology.resolve_group(None, "dp_cp"))
    tensors = list(adapter_layouts(lora, ctx))
    meta = None
    if optimizer is not None:
        _check_unsharded(optimizer)
        saved = optimizer.sharded_state_dict(copy=False)
        entries = {shard.param: saved["entries"][shard.key] for shard in optimizer.shards}
        tensors += [(gp.name, entries[param][key].view(param.shape), gp) for key, _, param, gp in _moment_layouts(lora)
                    if key in entries[param]]
        meta = {"num_steps": saved["num_steps"], "scaler": saved["scaler"],
                "param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                                 for g in saved["param_groups"]]}
    shards = []
    for name, param, gp in tensors:
        if dp_rank != 0 or ("tp" in gp.replicated and ctx.tp_rank != 0):
            continue
        for piece in gp.pieces:
            shards.append(TensorShard(name, gp.shape, piece.offset, param.detach()[box_slices(piece.local)]))
    state = {"config": config_to_dict(_model_config(lora)), "layout": {}, "optimizer": meta,
             "lora": dataclasses.asdict(lora.config), **(extra or {})}
    return write_checkpoint(save_dir, iteration, shards, state, rank_extra, group=group)


def read_adapter_checkpoint(path: str) -> tuple[LoRAConfig, object, dict[str, torch.Tensor]]:
    """``(LoRAConfig, base GPTConfig, global adapter tensors)`` of an adapter checkpoint (not its optimizer state)."""
    reader = CheckpointReader(path)
    settings = reader.state.get("lora")
    if not isinstance(settings, dict):
        raise ValueError(f"{reader.directory} is not a LoRA adapter checkpoint (its state has no 'lora' entry)")
    names = [name for name in reader.shapes if not name.startswith("optimizer.")]
    return LoRAConfig(**settings), reader.config, reader.read_all(names)


def _read_local(reader: CheckpointReader, tensors) -> None:
    """Read this rank's pieces of ``(name, local tensor, GlobalParam)`` into the local tensors."""
    regions, copies = [], []
    for name, param, gp in tensors:
        if not reader.has(name):
            raise ValueError(f"adapter checkpoint {reader.directory} has no tensor {name}")
        for piece in gp.pieces:
            buffer = torch.empty(_box(piece), dtype=torch.float32)
            regions.append(Region(name, piece.offset, buffer))
            copies.append((param, piece, buffer))
    reader.read_regions(regions)
    for param, piece, buffer in copies:
        param[box_slices(piece.local)] = buffer


@torch.no_grad()
def load_adapters(path: str, lora: LoRAModel, *, optimizer=None) -> CheckpointReader:
    """Load an adapter checkpoint (saved under any layout) into this rank's adapters; returns its reader.

    ``optimizer`` (built on ``DistributedDataParallel(lora)``): restore its saved Adam state too (left as
    built when the checkpoint has none).  Raises ValueError when its LoRA settings or base architecture
    differ from ``lora``'s.
    """
    reader = CheckpointReader(path)
    settings = reader.state.get("lora")
    if not isinstance(settings, dict):
        raise ValueError(f"{reader.directory} is not a LoRA adapter checkpoint (its state has no 'lora' entry)")
    saved = LoRAConfig(**settings)
    if (saved.rank, saved.alpha, saved.target_modules) != (lora.config.rank, lora.config.alpha,
                                                           lora.config.target_modules):
        raise ValueError(f"adapter checkpoint {reader.directory} has rank={saved.rank}, alpha={saved.alpha}, "
                         f"targets={list(saved.target_modules)}; this run has rank={lora.config.rank}, "
                         f"alpha={lora.config.alpha}, targets={list(lora.config.target_modules)}")
    reader.check_architecture(_model_config(lora))
    _read_local(reader, adapter_layouts(lora))
    meta = reader.state.get("optimizer")
    if optimizer is not None and meta is not None:
        _check_unsharded(optimizer)
        moments = [(gp.name, torch.empty_like(param), gp) for _, _, param, gp in _moment_layouts(lora)
                   if meta["num_steps"] > 0]
        _read_local(reader, moments)
        values = {name: value for name, value, _ in moments}
        names = {param: name for name, param, _ in adapter_layouts(lora)}
        entries = {}
        for shard in optimizer.shards:
            name = names[shard.param]
            entries[shard.key] = {"shape": tuple(shard.param.shape), "offset": 0,
                                  "main": shard.param.detach().reshape(-1).float(),
                                  **{key: values[f"optimizer.{key}.{name}"].reshape(-1)
                                     for key in OPTIMIZER_KEYS if meta["num_steps"] > 0}}
        optimizer.load_sharded_state_dict({"entries": entries, **meta, "param_groups": [
            {k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]})
    return reader
