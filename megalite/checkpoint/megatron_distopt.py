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

Read: a dense GPT (no experts) saved at any tp and pp (even pipeline stages; untied embeddings when pp > 1)
with the local layer spec (``--transformer-impl local``), whose module order is :data:`LAYER_ORDER`; megalite
resumes it at any layout.  Other saves are named.
"""

from __future__ import annotations

import math
import re

from megalite.checkpoint.megatron_optim import default_groups_problem, optimizer_meta
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
    Megatron's global shapes ``shapes``): ``(its parameters in module order, {parameter: local shape}, their
    (bucket, start) as :func:`bucket_layout` gives them, each bucket's unpadded size)``.  ValueError when a
    tensor does not split over ``tp``."""
    from megalite.checkpoint import split_dims

    dims = split_dims(config)
    stage = [n for n in sorted(shapes, key=lambda n: _place(n) or ())
             if _stage(n, config.num_layers // pp, pp) == p]
    local = {}
    for name in stage:
        dim, shape = dims[name], list(shapes[name])
        if dim is not None:
            if shape[dim] % tp:
                raise ValueError(f"whose {name} {tuple(shape)} does not split over tp={tp}")
            shape[dim] //= tp
        local[name] = tuple(shape)
    # Megatron-Core buckets only the first pipeline stage's buffer (the others reduce off the critical path).
    places, unpadded = bucket_layout([math.prod(local[n]) for n in stage], dp, bucket_size if p == 0 else None,
                                     high_bandwidth)
    return stage, local, places, unpadded


def distributed_optimizer(args: dict, config, shapes: dict[str, tuple[int, ...]], bucket_sizes: dict,
                          saved: dict | None) -> tuple[dict, dict | None, str | None]:
    """``({megalite optimizer tensor name: [(Megatron bucket key, start, local shape, pieces)]}, megalite's
    optimizer JSON state, None)`` for a 'dp_reshardable' save of the model ``config`` whose model tensors have
    Megatron's global shapes ``shapes`` (megalite names; the vocabulary padded), whose flat bucket tensors have the
    lengths ``bucket_sizes`` (DCP key: length), and whose sharded object ``saved`` holds Megatron's inner optimizer
    state (``param_groups`` with ``step``, in a one-element list as Megatron saves a sharded object); ``({}, None,
    why not)`` otherwise.  Each model-parallel rank (``dp_group_idx`` tp_rank + tp x pp_rank) has its own buffer of
    its local parameters; each of a tensor's parts is one rank's local shard at ``start`` of a bucket, whose
    ``pieces`` (:func:`megalite.checkpoint.sharding.global_param`) place it in the global tensor."""
    from megalite.checkpoint import split_dims

    def no(why):
        return {}, None, f"it is a distributed optimizer's state ('dp_reshardable') {why}"

    tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    if args.get("num_experts") or args.get("transformer_impl") != "local":
        return no(f"saved with transformer_impl {args.get('transformer_impl')!r}"
                  f"{' and experts' if args.get('num_experts') else ''}; megalite reads it from runs of the local "
                  "layer spec without experts")
    uneven = next((flag for flag in UNEVEN_STAGES if args.get(flag)), None)
    if uneven or config.num_layers % pp:
        return no(f"saved with pipeline stages other than {pp} even ones ({uneven or 'num_layers'}), whose "
                  "parameters megalite does not place")
    if pp > 1 and not config.untie_embeddings_and_output_weights:
        return no("of tied embeddings over pipeline stages (the last stage's copy has a bucket of its own), which "
                  "megalite does not read")
    dims = split_dims(config)
    unknown = [n for n in shapes if _place(n) is None or n not in dims]
    if unknown:
        return no(f"of parameters whose place in Megatron's gradient buffer megalite does not know ({unknown[0]})")
    saved = saved[0] if isinstance(saved, list) and len(saved) == 1 else saved
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return no("without its parameter groups (optimizer.distributed.dp_group_idx_0.optimizer)")
    groups = saved["param_groups"]
    problem = default_groups_problem(groups)
    if problem:
        return {}, None, problem
    steps = {g.get("step") for g in groups}  # a float under torch's Adam, an int under TE's or Apex's
    step = next(iter(steps))
    if len(steps) != 1 or not isinstance(step, (int, float)) or step != int(step) or step < 1:
        return no("without one Adam step count in its parameter groups")
    dp = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
    size = None
    if args.get("overlap_grad_reduce"):
        size = args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp)
    keys = {}
    for key, length in bucket_sizes.items():
        match = _BUCKET.match(key)
        if match is None:
            return no(f"in more than one gradient buffer ({key})")
        keys.setdefault(int(match.group(1)), {}).setdefault(int(match.group(2)), {})[match.group(3)] = (key, length)
    if sorted(keys) != list(range(tp * pp)):
        return no(f"of model-parallel ranks {sorted(keys)}, not the {tp * pp} of its tp={tp} x pp={pp}")
    mixed = bool(args.get("bf16") or args.get("fp16"))
    flat = {}
    for p in range(pp):
        try:
            stage, local, places, unpadded = stage_layout(config, shapes, p, tp, pp, dp, size,
                                                          bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))
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
    return flat, optimizer_meta(groups, int(step)), None
