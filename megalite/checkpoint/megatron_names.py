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
  ``vocab_size`` rows).

:func:`map_names` applies these rules to a checkpoint's DCP metadata; the reader
(:mod:`megalite.checkpoint.megatron_dist`) and the writer (:mod:`megalite.checkpoint.megatron_convert`) share
the names here.
"""

from __future__ import annotations

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


def map_names(metadata: dcp_metadata.Metadata, vocab_size: int) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``{megalite name: (Megatron key, leading offset, megalite global shape)}`` of every model tensor in a torch_dist
    checkpoint's DCP ``metadata`` and of the optimizer state kept per parameter (``optimizer.state.<key>.<parameter>``,
    see :func:`megalite_optimizer_prefix`); the vocabulary tensors cut to ``vocab_size`` rows."""
    sources = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata) or key.startswith("rng_state"):
            continue
        prefix, model_key = "", key
        if key.startswith(("optimizer.", "chained_")):
            prefix, model_key = megalite_optimizer_prefix(key)
            if prefix is None:
                continue  # another optimizer's layout: :func:`resumable_optimizer` names it
        size = tuple(md.size)
        layer, dot, rest = model_key[len(LAYERS):].partition(".")
        if model_key.startswith(LAYERS) and layer.isdigit() and dot:
            # Dense and MoE layers mixed (``moe_layer_freq`` not 1): Megatron-Core saves every layer unstacked.
            sources[f"{prefix}{LAYERS}{layer}.{megalite_name(rest)}"] = (key, (), size)
        elif model_key.startswith(LAYERS):
            rest = megalite_name(model_key[len(LAYERS):])
            for layer in range(size[0]):
                sources[f"{prefix}{LAYERS}{layer}.{rest}"] = (key, (layer,), size[1:])
        else:
            name = megalite_key(model_key)
            if name in VOCAB_PARAMS:
                size = (min(size[0], vocab_size),) + size[1:]
            sources[prefix + name] = (key, (), size)
    return sources
