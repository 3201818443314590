"""Saving and loading model chunks and their optimizer through global-tensor pieces.

Model weights are written once: by data-parallel rank 0 (expert-data-parallel rank 0 for expert
parameters) and, for parameters replicated over (expert) TP, by TP rank 0.  The optimizer's fp32
state (``exp_avg``, ``exp_avg_sq``, and ``main`` when the parameters are not fp32) is written as
the global tensors ``optimizer.<key>.<parameter>``: each ZeRO-1 shard, a flat range of a local
parameter, is cut into boxes (:func:`flat_boxes`) and placed like the parameter itself.  Loading
reads exactly the regions this rank holds, so any (tp, pp, vpp, dp, cp, ep) layout loads any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite import topology
from megalite.checkpoint.format import CheckpointReader, config_to_dict, write_checkpoint
from megalite.checkpoint.sharding import GlobalParam, ShardContext, box_slices, flat_boxes, global_param, regions

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


def unwrap(chunk):
    """The model inside a DDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def model_config(model_chunks):
    """The GPTConfig of the chunks, or None for models without one."""
    return getattr(unwrap(model_chunks[0]), "config", None) if model_chunks else None


def _named_tensors(model_chunks, config, ctx: ShardContext):
    """``(tensor, GlobalParam)`` of every parameter and persistent buffer of the chunks."""
    for chunk in model_chunks:
        for name, tensor in unwrap(chunk).state_dict(keep_vars=True).items():
            yield tensor, global_param(name, tensor, config, ctx)


def _box_shape(box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def _origin(box) -> tuple[int, ...]:
    return tuple(lo for lo, _ in box)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A copy that owns just its elements, so torch.save does not write the whole storage."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class _Pieces:
    """The ``tensors`` entry of a rank file under construction."""

    def __init__(self):
        self.tensors: dict[str, dict] = {}

    def add(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...], tensor: torch.Tensor) -> None:
        entry = self.tensors.setdefault(name, {"shape": tuple(shape), "pieces": []})
        entry["pieces"].append((tuple(offset), _compact(tensor).cpu()))


def save_checkpoint(save_dir: str, iteration: int, model_chunks, optimizer=None, *, extra: dict | None = None,
                    layout: dict | None = None, tp_group=None, ep_group=None, expert_tp_group=None, dp_group=None,
                    expert_dp_group=None) -> str:
    """Save this rank's model chunks (and optimizer) as global-tensor pieces; returns the iteration directory.

    Collective over the default process group when one exists.  ``extra`` is free-form
    per-rank state stored beside the tensors (e.g. scheduler, RNG, data position).
    """
    ctx = ShardContext.from_groups(tp_group, ep_group, expert_tp_group)
    dp_rank = topology.group_rank(topology.resolve_group(dp_group, "dp_cp"))
    edp_rank = topology.group_rank(topology.resolve_group(expert_dp_group, "expert_dp"))
    config = model_config(model_chunks)
    sharded = bool(getattr(optimizer, "sharded", False))

    def writes(gp: GlobalParam, over_dp: bool) -> bool:
        if gp.alias or ("tp" in gp.replicated and ctx.tp_rank) or ("etp" in gp.replicated and ctx.etp_rank):
            return False
        return over_dp or (edp_rank if gp.expert else dp_rank) == 0

    pieces = _Pieces()
    layouts = {}
    for param, gp in _named_tensors(model_chunks, config, ctx):
        layouts[param] = gp
        if writes(gp, False):
            for piece in gp.pieces:
                pieces.add(gp.name, gp.shape, piece.offset, param.detach()[box_slices(piece.local)])

    optimizer_meta = None
    if optimizer is not None:
        saved = optimizer.sharded_state_dict()
        for shard in optimizer.shards:
            gp = layouts[shard.param]
            if not writes(gp, sharded):
                continue
            entry = saved["entries"][shard.key]
            keys = [k for k in OPTIMIZER_KEYS if k in entry]
            if shard.param.dtype != torch.float32:
                keys.append("main")
            for box, start in flat_boxes(shard.lo, shard.hi, tuple(shard.param.shape)):
                shape = _box_shape(box)
                count = int(torch.Size(shape).numel())
                for key in keys:
                    block = entry[key][start - shard.lo:start - shard.lo + count].view(shape)
                    for part, offset in regions(box, gp.pieces):
                        pieces.add(f"optimizer.{key}.{gp.name}", gp.shape, offset, block[box_slices(part, _origin(box))])
        optimizer_meta = {k: saved[k] for k in ("num_steps", "param_groups", "scaler")}

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = {"config": config_to_dict(config), "layout": dict(layout or {}), "tensors": pieces.tensors,
             "optimizer": optimizer_meta, **(extra or {})}
    barrier = dist.barrier if dist.is_initialized() else None
    return write_checkpoint(save_dir, iteration, state, rank=rank, world_size=world, barrier=barrier)


