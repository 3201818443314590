"""How Megatron-Core's torch_dist tensor keys name megalite's global tensors.

Megatron-LM's ``--ckpt-format torch_dist`` saves tensors in megalite's own global layout
(:mod:`megalite.checkpoint.sharding`: grouped QKV, SwiGLU fc1 as ``[gate; up]``), under other keys:

- the decoder layers are stacked: ``decoder.layers.<name>`` has a leading dimension of ``num_layers``,
  and megalite's ``decoder.layers.<i>.<name>`` is its slice ``i``; with dense and MoE layers mixed
  (``moe_layer_freq``) Megatron-Core does not stack the layers but saves ``decoder.layers.<i>.<name>``;
- MoE experts are ``mlp.experts.experts.linear_fc1|2.weight`` with an expert dimension (SequentialMLP and
  GroupedMLP alike), megalite's ``mlp.experts.fc1|2_weight``;
- the layer norms live under the Transformer-Engine names (``linear_qkv.layer_norm_weight`` is
  ``input_layernorm.weight``; in a multi-token prediction depth's ``mtp.layers.<k>.transformer_layer.``
  too, whose depths are not stacked), and the vocabulary rows are padded (megalite reads the first
  ``vocab_size`` rows);
- saved with Megatron-Core's ``singleton_local_shards`` (a ``sharded_state_dict`` metadata flag; Megatron-LM's
  default is off), the layers are never stacked, each expert is a tensor of its own
  (``mlp.experts.experts.<e>.linear_fc2.weight``, no expert dimension) and each SwiGLU fc1 is two,
  ``linear_fc1.weight_w`` (gate) and ``linear_fc1.weight_v`` (up), dense MLPs and shared experts too:
  megalite's tensor is assembled from these :class:`Part` s.

:func:`map_names` applies these rules to a checkpoint's DCP metadata; the reader
(:mod:`megalite.checkpoint.megatron_dist`) and the writer (:mod:`megalite.checkpoint.megatron_convert`) share
the names here.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from torch.distributed.checkpoint import metadata as dcp_metadata

from megalite.checkpoint.megatron_optim import megalite_optimizer_prefix
from megalite.checkpoint.sharding import VOCAB_PARAMS

LAYERS = "decoder.layers."
# Megatron-Core's sharded names of the layer norms that Transformer Engine fuses into the next linear layer
# (the local layer spec maps its own norms to them too, so both implementations save the same names).
_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
# Megatron-Core's sharded names of the MoE tensors that megalite names differently: both its SequentialMLP and its
# GroupedMLP (``--moe-grouped-gemm``) save the experts as ``experts.experts.linear_fc1|2`` with an expert dimension
# (SwiGLU fc1 as ``[gate; up]``), the layout of megalite's stacked ``experts.fc1|2_weight``.
_MOE_NAMES = {f"mlp.experts.experts.linear_fc{i}.{kind}": f"mlp.experts.fc{i}_{kind}"
              for i in (1, 2) for kind in ("weight", "bias")}
_MOE_NAMES["mlp.shared_experts.gate_weight"] = "mlp.shared_expert_gate"
_NAMES = {**_TE_NAMES, **_MOE_NAMES}
# A singleton local shard's key: one expert's tensor (``experts.experts.<e>.``), one half of a SwiGLU fc1
# (``weight_w``, ``weight_v``).
_EXPERT = re.compile(r"\.experts\.experts\.(\d+)\.")
_HALF = re.compile(r"\.(weight|bias)_(w|v)$")
_HALVES = ("w", "v")


class Part(NamedTuple):
    """Where one of Megatron's saved tensors lies in megalite's global tensor."""

    key: str
    """Megatron's DCP key."""
    lead: tuple[int, ...]
    """The index this part takes in the key's leading dimensions that megalite's tensor lacks (a stacked layer)."""
    offset: tuple[int, ...]
    """Where the part starts in megalite's tensor."""
    expert: bool
    """Whether megalite's tensor has a leading expert dimension the key lacks (a singleton local shard)."""


class Source(NamedTuple):
    """A megalite tensor of a torch_dist checkpoint: its :class:`Part` s and its global shape."""

    parts: tuple[Part, ...]
    shape: tuple[int, ...]


def megalite_name(key: str) -> str:
    """The megalite name of Megatron's (unstacked part of a) tensor name, e.g. ``mlp.linear_fc1.layer_norm_weight``."""
    return _NAMES.get(key, key)


def megatron_name(name: str) -> str:
    """The inverse of :func:`megalite_name`."""
    return next((theirs for theirs, ours in _NAMES.items() if ours == name), name)


def megalite_key(key: str) -> str:
    """The megalite name of one of Megatron's unstacked tensors (a prediction depth's layer norms included)."""
    return _in_mtp_layer(key, megalite_name)


