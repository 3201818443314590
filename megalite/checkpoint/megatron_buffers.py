"""Megatron-Core's gradient-buffer layout under the distributed optimizer, rebuilt from a run's args and shapes.

Megatron-Core's DDP keeps, per model chunk, one buffer (``_ParamAndGradBuffer``) of the chunk's local
parameters (its stage's layers, its TP shards), and its distributed optimizer shards each bucket of it over DP.
Where a parameter lies is the rule :func:`bucket_layout` rebuilds: the parameters in reverse module order, each
start padded to a multiple of 64 elements, a new bucket once a bucket holds ``bucket_size`` elements (only with
``--overlap-grad-reduce``; ``--ddp-bucket-size``, by default max(40M, 1M x dp); and only in the first chunk of
the first pipeline stage: Megatron-Core reduces the others off the critical path, and Megatron-LM's ``get_model``
disables bucketing for chunks after the first), each bucket's end padded to a multiple of lcm(dp, 128)
(lcm(dp, 128, 2^16) with ``--ddp-pad-buckets-for-high-nccl-busbw``).  With tied embeddings over pipeline stages
the first stage's word embeddings and the last stage's copy of them (its ``output_layer.weight``) each take a
bucket of their own (their gradients are all-reduced over the embedding group after the DP reduce-scatter).

Which chunk holds which layers is megalite's one layer split (:func:`megalite.pipeline.split_layers`), the same
as Megatron-Core's for even stages, ``--decoder-first/last-pipeline-num-layers`` and interleaved chunks; for
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` (Megatron-Core splits the
layers plus the embedding and the loss evenly over the stages, then builds one layer fewer on the first and the
last) and for a ``--pipeline-model-parallel-layout`` it is given each stage's layer count
(:func:`megalite.pipeline.split_flags_layout`, the rule training's flags use too).

A layer's local experts lie in the buffer as the run's expert module registers them (:data:`EXPERT_MODULES`):
SequentialMLP each expert's ``linear_fc1`` then ``linear_fc2`` weight; Transformer Engine's TEGroupedMLP
(``--moe-grouped-gemm`` under ``--transformer-impl transformer_engine``) its ``linear_fc1``, a TE ``GroupedLinear``
that registers ``weight0`` .. ``weight{E-1}`` (each ``[out, in]``, one expert's; TransformerEngine
``transformer_engine/pytorch/module/grouped_linear.py``, ``GroupedLinear.__init__``), then its ``linear_fc2``'s;
GroupedMLP (``--moe-grouped-gemm`` with the local spec, or ``--moe-use-legacy-grouped-gemm``) two parameters,
``weight1`` ``[hidden, E x fc1 rows]`` and ``weight2`` ``[E x ffn, hidden]``, whose memory its forward views as
``[E, hidden, fc1 rows]`` and ``[E, ffn, hidden]``: each expert's matrix transposed (Megatron-Core 0.16
``megatron/core/transformer/moe/experts.py``; :func:`grouped_experts`).  Under the Transformer-Engine spec an MoE
layer keeps its pre-MLP norm as a module of its own (only the input norm is fused into ``linear_qkv``).
"""

from __future__ import annotations

import math
import re

import torch

from megalite.checkpoint.meta import split_dims
from megalite.pipeline import LayerLayout, split_flags_layout, split_layers

# The order Megatron-Core's TransformerLayer (local spec) registers its parameters in (an MoE layer's MLP: the
# router, the local experts, the shared experts; a module's own parameters come before its submodules', so the
# SharedExpertMLP's gate, Megatron's ``mlp.shared_experts.gate_weight`` and megalite's :data:`SHARED_EXPERT_GATE`,
# comes before its linears).
SHARED_EXPERT_GATE = "mlp.shared_expert_gate"
LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
               "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
               "mlp.router.", "mlp.experts.", SHARED_EXPERT_GATE + ".", "mlp.shared_experts.linear_fc1.",
               "mlp.shared_experts.linear_fc2.", "mlp.linear_fc1.", "mlp.linear_fc2.")
