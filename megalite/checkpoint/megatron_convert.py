"""Conversion between Megatron-LM torch_dist checkpoints and megalite's, streaming chunk by chunk.

- :func:`convert_megatron_to_megalite`: every saved chunk of the Megatron-LM checkpoint (one layer of one
  tensor-parallel shard) becomes a chunk of the megalite checkpoint as a view of the memory-mapped input
  file, so no tensor is ever held whole and the peak memory is about one chunk.
- :func:`convert_megalite_to_megatron`: a megalite checkpoint (any layout) written as the iteration directory
  Megatron-LM's ``--ckpt-format torch_dist`` writes (``metadata.json``, ``common.pt`` with Megatron-LM's
  ``args``, the DCP files with stacked layers (unstacked when dense and MoE layers mix, as Megatron-Core saves
  them), Megatron's expert and Transformer-Engine layer-norm names, a padded vocabulary; Megatron-LM's default
  layout, ``singleton_local_shards`` off)
  plus ``latest_checkpointed_iteration.txt``, so Megatron-Core's ``dist_checkpointing.load`` reads it.

From Megatron-LM: the model weights, the Adam state that :class:`MegatronDistReader` reads (moments, fp32 main
weights, step count) and the LR schedule, so the converted checkpoint resumes the run; not the RNG states.  To
Megatron-LM: the model weights only (dense or MoE).
"""

from __future__ import annotations

import argparse
import io
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megalite.checkpoint import global_shapes, open_reader, save_global_shards
from megalite.checkpoint.files import fresh_output, move_into_place
from megalite.checkpoint.locate import MEGATRON_DIST_METADATA, MEGATRON_TRACKER
from megalite.checkpoint.megatron_args import MEGATRON_LLAMA3, megatron_moe_args
from megalite.checkpoint.megatron_dist import COMMON, MegatronDistReader
from megalite.checkpoint.megatron_names import LAYERS, megatron_key, megatron_name
from megalite.checkpoint.megatron_optim import parameter_name
from megalite.checkpoint.sharding import VOCAB_PARAMS
from megalite.checkpoint.storage import ShardSavePlanner, TensorShard, quiet_single_process
from megalite.checkpoint.stored_chunks import StoredChunks
from megalite.tensor_parallel.vocab_embedding import pad_vocab_size

# Megatron-Core's sharded objects beside each linear layer (Transformer Engine's FP8 state; None otherwise).
_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
_ATTENTION_EXTRA_STATE = _EXTRA_STATE[:2]


def _stacks_layers(config) -> bool:
    """Whether Megatron-Core saves ``config``'s decoder layers stacked on a leading dimension: not with dense and MoE
    layers mixed (its ``TransformerBlock.sharded_state_dict`` unstacks whenever ``moe_layer_freq`` is a list or
    above 1)."""
    freq = config.moe_layer_freq
    return config.moe is None or (isinstance(freq, int) and freq == 1)


def _layer_extra_state(config, layer: int) -> list[tuple[str, tuple[int, int] | None]]:
    """``(module, (expert, num_experts) or None)`` of every sharded object of decoder layer ``layer`` (an MoE
    layer's experts each have one, along an expert axis)."""
    modules = [(m, None) for m in _ATTENTION_EXTRA_STATE]
    if not config.is_moe_layer(layer):
        return modules + [(m, None) for m in _EXTRA_STATE[2:]]
    experts = config.moe.num_experts
    modules += [(f"mlp.experts.experts.linear_fc{i}", (e, experts)) for e in range(experts) for i in (1, 2)]
    if config.moe.shared_expert_intermediate_size is not None:
        modules += [(f"mlp.shared_experts.linear_fc{i}", None) for i in (1, 2)]
    return modules


