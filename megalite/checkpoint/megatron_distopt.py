"""Megatron-Core's distributed optimizer state (``--use-distributed-optimizer``) in megalite's terms.

Megatron-LM saves it in ``torch_dist`` as 'dp_reshardable' (its default): per model-parallel rank
(``dp_group_idx_<i>``), gradient buffer and bucket, one flat tensor per state key,
``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<dtypes>.bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``,
whose length is the bucket's unpadded size; each DP rank wrote its contiguous share of it.  Where each
parameter lies in a bucket is Megatron-Core's gradient-buffer layout (``_ParamAndGradBuffer``), rebuilt here:
the parameters in reverse module order, each start padded to a multiple of 64 elements, a new bucket once a
bucket holds ``bucket_size`` elements (only with ``--overlap-grad-reduce``; ``--ddp-bucket-size``, by default
max(40M, 1M x dp)), each bucket's end padded to a multiple of lcm(dp, 128) (lcm(dp, 128, 2^16) with
``--ddp-pad-buckets-for-high-nccl-busbw``).  The bucket sizes the checkpoint holds must equal the rebuilt
ones, else the state is named and left out.  The step count and parameter groups are the sharded object
``optimizer.distributed.dp_group_idx_0.optimizer``.

Each model-parallel rank (tensor rank t, pipeline rank p: ``dp_group_idx_<t + tp x p>``) has a buffer of its
own local parameters (its stage's layers, its TP shards), laid out by the same rule; each shard's state is placed
into its global tensor by :func:`megalite.checkpoint.sharding.global_param`, the one global layout (per-rank
SwiGLU ``[gate_r; up_r]`` rows, padded vocabulary rows cut), as the legacy reader places weights.

Megatron-LM's legacy format (``--ckpt-format torch``) keeps the same state in ``distrib_optim.pt`` beside each
model-parallel rank's ``model_optim_rng.pt`` (``save_parameter_state``: per gradient buffer, the flat state of
the whole buffer, its buckets' unpadded parts gathered over DP and concatenated), cut by the same layout
(:func:`legacy_distributed_optimizer`).

Read: a dense GPT (no experts) saved at any tp and pp (even pipeline stages; untied embeddings when pp > 1)
with the local layer spec (``--transformer-impl local``), whose module order is :data:`LAYER_ORDER`; megalite
resumes it at any layout.  Other saves are named.
"""

from __future__ import annotations

import math
import re

from megalite.checkpoint.megatron_optim import default_groups_problem, optimizer_meta
from megalite.checkpoint.meta import split_dims
from megalite.checkpoint.sharding import ShardContext, global_param, local_meta

PREFIX = "optimizer.distributed.dp_group_idx_"
# Megatron-Core's state keys of a parameter's flat shard and megalite's names of them.
STATE_KEYS = {"param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# The order Megatron-Core's TransformerLayer (local spec) registers its parameters in.
LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
               "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
               "mlp.linear_fc1.", "mlp.linear_fc2.")
_TOP = {"embedding.word_embeddings.": 0, "embedding.position_embeddings.": 1, "decoder.final_layernorm.": 3,
        "output_layer.": 4}
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_0\.dtype_.+\.bucket_idx_(\d+)\.(\w+)$")
# Megatron-LM's flags of pipeline stages that are not an even split of the layers.
UNEVEN_STAGES = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split", "virtual_pipeline_model_parallel_size")


def _place(name: str):
    """A sort key of ``name`` in Megatron-Core's GPTModel parameter order, or None when megalite does not know it."""
    kind = 0 if name.endswith(".weight") else 1 if name.endswith(".bias") else None
    if kind is None:
        return None
    for prefix, rank in _TOP.items():
        if name.startswith(prefix) and name.count(".") == prefix.count("."):
            return (rank, 0, 0, kind)
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if match is None:
        return None
    module = next((i for i, m in enumerate(LAYER_ORDER) if m == match.group(2) + "."), None)
    return None if module is None else (2, int(match.group(1)), module, kind)