# megalite's stacked expert weights (``[experts, ...]``) and the names of one local expert's in Megatron-Core's
# SequentialMLP, ``decoder.layers.<l>.mlp.experts.local_experts.<i>.linear_fc<k>.weight``.
EXPERT_WEIGHTS = {"mlp.experts.fc1_weight": "linear_fc1", "mlp.experts.fc2_weight": "linear_fc2"}
_ROUTER = re.compile(r"decoder\.layers\.(\d+)\.mlp\.router\.")
_LOCAL_EXPERT = re.compile(r"(decoder\.layers\.\d+\.)mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
# GroupedMLP's parameters of a layer's local experts, ``decoder.layers.<l>.mlp.experts.weight1|2``.
_GROUPED = re.compile(r"(decoder\.layers\.\d+\.)mlp\.experts\.weight([12])")
EXPERT_MODULES = ("sequential", "te_grouped", "grouped")
"""Megatron-Core's expert modules by how they register a layer's local experts: SequentialMLP, TEGroupedMLP,
GroupedMLP (module docstring)."""
_TOP = {"embedding.word_embeddings.": 0, "mtp.embedding.word_embeddings.": 0, "embedding.position_embeddings.": 1,
        "decoder.final_layernorm.": 3, "output_layer.": 4}
WORD_EMBEDDINGS, OUTPUT_COPY = "embedding.word_embeddings.weight", "output_layer.weight"
# The word embeddings' copy on a last stage with multi-token prediction (pp > 1: its MTP depths embed the shifted
# tokens), megalite's name of it; Megatron-Core's GPTModel registers it first, as ``embedding.word_embeddings``.
MTP_EMBEDDING_COPY = "mtp.embedding.word_embeddings.weight"
# The modules of a multi-token prediction depth (``mtp.layers.<k>.``) in Megatron-Core's registration order; its
# ``transformer_layer.`` in :data:`LAYER_ORDER`.  The depths follow the decoder's final norm.
MTP_ORDER = ("enorm.", "hnorm.", "eh_proj.", "transformer_layer.", "final_layernorm.")
# Under the Transformer-Engine spec (``--transformer-impl transformer_engine``) a dense layer's norms are fused into
# the next linear (TE's LayerNormLinear: ``layer_norm_weight``, ``layer_norm_bias``, then ``weight``, ``bias``):
# megalite's norm of each of those modules.  An MoE layer's pre-MLP norm stays a module of its own (the spec's
# TENorm, in the local spec's place): only its input norm is fused.
TE_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.", "pre_mlp_layernorm.": "mlp.linear_fc1."}
# Megatron-LM's flags of splits that count the embedding and the loss as a pipeline layer each.
_ACCOUNTED = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def place(name: str, te: bool = False, moe_layers: frozenset[int] = frozenset(), expert_module: str = "sequential"):
    """A sort key of ``name`` in Megatron-Core's GPTModel parameter order, or None when megalite does not know it;
    ``te``: the Transformer-Engine spec's order (:data:`TE_FUSED_NORMS`; ``moe_layers``: the MoE layers, whose
    pre-MLP norm is not fused); ``expert_module``: the order of the local experts' weights (:data:`EXPERT_MODULES`).
    Each module registers its weight before its bias, after a fused norm's weight and bias."""
    gate = re.fullmatch(r"decoder\.layers\.(\d+)\." + re.escape(SHARED_EXPERT_GATE), name)
    if gate:  # megalite's name of Megatron's mlp.shared_experts.gate_weight
        return (2, int(gate.group(1)), LAYER_ORDER.index(SHARED_EXPERT_GATE + "."), 0, 2)
    kind = 2 if name.endswith(".weight") else 3 if name.endswith(".bias") else None
    grouped = _GROUPED.fullmatch(name)
    if kind is None and not grouped:
        return None
    fused = re.fullmatch(r"(?:decoder\.layers\.(\d+)|mtp\.layers\.\d+\.transformer_layer)\.(\w+\.)(weight|bias)",
                         name)
    if fused and fused.group(1) and int(fused.group(1)) in moe_layers and fused.group(2) == "pre_mlp_layernorm.":
        fused = None
    if te and fused and fused.group(2) in TE_FUSED_NORMS:
        name, kind = name.replace(fused.group(2), TE_FUSED_NORMS[fused.group(2)]), kind - 2
    for prefix, rank in _TOP.items():
        if name.startswith(prefix) and name.count(".") == prefix.count("."):
            return (rank, 0, 0, 0, kind)
    expert = _LOCAL_EXPERT.fullmatch(name)
    if expert or grouped:  # GroupedMLP's weight1, weight2; SequentialMLP's experts in order, each fc1 then fc2;
        match = expert or grouped  # TEGroupedMLP's fc1 of every expert, then fc2
        layer, module = int(match.group(1).split(".")[2]), LAYER_ORDER.index("mlp.experts.")
        if grouped:
            return (2, layer, module, int(grouped.group(2)), 0, 2)
        index, linear = int(expert.group(2)), int(expert.group(3)[-1])
        return (2, layer, module) + ((linear, index) if expert_module == "te_grouped" else (index, linear)) + (kind,)
    depth = re.fullmatch(r"mtp\.layers\.(\d+)\.(\w+\.)(?:(.+)\.)?(weight|bias)", name)
    if depth and depth.group(2) in MTP_ORDER:  # after the final norm: (3, 1 + depth, module, inner module, kind)
        outer, inner = MTP_ORDER.index(depth.group(2)), depth.group(3)
        if (inner is None) != (depth.group(2) != "transformer_layer."):
            return None
        module = 0 if inner is None else next((i for i, m in enumerate(LAYER_ORDER)
                                               if m == inner + "." and m != "mlp.experts."), None)
        return None if module is None else (3, 1 + int(depth.group(1)), outer, module, kind)
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match is None:
        return None
    module = next((i for i, m in enumerate(LAYER_ORDER) if m == match.group(2) + "." and m != "mlp.experts."), None)
    return None if module is None else (2, int(match.group(1)), module, 0, kind)


def bucket_layout(numels: list[int], dp: int, bucket_size: int | None, high_bandwidth: bool = False,
                  own_bucket: frozenset[int] = frozenset()):
    """Megatron-Core's gradient-buffer layout of parameters of ``numels`` elements (module order) under the
    distributed optimizer: ``([(bucket, start within the bucket)] in module order, [each bucket's unpadded size])``.
    The parameters at the indices ``own_bucket`` (shared embeddings) each take a bucket of their own."""
    divisor = math.lcm(dp, 128, 2 ** 16) if high_bandwidth else math.lcm(dp, 128)
    places, unpadded = {}, []
    start = bucket_start = end = 0
    filled = False

    def close(at: int) -> int:
        nonlocal bucket_start, filled
        unpadded.append(at - bucket_start)  # the 64-element padding of the next start included, as Megatron's
        bucket_start, filled = -(-at // divisor) * divisor, False
        return bucket_start

    for index in reversed(range(len(numels))):
        start = -(-start // 64) * 64
        if index in own_bucket and filled:
            start = close(start)
        places[index] = (len(unpadded), start - bucket_start)
        end, filled = start + numels[index], True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or index in own_bucket:
            start = close(end)
        else:
            start = end
    if filled:
        unpadded.append(end - bucket_start)
    return [places[i] for i in range(len(numels))], unpadded


def _split(args: dict) -> LayerLayout | None:
    """The :class:`~megalite.pipeline.LayerLayout` a run's saved ``args`` split its layers by
    (:func:`megalite.pipeline.split_flags_layout`): its ``--pipeline-model-parallel-layout`` (the string, or the
    parsed layout built from one), or its split counting the embedding and/or the loss as a layer
    (:data:`_ACCOUNTED`); None for an even or first/last split; ValueError naming what megalite does not build."""
    layout = args.get("pipeline_model_parallel_layout") or None
    if layout is not None and not isinstance(layout, str):  # Megatron-LM's parsed PipelineParallelLayerLayout keeps
        state = getattr(layout, "state", None)  # its string as a pickled record (megatron_pickle.Opaque): __dict__
        layout = state.get("input_data") if isinstance(state, dict) else getattr(layout, "input_data", None)
        if not isinstance(layout, str):
            raise ValueError("the saved layout holds no layout string")
    saved = args.get("virtual_pipeline_model_parallel_size") or None
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    split = split_flags_layout(int(args.get("num_layers") or 0), pp, saved, layout, args.get("mtp_num_layers"),
                               *(bool(args.get(flag)) for flag in _ACCOUNTED))
    if layout is not None and saved is not None and saved != (split.vpp or 1):
        raise ValueError(f"pipeline layout {layout!r} has {split.vpp or 1} stage(s) per pipeline rank, but the saved "
                         f"virtual_pipeline_model_parallel_size is {saved}")
    return split


def split_problem(args: dict) -> str | None:
    """What of Megatron-LM's saved ``args`` megalite's layer split does not rebuild (the layers' stages would be
    guessed at), led by its flag, or None: a ``--pipeline-model-parallel-layout`` that
    :func:`megalite.pipeline.parse_layout` refuses, and a split that counts the embedding or the loss as a layer
    whose layers do not split so."""
    try:
        _split(args)
    except ValueError as err:
        flag = "pipeline_model_parallel_layout" if args.get("pipeline_model_parallel_layout") else \
            next(flag for flag in _ACCOUNTED if args.get(flag))
        return f"{flag}: {err}"
    return None


def buffer_args(args: dict) -> dict:
    """The keyword arguments of :func:`chunk_layouts` that Megatron-LM's saved ``args`` give (a dict)."""
    dp = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
    size = None
    if args.get("overlap_grad_reduce") and not args.get("overlap_param_gather_with_optimizer_step"):
        size = args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp)
    first = args.get("decoder_first_pipeline_num_layers") or args.get("num_layers_in_first_pipeline_stage")
    last = args.get("decoder_last_pipeline_num_layers") or args.get("num_layers_in_last_pipeline_stage")
    vpp, stages = args.get("virtual_pipeline_model_parallel_size") or None, None
    try:
        split = _split(args)
    except ValueError:  # split_problem names it
        split = None
    if split is not None:
        vpp, stages = split.vpp, list(split.stage_layers)
    tp = int(args.get("tensor_model_parallel_size") or 1)
    te = args.get("transformer_impl") == "transformer_engine"
    expert_module = "sequential" if not (args.get("num_experts") and args.get("moe_grouped_gemm")) else \
        "te_grouped" if te and not args.get("moe_use_legacy_grouped_gemm") else "grouped"
    return dict(tp=tp, pp=int(args.get("pipeline_model_parallel_size") or 1), dp=dp, bucket_size=size,
                high_bandwidth=bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")),
                vpp=vpp, first=None if stages else first, last=None if stages else last, stage_layers=stages,
                ep=int(args.get("expert_model_parallel_size") or 1),
                etp=int(args.get("expert_tensor_parallel_size") or tp),
                te=te, expert_module=expert_module)


def _chunk_of(name: str, ranges: list[list[tuple[int, int]]]) -> tuple[int, int]:
    """``(pipeline rank, chunk)`` whose model holds ``name``: its layer's, the embeddings on the first chunk of the
    first stage, the final norm and output layer on the last chunk of the last."""
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    if match is None:
        return (0, 0) if name.startswith("embedding.") else (len(ranges) - 1, len(ranges[-1]) - 1)
    layer = int(match.group(1))
    return next((p, c) for p, chunks in enumerate(ranges) for c, (lo, hi) in enumerate(chunks) if lo <= layer < hi)


def chunk_layouts(config, shapes: dict[str, tuple[int, ...]], p: int, tp: int, pp: int, dp: int,
                  bucket_size: int | None, high_bandwidth: bool = False, vpp: int | None = None,
                  first: int | None = None, last: int | None = None, ep: int = 1, etp: int | None = None,
                  te: bool = False, experts: bool = False, stage_layers: list[int] | None = None,
                  expert_module: str = "sequential") -> list[tuple]:
    """The gradient buffer of each model chunk of a (tensor, expert) rank of pipeline stage ``p`` (model ``config``
    whose tensors have Megatron's global shapes ``shapes``), one per chunk: ``({parameter: local shape}, its
    parameters in module order, their (bucket, start) as :func:`bucket_layout` gives them, each bucket's unpadded
    size)``; with ``experts`` the chunks' expert-parallel buffers (ep > 1: Megatron-Core keeps the local experts'
    weights, ``decoder.layers.<l>.mlp.experts.local_experts.<i>.linear_fc<k>.weight``, in buffers of their own,
    sharded over the expert data-parallel group), else the dense ones (which hold the local experts at ep=1);
    ``te``: the Transformer-Engine spec's parameter order (:func:`place`); ``expert_module``: how the local experts
    are registered (:data:`EXPERT_MODULES`; GroupedMLP's as ``decoder.layers.<l>.mlp.experts.weight1|2``).
    With tied embeddings over stages the last chunk of the last stage holds :data:`OUTPUT_COPY`, the copy of the
    word embeddings; with MTP layers over stages :data:`MTP_EMBEDDING_COPY` instead (its own output layer
    apart, also with tied embeddings: then an unused :data:`OUTPUT_COPY`).  ValueError when a tensor does not split
    over ``tp`` (``etp``, ``ep``) or the layers do not split as given."""
    ranges = split_layers(config.num_layers, pp, vpp, first, last, stage_layers=stage_layers)
    dims = split_dims(config)
    etp = etp or tp
    mtp = pp > 1 and bool(config.mtp_num_layers)
    tied = pp > 1 and (mtp or not config.untie_embeddings_and_output_weights)
    copy = MTP_EMBEDDING_COPY if mtp else OUTPUT_COPY
    # Tied embeddings with MTP layers over stages: Megatron-Core's last stage also allocates an output layer of its
    # own (a parameter in the buffer, after the MTP depths; its logits use the stage's embedding copy).
    unused = (OUTPUT_COPY,) if mtp and not config.untie_embeddings_and_output_weights else ()
    if experts:  # the expert data-parallel group: the ranks of one (expert tensor, expert, pipeline) rank
        dp, tied = dp * tp // (etp * ep), False
    layouts = []
    for chunk in range(len(ranges[p])):
        local = {}
        names = [n for n in shapes if _chunk_of(n, ranges) == (p, chunk)]
        if tied and (p, chunk) == (pp - 1, len(ranges[p]) - 1):
            names += [copy, *unused]
        for name in names:
            weight = next((w for w in EXPERT_WEIGHTS if name.endswith("." + w)), None)
            if (experts and weight is None) or (not experts and weight is not None and ep > 1):
                continue  # in the other buffer
            if weight is not None:
                count, *shape = shapes[name]
                dim = dims[name] - 1
                if count % ep or shape[dim] % etp:
                    raise ValueError(f"whose {name} {shapes[name]} does not split over ep={ep}, etp={etp}")
                shape[dim] //= etp
                if expert_module == "grouped":  # each expert's matrix transposed, the local experts side by side
                    rows, cols = shape
                    fc1 = EXPERT_WEIGHTS[weight] == "linear_fc1"
                    local[f"{name[:-len(weight)]}mlp.experts.weight{2 - fc1}"] = \
                        (cols, count // ep * rows) if fc1 else (count // ep * cols, rows)
                    continue
                for index in range(count // ep):
                    local[f"{name[:-len(weight)]}mlp.experts.local_experts.{index}.{EXPERT_WEIGHTS[weight]}.weight"] = \
                        tuple(shape)
                continue
            source = WORD_EMBEDDINGS if name in (copy, *unused) and tied else name
            dim, shape = dims[source], list(shapes[source])
            if dim is not None:
                if shape[dim] % tp:
                    raise ValueError(f"whose {name} {tuple(shape)} does not split over tp={tp}")
                shape[dim] //= tp
            local[name] = tuple(shape)
        layouts.append((local, *buffer_of(local, dp, bucket_size if (p, chunk) == (0, 0) else None, high_bandwidth,
                                          (WORD_EMBEDDINGS, copy) if tied else (), te, expert_module)))
    return layouts


def grouped_experts(name: str, shape: tuple[int, ...], count: int) -> list[tuple[str, int, tuple[int, int]]] | None:
    """The ``count`` local experts in GroupedMLP's parameter ``name`` (``decoder.layers.<l>.mlp.experts.weight1|2``)
    of local shape ``shape``: ``[(the expert's weight as :func:`chunk_layouts` names SequentialMLP's, its first
    element in the parameter, its shape there, the transpose of megalite's)]``; None for another parameter."""
    match = _GROUPED.fullmatch(name)
    if match is None:
        return None
    fc1 = match.group(2) == "1"
    stored = (shape[0], shape[1] // count) if fc1 else (shape[0] // count, shape[1])
    return [(f"{match.group(1)}mlp.experts.local_experts.{index}.linear_fc{2 - fc1}.weight",
             index * stored[0] * stored[1], stored) for index in range(count)]


def grouped_split(state: dict, count: int):
    """The ``(name, value)`` items of a rank's state dict ``state``, GroupedMLP's ``weight1|2`` (or their moments) each
    split into its ``count`` local experts' weights as SequentialMLP names them, in megalite's layout (views, each
    expert's matrix transposed back: :func:`grouped_experts`)."""
    for key, value in state.items():
        experts = grouped_experts(key, tuple(value.shape), count) if isinstance(value, torch.Tensor) else None
        if experts is None:
            yield key, value
            continue
        flat = value.reshape(-1)
        for name, at, stored in experts:
            yield name, flat[at:at + stored[0] * stored[1]].view(stored).t()


def local_expert(name: str) -> tuple[str, int | None] | None:
    """``(megalite's stacked expert weight, local expert index)`` of a local expert's weight ``name``
    (:func:`chunk_layouts`' name of it; the index None for GroupedMLP's ``weight1|2``, all the local experts), or None
    for another parameter."""
    grouped = _GROUPED.fullmatch(name)
    if grouped:
        return f"{grouped.group(1)}mlp.experts.fc{grouped.group(2)}_weight", None
    match = _LOCAL_EXPERT.fullmatch(name)
    if match is None:
        return None
    weight = next(w for w, theirs in EXPERT_WEIGHTS.items() if theirs == match.group(3))
    return match.group(1) + weight, int(match.group(2))


def buffer_of(local: dict[str, tuple[int, ...]], dp: int, bucket_size: int | None, high_bandwidth: bool = False,
              shared: tuple[str, ...] = (), te: bool = False, expert_module: str = "sequential"):
    """``(parameters in module order, their (bucket, start), each bucket's unpadded size)`` of the gradient buffer of
    a model chunk that holds the local shards ``local`` (``{parameter: local shape}``); ``shared``: the word
    embeddings and their copy on another stage (tied embeddings or MTP layers over pipeline stages:
    :data:`WORD_EMBEDDINGS` and :data:`OUTPUT_COPY` or :data:`MTP_EMBEDDING_COPY`), each in a bucket of its own;
    ``te``: the Transformer-Engine spec's parameter order (a layer with a router is an MoE layer); ``expert_module``:
    the local experts' (:func:`place`)."""
    moe_layers = frozenset(int(m.group(1)) for m in map(_ROUTER.match, local) if m)
    order = sorted(local, key=lambda n: place(n, te, moe_layers, expert_module) or ())
    own = frozenset(i for i, n in enumerate(order) if n in shared)
    places, unpadded = bucket_layout([math.prod(local[n]) for n in order], dp, bucket_size, high_bandwidth, own)
    return order, places, unpadded
