"""Saving and loading model chunks and their optimizer through global-tensor pieces.

Model weights are written once: by data-parallel rank 0 (expert-data-parallel rank 0 for expert
parameters) and, for parameters replicated over (expert) TP, by TP rank 0.  The optimizer's fp32
state (``exp_avg``, ``exp_avg_sq``, and ``main`` when the parameters are not fp32; an optimizer whose
``sharded_state_dict`` names other ``state_keys`` (a torch optimizer's, e.g. ``momentum_buffer``) those) is
written as the global tensors ``optimizer.<key>.<parameter>``: each ZeRO-1 shard, a flat range of a local
parameter, is cut into boxes (:func:`flat_boxes`) and placed like the parameter itself.  FSDP2
parameters (DTensors holding rows of the local parameter, also a flat range) and their optimizer
state are written the same way, by every DP rank.  Every box is a :class:`TensorShard` of the DCP
format.  Loading reads exactly the regions this rank holds,
so any (tp, pp, vpp, dp, cp, ep) layout loads any other.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from megalite import topology
from megalite.checkpoint.files import check_jsonable, iteration_dir
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.sharding import GlobalParam, ShardContext, box_slices, flat_boxes, global_param, regions
from megalite.checkpoint.storage import Region, TensorShard
from megalite.checkpoint.writer import AsyncSaver, write_checkpoint
from megalite.distributed.fsdp import owned_flat_range
from megalite.distributed.unwrap import unwrap
from megalite.models.architecture import config_to_dict
from megalite.optim.replicas import counts_on_this_rank

OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")


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


def local_shards(model_chunks, optimizer=None, *, tp_group=None, ep_group=None, expert_tp_group=None,
                 dp_group=None, expert_dp_group=None) -> tuple[list[TensorShard], dict | None]:
    """The :class:`TensorShard` boxes this rank writes, and the optimizer's JSON scalars (None without one).

    Each local tensor maps to its global name and offsets through :func:`global_param`; replicated
    copies are written by one rank only.  The shards view the live tensors (an asynchronous save
    copies them, :meth:`AsyncSaver.stage`).
    """
    ctx = ShardContext.from_groups(tp_group, ep_group, expert_tp_group)
    dp_rank = topology.group_rank(topology.resolve_group(dp_group, "dp_cp"))
    edp_rank = topology.group_rank(topology.resolve_group(expert_dp_group, "expert_dp"))
    pp_rank = topology.group_rank(topology.resolve_group(None, "pp"))
    config = model_config(model_chunks)
    sharded = bool(getattr(optimizer, "sharded", False))

    def writes(param, gp: GlobalParam, over_dp: bool) -> bool:
        if gp.alias or not counts_on_this_rank(param, ctx.tp_rank, ctx.etp_rank, pp_rank):
            return False
        return over_dp or (edp_rank if gp.expert else dp_rank) == 0

    shards: list[TensorShard] = []

    def add(name, shape, offset, tensor):
        shards.append(TensorShard(name, tuple(shape), tuple(offset), tensor.detach()))

    def add_flat(name, gp, shape, flat, lo, hi):
        # ``flat`` holds elements [lo, hi) of a flattened local tensor of ``shape`` (a ZeRO-1 or FSDP2 shard).
        for box, start in flat_boxes(lo, hi, shape):
            block = flat[start - lo:start - lo + int(torch.Size(_box_shape(box)).numel())].view(_box_shape(box))
            for part, offset in regions(box, gp.pieces):
                add(name, gp.shape, offset, block[box_slices(part, _origin(box))])

    layouts = {}
    for param, gp in _named_tensors(model_chunks, config, ctx):
        layouts[param] = gp
        if isinstance(param, DTensor):
            if writes(param, gp, True):
                lo, hi = owned_flat_range(param)
                add_flat(gp.name, gp, tuple(param.shape), param.to_local().detach().reshape(-1), lo, hi)
        elif writes(param, gp, False):
            for piece in gp.pieces:
                add(gp.name, gp.shape, piece.offset, param.detach()[box_slices(piece.local)])

    optimizer_meta = None
    if optimizer is not None:
        saved = optimizer.sharded_state_dict(copy=False)
        for shard in optimizer.shards:
            gp = layouts[shard.param]
            if not writes(shard.param, gp, sharded):
                continue
            entry = saved["entries"][shard.key]
            keys = [k for k in saved.get("state_keys", OPTIMIZER_KEYS) if k in entry]
            if shard.param.dtype != torch.float32:
                keys.append("main")
            for key in keys:
                add_flat(f"optimizer.{key}.{gp.name}", gp, tuple(shard.param.shape), entry[key], shard.lo, shard.hi)
        optimizer_meta = {**{k: v for k, v in saved.items() if k != "entries"},
                          "param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                                           for g in saved["param_groups"]]}
    return shards, optimizer_meta


def save_sharded(save_dir: str, iteration: int, model_chunks, optimizer=None, *, extra: dict | None = None,
                 rank_extra: dict | None = None, layout: dict | None = None, saver: AsyncSaver | None = None,
                 tp_group=None, ep_group=None, expert_tp_group=None, dp_group=None,
                 expert_dp_group=None, group=None) -> str:
    """Save this rank's model chunks (and optimizer) as global-tensor shards; returns the iteration directory.

    Collective over ``group`` (default: the default process group, when one exists; the RL trainer's ranks
    beside rollout ranks pass theirs), without ``saver``.  ``extra`` is JSON state stored
    once (from rank 0: scheduler, data position, flags); ``rank_extra`` JSON state of this rank
    (RNG).  With ``saver`` the tensors are copied (into buffers the saver keeps) and the write runs in
    the background (at most one in flight; ``latest`` moves once every rank's files are written and hashed).
    """
    shards, optimizer_meta = local_shards(model_chunks, optimizer, tp_group=tp_group, ep_group=ep_group,
                                          expert_tp_group=expert_tp_group, dp_group=dp_group,
                                          expert_dp_group=expert_dp_group)
    state = {"config": config_to_dict(model_config(model_chunks)), "layout": dict(layout or {}),
             "optimizer": optimizer_meta, **(extra or {})}
    check_jsonable(state, "checkpoint state")
    check_jsonable(rank_extra or {}, "per-rank checkpoint state")
    if saver is None:
        return write_checkpoint(save_dir, iteration, shards, state, rank_extra, group=group)
    saver.wait()  # the write in flight reads the staging buffers that stage() refills
    shards = saver.stage(shards)
    saver.submit(lambda group: write_checkpoint(save_dir, iteration, shards, state, rank_extra, group=group))
    return iteration_dir(save_dir, iteration)


def _check_shape(reader: CheckpointReader, gp: GlobalParam) -> None:
    if not reader.has(gp.name):
        raise ValueError(f"checkpoint {reader.directory} has no tensor {gp.name!r}")
    if reader.shapes[gp.name] != gp.shape:
        raise ValueError(f"checkpoint {reader.directory}: {gp.name} has global shape {reader.shapes[gp.name]}, "
                         f"the model needs {gp.shape}")


def _flat_regions(name: str, gp: GlobalParam, shape, lo: int, hi: int) -> tuple[torch.Tensor, list[Region]]:
    """An fp32 buffer for elements ``[lo, hi)`` of the flattened local shard of ``gp``, and the
    regions of global tensor ``name`` that fill it."""
    flat = torch.empty(hi - lo, dtype=torch.float32)
    wanted = []
    for box, start in flat_boxes(lo, hi, shape):
        box_shape = _box_shape(box)
        block = flat[start - lo:start - lo + int(torch.Size(box_shape).numel())].view(box_shape)
        for part, offset in regions(box, gp.pieces):
            wanted.append(Region(name, offset, block[box_slices(part, _origin(box))]))
    _zero_unread(flat, wanted)
    return flat, wanted


def _joined(parts, shape) -> torch.Tensor:
    """The box of ``shape`` whose parts ``[(index, view)]`` :meth:`CheckpointReader.read_views` gave: the view
    itself when it is one part, else a new tensor."""
    if len(parts) == 1 and tuple(parts[0][1].shape) == tuple(shape):
        return parts[0][1]
    out = torch.empty(shape, dtype=parts[0][1].dtype)
    for index, value in parts:
        out[index].copy_(value)
    return out


def _zero_unread(buffer: torch.Tensor, wanted: list[Region]) -> None:
    """Zero ``buffer`` unless the regions read into it (disjoint views of it) cover all of it: vocabulary
    padding rows are stored nowhere.  Reading fills the rest, so a covered buffer is left uninitialized."""
    if sum(region.out.numel() for region in wanted) < buffer.numel():
        buffer.zero_()


def load_into(reader: CheckpointReader, model_chunks, optimizer=None, *, tp_group=None, ep_group=None,
              expert_tp_group=None) -> None:
    """Fill the chunks (and optimizer) with this rank's regions of ``reader``'s global tensors.

    Everything is read and checked before any parameter changes, so a bad checkpoint leaves the
    model as it was; with a collective reader all ranks agree first, so all fail alike (and they
    share the hashing of the data files).  A region that lies in one saved chunk (any region when
    the layout is the saved one) is a view of the memory-mapped file, copied once into place.
    """
    problem, copies, state = None, [], None
    try:
        copies, state = _read_local(reader, model_chunks, optimizer, tp_group, ep_group, expert_tp_group)
    except ValueError as err:
        problem = str(err)
    reader.agree(problem, data=reader.collective)
    with torch.no_grad():
        for target, source in copies:
            if source is None:
                target.zero_()
            else:
                target.copy_(source)
    if state is not None:
        optimizer.load_sharded_state_dict(state)


def _read_local(reader, model_chunks, optimizer, tp_group, ep_group, expert_tp_group):
    """``([(parameter or part of one, its loaded value, or None to zero it)], the optimizer state to load or
    None)`` of this rank."""
    ctx = ShardContext.from_groups(tp_group, ep_group, expert_tp_group)
    config = model_config(model_chunks)
    reader.check_architecture(config)
    copies, layouts, values, wanted, boxes, places = [], {}, {}, [], [], []

    def view(name, offset, shape, place):
        """Read box ``shape`` at ``offset`` of ``name``; ``place([(index, view)])`` puts its parts where they
        belong."""
        boxes.append((name, tuple(offset), tuple(shape)))
        places.append(place)

    for param, gp in _named_tensors(model_chunks, config, ctx):
        _check_shape(reader, gp)
        layouts[param] = gp
        if isinstance(param, DTensor):
            # An FSDP2 parameter: read only this rank's rows, as the flat range they cover.
            lo, hi = owned_flat_range(param)
            flat, more = _flat_regions(gp.name, gp, tuple(param.shape), lo, hi)
            wanted += more
            copies.append((param.to_local().detach().view(-1), flat))
            values[param] = (flat, lo)
            continue
        target = param.detach()
        if sum(math.prod(_box_shape(piece.local)) for piece in gp.pieces) < param.numel():
            copies.append((target, None))  # vocabulary padding rows are stored nowhere
        for piece in gp.pieces:
            view(gp.name, piece.offset, _box_shape(piece.local), lambda parts, part=target[box_slices(piece.local)]:
                 copies.extend((part[index], value) for index, value in parts))
        values[param] = (target.view(-1), 0)  # read once the parameters are loaded

    state = None
    if optimizer is not None:
        meta = reader.state.get("optimizer")
        if meta is None:
            meta = {"num_steps": 0, "scaler": None,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        meta = {**meta, "param_groups": [{k: tuple(v) if k == "betas" else v for k, v in g.items()}
                                         for g in meta["param_groups"]]}
        saved_kind, kind = meta.get("torch_optimizer"), getattr(optimizer, "torch_optimizer", None)
        if saved_kind != kind:
            name = lambda k: f"torch.optim.{k}" if k else "megalite's optimizer"  # noqa: E731
            raise ValueError(f"the checkpoint holds the state of {name(saved_kind)}, this run has {name(kind)}")
        keys = tuple(meta.get("state_keys", OPTIMIZER_KEYS)) if meta["num_steps"] > 0 else ()
        entries, fp32_mains = {}, []
        for shard in optimizer.shards:
            gp = layouts[shard.param]
            shape = tuple(shard.param.shape)
            entry = {"shape": shape, "offset": shard.lo}
            main = f"optimizer.main.{gp.name}"
            names = [(k, f"optimizer.{k}.{gp.name}") for k in keys]
            if not reader.has(main) and shard.param.dtype == torch.float32:
                fp32_mains.append((entry, values[shard.param], shard.lo, shard.hi))  # main is the param itself
            else:
                names.insert(0, ("main", main if reader.has(main) else gp.name))
            boxes_of_shard = flat_boxes(shard.lo, shard.hi, shape)
            parts = list(regions(boxes_of_shard[0][0], gp.pieces)) if len(boxes_of_shard) == 1 else []
            for key, name in names:
                if len(parts) == 1 and parts[0][0] == boxes_of_shard[0][0]:  # one box of one piece
                    box_shape = _box_shape(parts[0][0])
                    view(name, parts[0][1], box_shape, lambda views, entry=entry, key=key, box_shape=box_shape:
                         entry.__setitem__(key, _joined(views, box_shape).reshape(-1).float()))
                else:
                    entry[key], more = _flat_regions(name, gp, shape, shard.lo, shard.hi)
                    wanted += more
            entries[shard.key] = entry
        state = {"entries": entries, **meta}
    for value, place in zip(reader.read_views(boxes, wanted, hashed=not reader.collective), places):
        place(value)
    if state is not None:
        for entry, (flat, start), lo, hi in fp32_mains:
            entry["main"] = flat[lo - start:hi - start].float()
    return copies, state