def bucket_layout(numels: list[int], dp: int, bucket_size: int | None, high_bandwidth: bool = False):
    """Megatron-Core's gradient-buffer layout of parameters of ``numels`` elements (module order) under the
    distributed optimizer: ``([(bucket, start within the bucket)] in module order, [each bucket's unpadded size])``."""
    divisor = math.lcm(dp, 128, 2 ** 16) if high_bandwidth else math.lcm(dp, 128)
    places, unpadded = [], []
    start = bucket_start = end = 0
    for numel in reversed(numels):
        start = -(-start // 64) * 64
        places.append((len(unpadded), start - bucket_start))
        end = start + numel
        if bucket_size is not None and end - bucket_start >= bucket_size:
            unpadded.append(end - bucket_start)
            start = bucket_start = -(-end // divisor) * divisor
        else:
            start = end
    if not places or places[-1][0] == len(unpadded):
        unpadded.append(end - bucket_start)
    return places[::-1], unpadded


def _stage(name: str, layers_per_stage: int, pp: int) -> int:
    """The pipeline stage whose model holds ``name`` (Megatron's even split: the embeddings on the first stage,
    the final norm and output layer on the last)."""
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    if match:
        return int(match.group(1)) // layers_per_stage
    return 0 if name.startswith("embedding.") else pp - 1


def stage_layout(config, shapes: dict[str, tuple[int, ...]], p: int, tp: int, pp: int, dp: int,
                 bucket_size: int | None, high_bandwidth: bool = False):
    """The gradient buffer of each tensor rank of pipeline stage ``p`` (model ``config`` whose tensors have
    Megatron's global shapes ``shapes``): ``({parameter: local shape}, its parameters in module order, their
    (bucket, start) as :func:`bucket_layout` gives them, each bucket's unpadded size)``.  ValueError when a
    tensor does not split over ``tp``."""

    dims = split_dims(config)
    local = {}
    for name in (n for n in shapes if _stage(n, config.num_layers // pp, pp) == p):
        dim, shape = dims[name], list(shapes[name])
        if dim is not None:
            if shape[dim] % tp:
                raise ValueError(f"whose {name} {tuple(shape)} does not split over tp={tp}")
            shape[dim] //= tp
        local[name] = tuple(shape)
    return (local, *_rank_buffer(local, p, dp, bucket_size, high_bandwidth))


def _rank_buffer(local: dict[str, tuple[int, ...]], p: int, dp: int, bucket_size: int | None,
                 high_bandwidth: bool):
    """``(parameters in module order, their (bucket, start), each bucket's unpadded size)`` of the gradient buffer of
    a rank of pipeline stage ``p`` that holds the local shards ``local`` (``{parameter: local shape}``)."""
    names = sorted(local, key=lambda n: _place(n) or ())
    # Megatron-Core buckets only the first pipeline stage's buffer (the others reduce off the critical path).
    places, unpadded = bucket_layout([math.prod(local[n]) for n in names], dp, bucket_size if p == 0 else None,
                                     high_bandwidth)
    return names, places, unpadded


def _run_problem(args: dict, config, names, saved):
    """What makes a distributed optimizer's save of the model ``config`` (parameters ``names``) unreadable, or
    ``(its parameter groups, its Adam step, (dp, bucket size, high-bandwidth padding), whether it has fp32 main
    weights of half-precision ones)`` from its saved args and Megatron's inner optimizer state ``saved``
    (``param_groups`` with ``step``; in a one-element list as Megatron saves a sharded object or a chain)."""

    pp = int(args.get("pipeline_model_parallel_size") or 1)
    if args.get("num_experts") or args.get("transformer_impl") != "local":
        return (f"saved with transformer_impl {args.get('transformer_impl')!r}"
                f"{' and experts' if args.get('num_experts') else ''}; megalite reads it from runs of the local "
                "layer spec without experts")
    uneven = next((flag for flag in UNEVEN_STAGES if args.get(flag)), None)
    if uneven or config.num_layers % pp:
        return (f"saved with pipeline stages other than {pp} even ones ({uneven or 'num_layers'}), whose "
                "parameters megalite does not place")
    if pp > 1 and not config.untie_embeddings_and_output_weights:
        return ("of tied embeddings over pipeline stages (the last stage's copy has a bucket of its own), which "
                "megalite does not read")
    dims = split_dims(config)
    unknown = [n for n in names if _place(n) is None or n not in dims]
    if unknown:
        return f"of parameters whose place in Megatron's gradient buffer megalite does not know ({unknown[0]})"
    saved = saved[0] if isinstance(saved, list) and len(saved) == 1 else saved
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return "without its parameter groups"
    groups = saved["param_groups"]
    steps = {g.get("step") for g in groups}  # a float under torch's Adam, an int under TE's or Apex's
    step = next(iter(steps), None)
    if len(steps) != 1 or not isinstance(step, (int, float)) or step != int(step) or step < 1:
        return "without one Adam step count in its parameter groups"
    dp = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
    size = None
    if args.get("overlap_grad_reduce"):
        size = args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp)
    buffer = (dp, size, bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))
    return groups, int(step), buffer, bool(args.get("bf16") or args.get("fp16"))


def distributed_optimizer(args: dict, config, shapes: dict[str, tuple[int, ...]], bucket_sizes: dict,
                          saved: dict | None) -> tuple[dict, dict | None, str | None]:
    """``({megalite optimizer tensor name: [(Megatron bucket key, start, local shape, pieces)]}, megalite's
    optimizer JSON state, None)`` for a 'dp_reshardable' save of the model ``config`` whose model tensors have
    Megatron's global shapes ``shapes`` (megalite names; the vocabulary padded), whose flat bucket tensors have the
    lengths ``bucket_sizes`` (DCP key: length), and whose sharded object ``saved`` holds Megatron's inner optimizer
    state (``optimizer.distributed.dp_group_idx_0.optimizer``); ``({}, None, why not)`` otherwise.  Each
    model-parallel rank (``dp_group_idx`` tp_rank + tp x pp_rank) has its own buffer of its local parameters; each
    of a tensor's parts is one rank's local shard at ``start`` of a bucket, whose ``pieces``
    (:func:`megalite.checkpoint.sharding.global_param`) place it in the global tensor."""

    def no(why):
        return {}, None, f"it is a distributed optimizer's state ('dp_reshardable') {why}"

    found = _run_problem(args, config, shapes, saved)
    if isinstance(found, str):
        return no(found)
    groups, step, (dp, size, high_bandwidth), mixed = found
    problem = default_groups_problem(groups)
    if problem:
        return {}, None, problem
    tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    keys = {}
    for key, length in bucket_sizes.items():
        match = _BUCKET.match(key)
        if match is None:
            return no(f"in more than one gradient buffer ({key})")
        keys.setdefault(int(match.group(1)), {}).setdefault(int(match.group(2)), {})[match.group(3)] = (key, length)
    if sorted(keys) != list(range(tp * pp)):
        return no(f"of model-parallel ranks {sorted(keys)}, not the {tp * pp} of its tp={tp} x pp={pp}")
    dims = split_dims(config)
    flat = {}
    for p in range(pp):
        try:
            local, stage, places, unpadded = stage_layout(config, shapes, p, tp, pp, dp, size, high_bandwidth)
        except ValueError as err:
            return no(str(err))
        for t in range(tp):
            rank = keys[t + tp * p]
            if sorted(rank) != list(range(len(unpadded))) or any(
                    length != unpadded[b] for b, by_state in rank.items() for _, length in by_state.values()):
                return no(f"whose buckets ({ {b: max(l for _, l in s.values()) for b, s in sorted(rank.items())} }) "
                          f"are not the {unpadded} elements megalite's rebuild of Megatron's gradient buffer gives "
                          f"for model-parallel rank {t + tp * p}")
            context = ShardContext(tp_rank=t, tp_size=tp)
            for name, (bucket, start) in zip(stage, places):
                if dims[name] is None and t > 0:
                    continue  # a replica of tensor rank 0's
                pieces = global_param(name, local_meta(local[name], dims[name]), config, context).pieces
                for state, ours in STATE_KEYS.items():
                    if state in rank[bucket] and (state != "param" or mixed):  # fp32: the main weights are the model's
                        flat.setdefault(f"optimizer.{ours}.{name}", []).append(
                            (rank[bucket][state][0], start, local[name], pieces))
    if not all(f"optimizer.{k}.{n}" in flat for n in shapes for k in ("exp_avg", "exp_avg_sq")):
        return no("without Adam moments")
    return flat, optimizer_meta(groups, step), None


def legacy_distributed_optimizer(args: dict, config, saved, buffers: dict, local: dict):
    """``({(tp rank, pp rank): {megalite state key: {parameter: local shard}}}, megalite's optimizer JSON state)``
    of a legacy save's distributed optimizer, or why it cannot be read (a string).  ``saved``: the
    ``optimizer`` entry of ``model_optim_rng.pt`` (Megatron's ``DistributedOptimizer.state_dict()``: the inner
    optimizer's ``param_groups`` with ``step``); ``buffers``: each model-parallel rank's ``distrib_optim.pt``
    (``save_parameter_state``: per gradient buffer and dtype, the flat ``param``/``exp_avg``/``exp_avg_sq`` of
    the whole buffer, its buckets' unpadded parts gathered from the DP ranks and concatenated);
    ``local``: each rank's ``{parameter (global layer numbers): local shape}``."""
    saved = saved[0] if isinstance(saved, list) and len(saved) == 1 else saved
    inner = saved.get("optimizer") if isinstance(saved, dict) else None
    found = _run_problem(args, config, {n for names in local.values() for n in names}, inner)
    if isinstance(found, str):
        return f"it is a distributed optimizer's state {found}"
    groups, step, (dp, size, high_bandwidth), mixed = found
    problem = default_groups_problem(groups)
    if problem:
        return problem
    out = {}
    for (t, p), buffer in buffers.items():
        where = f"the distrib_optim.pt of tensor rank {t}, pipeline rank {p}"
        gbufs = {k: v for k, v in buffer.items() if k != "buckets_coalesced"} if isinstance(buffer, dict) else {}
        if not buffer.get("buckets_coalesced") or list(gbufs) != [0] or len(gbufs[0]) != 1:
            return f"{where} is not Megatron-Core's one coalesced gradient buffer (save_parameter_state)"
        world = next(iter(gbufs[0].values()))
        names, places, unpadded = _rank_buffer(local[(t, p)], p, dp, size, high_bandwidth)
        if world.get("numel_unpadded") != sum(unpadded) or any(
                world[k].numel() != sum(unpadded) for k in STATE_KEYS if k in world):
            return (f"{where} holds {world.get('numel_unpadded')} elements, not the {sum(unpadded)} of megalite's "
                    "rebuild of Megatron's gradient buffer")
        offsets = [sum(unpadded[:b]) for b in range(len(unpadded))]
        states = out.setdefault((t, p), {})
        for name, (bucket, start) in zip(names, places):
            begin, shape = offsets[bucket] + start, local[(t, p)][name]
            for state, ours in STATE_KEYS.items():
                if state in world and (state != "param" or mixed):
                    states.setdefault(ours, {})[name] = world[state][begin:begin + math.prod(shape)].view(shape)
        if any(key not in states for key in ("exp_avg", "exp_avg_sq")):
            return f"{where} holds no Adam moments"
    return out, optimizer_meta(groups, step)
