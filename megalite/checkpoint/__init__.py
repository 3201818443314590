"""Checkpoints that reshard across parallel layouts, single-process loading, and global-tensor I/O.

- :func:`save_sharded` / :func:`load_sharded`: model chunks and optimizer under any
  (tp, pp, vpp, dp, ep) layout, stored through torch.distributed.checkpoint as shards of
  layout-free global tensors (sync, or in the background with an :class:`AsyncSaver`).  The
  trainer's ``save_checkpoint`` / ``load_checkpoint`` (:mod:`megalite.training.checkpointing`,
  Megatron's names) add the schedule, RNG and data position on top.
- :func:`read_checkpoint_info`: a checkpoint's iteration, saved config, layout and JSON state,
  without reading tensors.
- :func:`load_model`: a checkpoint as one single-process GPTModel.
- :func:`save_global_checkpoint` / :func:`read_global_tensors`: whole global tensors, as the
  Hugging Face converter writes and reads them.

``python -m megalite.checkpoint inspect DIR`` prints a checkpoint's layout and tensors.

Every reading entry point also takes a Megatron-LM torch_dist checkpoint (:func:`open_reader` picks the
reader: :mod:`megalite.checkpoint.megatron_dist`); :mod:`megalite.checkpoint.megatron_convert` converts both ways.
"""

from __future__ import annotations

import torch

from megalite import topology
from megalite.checkpoint.files import iteration_dir, read_latest
from megalite.checkpoint.meta import meta_model
from megalite.checkpoint.reader import CheckpointReader, open_reader
from megalite.checkpoint.sharding import ShardContext, global_param
from megalite.checkpoint.state import OPTIMIZER_KEYS, load_into, local_shards, save_sharded
from megalite.checkpoint.storage import TensorShard
from megalite.checkpoint.writer import AsyncSaver, CheckpointWriteError, write_checkpoint
from megalite.models.architecture import config_to_dict


def load_sharded(path: str, model_chunks, optimizer=None, *, group=None, tp_group=None, ep_group=None,
                 expert_tp_group=None) -> CheckpointReader:
    """Load ``path`` (a save directory or an iteration directory) into this rank's chunks and optimizer.

    Works under any layout; raises ValueError (before changing anything) on a missing, truncated
    or altered file or an architecture mismatch.  ``optimizer=None`` skips the optimizer state.
    ``group``: the ranks that load this checkpoint together (e.g. ``dist.group.WORLD`` in the
    trainer); they share every error, so all fail alike.  None: this rank alone, no collective.
    Returns the reader (``reader.state``: rank 0's JSON state; ``reader.rank_state(r)``: rank r's).
    """
    reader = open_reader(path, group=group, collective=group is not None)
    load_into(reader, model_chunks, optimizer, tp_group=tp_group, ep_group=ep_group,
              expert_tp_group=expert_tp_group)
    return reader


def read_checkpoint_info(path: str) -> dict:
    """``{"directory", "iteration", "world_size", "config" (GPTConfig or None), "layout", "state"}`` of a
    checkpoint, from its JSON files only (for --use-checkpoint-args, --finetune and inspection)."""
    reader = open_reader(path, verify=False)
    return {"directory": reader.directory, "iteration": reader.iteration, "world_size": reader.world_size,
            "config": reader.config, "layout": reader.layout, "state": reader.state}


def _check_single_process() -> None:
    if topology.is_initialized():
        topo = topology.current()
        sizes = {"tp": topo.tp.size, "ep": topo.ep.size, "expert_tp": topo.expert_tp.size}
        if any(size > 1 for size in sizes.values()):
            raise ValueError(f"load_model builds a single-process model, but the current topology has {sizes}; "
                             "call it outside the parallel run or use load_sharded")