def _check_shape(reader: CheckpointReader, gp: GlobalParam) -> None:
    if not reader.has(gp.name):
        raise ValueError(f"checkpoint {reader.directory} has no tensor {gp.name!r}")
    if reader.shapes[gp.name] != gp.shape:
        raise ValueError(f"checkpoint {reader.directory}: {gp.name} has global shape {reader.shapes[gp.name]}, "
                         f"the model needs {gp.shape}")


def _read_flat(reader: CheckpointReader, name: str, gp: GlobalParam, shape, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened local shard of ``gp``, read from global tensor ``name``."""
    flat = torch.zeros(hi - lo, dtype=torch.float32)
    for box, start in flat_boxes(lo, hi, shape):
        box_shape = _box_shape(box)
        block = flat[start - lo:start - lo + int(torch.Size(box_shape).numel())].view(box_shape)
        for part, offset in regions(box, gp.pieces):
            reader.read_into(name, block[box_slices(part, _origin(box))], offset)
    return flat


def load_into(reader: CheckpointReader, model_chunks, optimizer=None, *, tp_group=None, ep_group=None,
              expert_tp_group=None) -> None:
    """Fill the chunks (and optimizer) with this rank's regions of ``reader``'s global tensors.

    Everything is read and checked before any parameter changes, so a bad checkpoint leaves the
    model as it was.
    """
    ctx = ShardContext.from_groups(tp_group, ep_group, expert_tp_group)
    config = model_config(model_chunks)
    reader.check_architecture(config)
    loaded, layouts = [], {}
    for param, gp in _named_tensors(model_chunks, config, ctx):
        _check_shape(reader, gp)
        layouts[param] = gp
        value = torch.zeros(param.shape, dtype=param.dtype)
        for piece in gp.pieces:
            reader.read_into(gp.name, value[box_slices(piece.local)], piece.offset)
        loaded.append((param, value))

    state = None
    if optimizer is not None:
        meta = reader.rank_state(0).get("optimizer")
        if meta is None:
            meta = {"num_steps": 0, "scaler": None,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        keys = OPTIMIZER_KEYS if meta["num_steps"] > 0 else ()
        entries = {}
        for shard in optimizer.shards:
            gp = layouts[shard.param]
            shape = tuple(shard.param.shape)
            main = f"optimizer.main.{gp.name}"
            entry = {"shape": shape, "offset": shard.lo,
                     "main": _read_flat(reader, main if reader.has(main) else gp.name, gp, shape, shard.lo, shard.hi)}
            for key in keys:
                entry[key] = _read_flat(reader, f"optimizer.{key}.{gp.name}", gp, shape, shard.lo, shard.hi)
            entries[shard.key] = entry
        state = {"entries": entries, **meta}

    with torch.no_grad():
        for param, value in loaded:
            param.copy_(value)
    if state is not None:
        optimizer.load_sharded_state_dict(state)