def _extra_state_keys(config) -> list[str]:
    """The keys of the sharded objects Megatron-Core's ``dist_checkpointing.load`` expects of ``config``'s layers:
    ``<key>/shard_<offsets>_<sizes>``, the offsets and sizes of the layer axis (when stacked), then the expert axis
    (or a single axis of size 1)."""
    layers, stacked = config.num_layers, _stacks_layers(config)
    keys = []
    for layer in range(layers):
        for module, expert in _layer_extra_state(config, layer):
            axes = ([(layer, layers)] if stacked else []) + ([expert] if expert else [])
            offsets, sizes = zip(*(axes or [(0, 1)]))
            prefix = LAYERS if stacked else f"{LAYERS}{layer}."
            keys.append(f"{prefix}{module}._extra_state/shard_{'.'.join(map(str, offsets))}_"
                        f"{'.'.join(map(str, sizes))}")
    return keys


def megatron_shards(reader: MegatronDistReader) -> list[TensorShard]:
    """Every saved chunk of ``reader``'s model tensors (and optimizer state, when the reader resumes it) as megalite
    :class:`TensorShard` boxes, each a view of the memory-mapped shard file it lies in (vocabulary padding rows cut
    off)."""
    chunks = StoredChunks(reader.directory, {"files": {}}, reader.metadata, hashed=False)
    shards = []
    for name, shape in reader.shapes.items():
        if name.startswith("optimizer.") and reader.state["optimizer"] is None:
            continue
        if name in reader._flat:  # the distributed optimizer's state: gathered from its flat buckets
            shards.append(TensorShard(name, shape, (0,) * len(shape), reader.flat_tensor(name, chunks)))
            continue
        for part, chunk, offset, size in reader.placed_chunks(name):
            view = reader.chunk_view(chunks, part, chunk, size)
            if parameter_name(name) in VOCAB_PARAMS:
                if offset[0] >= shape[0]:
                    continue
                view = view.narrow(0, 0, min(view.shape[0], shape[0] - offset[0]))
            shards.append(TensorShard(name, shape, offset, view))
    return shards


def convert_megatron_to_megalite(path: str, output: str) -> MegatronDistReader:
    """Write the Megatron-LM torch_dist checkpoint ``path`` as a megalite checkpoint in ``output``; returns its
    reader (``optimizer_note`` says why a saved optimizer state was left out)."""
    reader = MegatronDistReader(path)
    tmp = fresh_output(output)
    extra = {key: reader.state[key] for key in ("consumed_samples", "optimizer", "megatron_scheduler")}
    save_global_shards(tmp, reader.config, megatron_shards(reader), iteration=reader.iteration, extra=extra)
    move_into_place(tmp, output)
    return reader


def megatron_args(config, tp: int, iteration: int) -> dict:
    """Megatron-LM's architecture arguments of ``config`` (what its ``--use-checkpoint-args`` reads back).

    RoPE scaling other than Llama 3's at Megatron-Core's fixed frequency factors is a ValueError: Megatron-LM has
    no flag for it."""
    if config.rope_scaling is not None and any(getattr(config, field) != value
                                               for field, value in MEGATRON_LLAMA3.items()):
        raise ValueError(f"RoPE scaling {config.rope_scaling!r} at these factors has no Megatron-LM flag (its "
                         "--use-rope-scaling is Llama 3's with low/high frequency factors 1 and 4 over 8192 positions)")
    return {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "ffn_hidden_size": config.ffn_hidden_size,
            "group_query_attention": config.num_query_groups != config.num_attention_heads,
            "num_query_groups": config.num_query_groups, "kv_channels": config.kv_channels,
            "max_position_embeddings": config.max_position_embeddings, "seq_length": config.max_position_embeddings,
            "position_embedding_type": config.position_embedding_type, "rotary_base": config.rotary_base,
            "rotary_percent": config.rotary_percent, "rotary_interleaved": config.rotary_interleaved,
            "use_rope_scaling": config.rope_scaling is not None, "rope_scaling_factor": config.rope_scaling_factor,
            "normalization": config.normalization,
            "norm_epsilon": config.norm_eps, "swiglu": config.activation == "swiglu",
            "squared_relu": config.activation == "squared_relu", "add_bias_linear": config.add_bias_linear,
            "add_qkv_bias": config.add_bias_linear or config.add_qkv_bias, "hidden_dropout": config.hidden_dropout,
            "attention_dropout": config.attention_dropout, "init_method_std": config.init_method_std,
            "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
            "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by, "vocab_size": config.vocab_size,
            "padded_vocab_size": pad_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp),
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "world_size": tp,
            "data_parallel_size": 1, "ckpt_format": "torch_dist", "iteration": iteration,
            "qk_layernorm": config.qk_layernorm, "mtp_num_layers": config.mtp_num_layers,
            "mtp_loss_scaling_factor": config.mtp_loss_scaling_factor, **megatron_moe_args(config)}