def load_model(path: str, device="cpu"):
    """The checkpoint at ``path`` as a single-process GPTModel (tp = pp = 1) in eval mode on ``device``.

    Calling it on input ids ``[batch, seq]`` without labels returns logits ``[batch, seq, vocab]``.
    """
    from megalite.models import GPTModel

    reader = open_reader(path)
    config = reader.config
    if config is None:
        raise ValueError(f"checkpoint {reader.directory} stores no GPTConfig, so no GPTModel can be built from it")
    _check_single_process()
    try:
        model = GPTModel(config)
    except ValueError as err:
        raise ValueError(reader.field_error("config", f"does not build a model: {err}")) from None
    load_into(reader, [model])
    return model.to(device).eval()


def global_shapes(config) -> dict[str, tuple[int, ...]]:
    """The name and shape of every global model tensor of ``config``: parameters and persistent buffers
    (a router's ``expert_bias``), as ``save_sharded`` writes them."""
    _check_single_process()
    shapes = {}
    for name, param in meta_model(config).state_dict(keep_vars=True).items():
        gp = global_param(name, param, config, ShardContext())
        if not gp.alias:
            shapes[gp.name] = gp.shape
    return shapes


def save_global_checkpoint(save_dir: str, config, tensors: dict[str, torch.Tensor], *, iteration: int = 0,
                           extra: dict | None = None) -> str:
    """Write whole global tensors as a single-rank checkpoint that loads under any layout (see
    :func:`save_global_shards`)."""
    shards = [TensorShard(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor.detach().cpu())
              for name, tensor in sorted(tensors.items())]
    return save_global_shards(save_dir, config, shards, iteration=iteration, extra=extra)


def save_global_shards(save_dir: str, config, shards: list[TensorShard], *, iteration: int = 0,
                       extra: dict | None = None, model_shapes: dict | None = None) -> str:
    """Write boxes of global tensors (:class:`TensorShard`, e.g. views of another checkpoint's files, so
    nothing is held whole) as a single-rank checkpoint that loads under any layout.

    The shards must name exactly the tensors of ``config``'s model (or, for a model without a GPTConfig such
    as a user's module trained through the TrainingService, of ``model_shapes``), with their global shapes,
    and may add optimizer state as ``optimizer.<exp_avg|exp_avg_sq|main>.<name>`` of the same shapes (with
    its JSON state as ``extra["optimizer"]``).
    """
    shapes = {shard.name: tuple(shard.global_shape) for shard in shards}
    model = model_shapes if model_shapes is not None else global_shapes(config)
    expected = {**model, **{f"optimizer.{key}.{name}": shape for key in (*OPTIMIZER_KEYS, "main")
                            for name, shape in model.items() if f"optimizer.{key}.{name}" in shapes}}
    missing = sorted(set(expected) - set(shapes))
    unknown = sorted(set(shapes) - set(expected))
    if missing or unknown:
        raise ValueError(f"tensors do not match the model of this config: missing {missing[:5]}, "
                         f"unexpected {unknown[:5]}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(f"{name} has shape {shapes[name]}, the config needs {shape}")
    state = {"config": config_to_dict(config), "layout": {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "vpp": None},
             "optimizer": None, **(extra or {})}
    return write_checkpoint(save_dir, iteration, shards, state, collective=False)


def read_global_tensors(path: str) -> tuple[object, dict[str, torch.Tensor], dict]:
    """``(config, tensors, rank 0's JSON state)``: every global model tensor of a checkpoint (``config`` is None
    for a model without a GPTConfig, e.g. a user's module trained through the TrainingService)."""
    reader = open_reader(path)
    config = reader.config
    names = [name for name in reader.shapes if not name.startswith("optimizer.")]
    return config, reader.read_all(names), reader.state


__all__ = ["AsyncSaver", "CheckpointReader", "CheckpointWriteError", "TensorShard", "load_sharded", "load_model",
           "local_shards", "read_checkpoint_info", "save_sharded", "save_global_checkpoint", "read_global_tensors",
           "global_shapes", "read_latest", "iteration_dir", "open_reader", "save_global_shards"]
