"""Adapter-only checkpoints in megalite's checkpoint format, and adapters as global tensors.

An adapter tensor's global form is what a single-process model's adapter would hold, named
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` after its base layer.  Its TP pieces follow
the base weight's layout (:func:`megalite.checkpoint.sharding.global_param` with the base weight's
name, so the SwiGLU fc1's B is stored as ``[gate; up]`` rows like fc1 itself), so an adapter
checkpoint saved under one layout loads under any other, on top of the base model's checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite import topology
from megalite.checkpoint import CheckpointReader
from megalite.checkpoint.sharding import GlobalParam, ShardContext, box_slices, global_param
from megalite.checkpoint.storage import Region, TensorShard
from megalite.checkpoint.writer import write_checkpoint
from megalite.lora.adapter import LoRAModel
from megalite.lora.config import LoRAConfig
from megalite.models.architecture import config_to_dict


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
def load_global_adapters(lora: LoRAModel, tensors: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapter shards from whole global tensors (e.g. a single-process run's)."""
    for name, param, gp in adapter_layouts(lora):
        if name not in tensors:
            raise ValueError(f"adapter tensor {name} is missing")
        if tuple(tensors[name].shape) != gp.shape:
            raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, expected {gp.shape}")
        for piece in gp.pieces:
            param[box_slices(piece.local)] = tensors[name][_global_slices(gp, piece)]


def local_shard(lora: LoRAModel, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the global adapter tensor ``name`` (e.g. a reference gradient)."""
    for global_name, param, gp in adapter_layouts(lora):
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


def save_adapters(save_dir: str, iteration: int, lora: LoRAModel, *, extra: dict | None = None) -> str:
    """Write the adapters only (each global tensor once) as a megalite checkpoint; returns its directory.

    Collective over the default process group when one exists; the state records the LoRA settings
    and the base model's config, so :func:`load_adapters` can check it is loaded on the right base.
    """
    ctx = ShardContext.from_groups()
    dp_rank = topology.group_rank(topology.resolve_group(None, "dp_cp"))
    shards = []
    for name, param, gp in adapter_layouts(lora, ctx):
        if dp_rank != 0 or ("tp" in gp.replicated and ctx.tp_rank != 0):
            continue
        for piece in gp.pieces:
            shards.append(TensorShard(name, gp.shape, piece.offset, param.detach()[box_slices(piece.local)]))
    state = {"config": config_to_dict(_model_config(lora)), "layout": {}, "optimizer": None,
             "lora": dataclasses.asdict(lora.config), **(extra or {})}
    return write_checkpoint(save_dir, iteration, shards, state)


def read_adapter_checkpoint(path: str) -> tuple[LoRAConfig, object, dict[str, torch.Tensor]]:
    """``(LoRAConfig, base GPTConfig, global adapter tensors)`` of an adapter checkpoint."""
    reader = CheckpointReader(path)
    settings = reader.state.get("lora")
    if not isinstance(settings, dict):
        raise ValueError(f"{reader.directory} is not a LoRA adapter checkpoint (its state has no 'lora' entry)")
    return LoRAConfig(**settings), reader.config, reader.read_all(list(reader.shapes))


@torch.no_grad()
def load_adapters(path: str, lora: LoRAModel) -> None:
    """Load an adapter checkpoint (saved under any layout) into this rank's adapters.

    Raises ValueError when its LoRA settings or base architecture differ from ``lora``'s.
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
    regions, copies = [], []
    for name, param, gp in adapter_layouts(lora):
        if not reader.has(name):
            raise ValueError(f"adapter checkpoint {reader.directory} has no tensor {name}")
        for piece in gp.pieces:
            buffer = torch.empty(_box(piece), dtype=torch.float32)
            regions.append(Region(name, piece.offset, buffer))
            copies.append((param, piece, buffer))
    reader.read_regions(regions)
    for param, piece, buffer in copies:
        param[box_slices(piece.local)] = buffer