class _MegatronSavePlanner(ShardSavePlanner):
    """:class:`ShardSavePlanner` plus the byte records of Megatron-Core's sharded objects."""

    def __init__(self, shards: list[TensorShard], objects: dict[str, bytes]):
        super().__init__(shards)
        self._objects = objects

    def create_local_plan(self):
        plan = super().create_local_plan()
        plan.items.extend(WriteItem(index=dcp_metadata.MetadataIndex(key), type=WriteItemType.BYTE_IO)
                          for key in self._objects)
        return plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        return super().resolve_data(write_item)


def convert_megalite_to_megatron(path: str, output: str, tp: int = 1) -> None:
    """Write the megalite checkpoint ``path`` as a Megatron-LM torch_dist save directory ``output`` whose vocabulary
    is padded for a Megatron run at tensor-parallel size ``tp``."""
    reader = open_reader(path)
    config = reader.config
    if config is None:
        raise ValueError(f"checkpoint {reader.directory} stores no GPTConfig")
    args = megatron_args(config, tp, reader.iteration)
    padded = args["padded_vocab_size"]
    layers = config.num_layers
    shards = []
    for name, shape in global_shapes(config).items():
        if name.startswith(LAYERS) and not _stacks_layers(config):
            layer, rest = name[len(LAYERS):].split(".", 1)
            shards.append(TensorShard(f"{LAYERS}{layer}.{megatron_name(rest)}", shape, (0,) * len(shape),
                                      reader.read(name)))
        elif name.startswith(LAYERS):
            layer, rest = name[len(LAYERS):].split(".", 1)
            key = LAYERS + megatron_name(rest)
            shards.append(TensorShard(key, (layers,) + shape, (int(layer),) + (0,) * len(shape),
                                      reader.read(name).unsqueeze(0)))
        elif name in VOCAB_PARAMS:
            tensor = torch.zeros((padded,) + shape[1:], dtype=reader.dtype(name))
            tensor[:shape[0]] = reader.read(name)
            shards.append(TensorShard(name, tuple(tensor.shape), (0,) * tensor.dim(), tensor))
        else:
            shards.append(TensorShard(megatron_key(name), shape, (0,) * len(shape), reader.read(name)))
    blob = io.BytesIO()
    torch.save([None], blob)  # Megatron-Core stores each sharded object as a one-element list
    extra = {key: blob.getvalue() for key in _extra_state_keys(config)}
    extra.update({f"mtp.layers.{depth}.{module}._extra_state/shard_0_1": blob.getvalue()
                  for depth in range(config.mtp_num_layers or 0)
                  for module in ("eh_proj", *(f"transformer_layer.{m}" for m in _EXTRA_STATE))})
    tmp = fresh_output(output)
    directory = os.path.join(tmp, f"iter_{reader.iteration:07d}")
    os.makedirs(directory)
    with quiet_single_process():
        dcp.save({}, storage_writer=dcp.FileSystemWriter(directory), planner=_MegatronSavePlanner(shards, extra),
                 no_dist=True)
    torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": reader.iteration},
               os.path.join(directory, COMMON))
    with open(os.path.join(directory, MEGATRON_DIST_METADATA), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(tmp, MEGATRON_TRACKER), "w") as f:
        f.write(str(reader.iteration))
    move_into_place(tmp, output)