def megatron_key(name: str) -> str:
    """The inverse of :func:`megalite_key`."""
    return _in_mtp_layer(name, megatron_name)


def _in_mtp_layer(name: str, rename) -> str:
    """``rename`` applied to the part after ``mtp.layers.<k>.transformer_layer.``, else to the whole name."""
    head, layer, rest = name.partition(".transformer_layer.")
    return head + layer + rename(rest) if name.startswith("mtp.layers.") and layer else rename(name)


def map_names(metadata: dcp_metadata.Metadata, vocab_size: int, where: str) -> dict[str, Source]:
    """The :class:`Source` of every megalite tensor in a torch_dist checkpoint's DCP ``metadata``: the model's and the
    optimizer state kept per parameter (``optimizer.state.<key>.<parameter>``, see :func:`megalite_optimizer_prefix`);
    the vocabulary tensors cut to ``vocab_size`` rows.  ValueError naming the checkpoint ``where`` when a tensor saved
    in singleton shards misses a part."""
    sources, singles = {}, {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata) or key.startswith("rng_state"):
            continue
        prefix, model_key = "", key
        if key.startswith(("optimizer.", "chained_")):
            prefix, model_key = megalite_optimizer_prefix(key)
            if prefix is None:
                continue  # another optimizer's layout: :func:`resumable_optimizer` names it
        size = tuple(md.size)
        expert, half = _EXPERT.search(model_key), _HALF.search(model_key)
        if half:
            model_key = model_key[:half.start()] + "." + half.group(1)
        model_key = _EXPERT.sub(".experts.experts.", model_key)
        layer, dot, rest = model_key[len(LAYERS):].partition(".")
        if model_key.startswith(LAYERS) and not (layer.isdigit() and dot):
            if expert or half:
                raise ValueError(f"Megatron-LM checkpoint {where}: {key} is a singleton shard of stacked layers, which "
                                 "Megatron-Core never writes")
            rest = megalite_name(model_key[len(LAYERS):])
            for layer in range(size[0]):
                sources[f"{prefix}{LAYERS}{layer}.{rest}"] = Source((Part(key, (layer,), (0,) * (len(size) - 1),
                                                                         False),), size[1:])
            continue
        if model_key.startswith(LAYERS):
            # Dense and MoE layers mixed (``moe_layer_freq`` not 1) or singleton shards: every layer unstacked.
            name = f"{prefix}{LAYERS}{layer}.{megalite_name(rest)}"
        else:
            name = prefix + megalite_key(model_key)
            if name[len(prefix):] in VOCAB_PARAMS:
                size = (min(size[0], vocab_size),) + size[1:]
        if expert or half:
            singles.setdefault(name, {})[(int(expert.group(1)) if expert else None,
                                          _HALVES.index(half.group(2)) if half else None)] = (key, size)
        else:
            sources[name] = Source((Part(key, (), (0,) * len(size), False),), size)
    for name, pieces in singles.items():
        sources[name] = _assembled(name, pieces, where)
    return sources


def _assembled(name: str, pieces: dict, where: str) -> Source:
    """The :class:`Source` of megalite tensor ``name`` from its singleton local shards ``{(expert or None, half or
    None): (key, size)}``: the experts stacked on a leading dimension, the halves ``[w; v]`` along the first."""
    experts = sorted({e for e, _ in pieces}, key=lambda e: -1 if e is None else e)
    halves = [None] if all(h is None for _, h in pieces) else [0, 1]
    want = [(e, h) for e in (experts if experts == [None] else range(experts[-1] + 1)) for h in halves]
    if set(pieces) != set(want):
        missing = [f"expert {e} " * (e is not None) + (f"_{_HALVES[h]}" if h is not None else "")
                   for e, h in want if (e, h) not in pieces]
        raise ValueError(f"Megatron-LM checkpoint {where}: the singleton shards of {name} are incomplete (missing: "
                         f"{', '.join(missing) or 'none; they mix split and unsplit tensors'})")
    first = pieces[want[0]][1]
    rows = [pieces[(experts[0], h)][1][0] for h in halves]
    shape = (sum(rows),) + first[1:]
    parts = []
    for e, h in want:
        key, size = pieces[(e, h)]
        if size != (rows[0 if h is None else h],) + first[1:]:
            raise ValueError(f"Megatron-LM checkpoint {where}: the singleton shard {key} has shape {size}, unlike "
                             f"the other parts of {name}")
        start = (0,) if h in (None, 0) else (rows[0],)
        parts.append(Part(key, (), ((e,) if e is not None else ()) + start + (0,) * (len(shape) - 1), e is not None))
    return Source(tuple(parts), ((len(experts),) if experts != [None] else ()) + shape)
