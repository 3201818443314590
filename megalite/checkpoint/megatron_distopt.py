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

Read: a dense GPT (no experts) saved at tp=1, pp=1 with the local layer spec (``--transformer-impl local``),
whose module order is :data:`LAYER_ORDER`; megalite resumes it at any layout.  Other saves are named.
"""

from __future__ import annotations

import math
import re

from megalite.checkpoint.megatron_optim import default_groups_problem, optimizer_meta

PREFIX = "optimizer.distributed.dp_group_idx_"
# Megatron-Core's state keys of a parameter's flat shard and megalite's names of them.
STATE_KEYS = {"param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# The order Megatron-Core's TransformerLayer (local spec) registers its parameters in.
LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
               "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
               "mlp.linear_fc1.", "mlp.linear_fc2.")
_TOP = {"embedding.word_embeddings.": 0, "embedding.position_embeddings.": 1, "decoder.final_layernorm.": 3,
        "output_layer.": 4}
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_0\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$")


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


def distributed_optimizer(args: dict, shapes: dict[str, tuple[int, ...]], numels: dict[str, int], bucket_sizes: dict,
                          saved: dict | None) -> tuple[dict, dict | None, str | None]:
    """``({megalite optimizer tensor name: (Megatron bucket key, start, shape)}, megalite's optimizer JSON state,
    None)`` for a 'dp_reshardable' save whose model tensors are ``shapes`` (megalite names, global; a vocabulary
    parameter's first rows, which lie first in its flat state) of ``numels`` elements as Megatron holds them, whose flat
    bucket tensors have the lengths ``bucket_sizes`` (DCP key: length), and whose sharded object ``saved`` holds
    Megatron's inner optimizer state (``param_groups`` with ``step``, in a one-element list as Megatron saves a
    sharded object); ``({}, None, why not)`` otherwise."""
    def no(why):
        return {}, None, f"it is a distributed optimizer's state ('dp_reshardable') {why}"

    tp, pp = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
    if (tp, pp) != (1, 1) or args.get("num_experts") or args.get("transformer_impl") != "local":
        return no(f"saved at tp={tp}, pp={pp} with transformer_impl {args.get('transformer_impl')!r}"
                  f"{' and experts' if args.get('num_experts') else ''}; megalite reads it from tp=1, pp=1 runs of "
                  "the local layer spec without experts")
    names = sorted(shapes, key=lambda n: _place(n) or ())
    unknown = [n for n in names if _place(n) is None]
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
    places, unpadded = bucket_layout([numels[n] for n in names], dp, size,
                                     bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))
    keys = {}
    for key, length in bucket_sizes.items():
        match = _BUCKET.match(key)
        if match is None:
            return no(f"in more than one gradient buffer or model-parallel rank ({key})")
        keys.setdefault(int(match.group(2)), {})[match.group(3)] = (key, length)
    if sorted(keys) != list(range(len(unpadded))) or any(
            length != unpadded[b] for b, by_state in keys.items() for _, length in by_state.values()):
        return no(f"whose buckets ({ {b: max(l for _, l in s.values()) for b, s in sorted(keys.items())} }) are not "
                  f"the {unpadded} elements megalite's rebuild of Megatron's gradient buffer gives")
    mixed = bool(args.get("bf16") or args.get("fp16"))
    flat = {}
    for name, (bucket, start) in zip(names, places):
        for state, ours in STATE_KEYS.items():
            if state in keys[bucket] and (state != "param" or mixed):  # fp32 runs: the main weights are the model's
                flat[f"optimizer.{ours}.{name}"] = (keys[bucket][state][0], start, shapes[name])
    if not all(f"optimizer.{k}.{n}" in flat for n in names for k in ("exp_avg", "exp_avg_sq")):
        return no("without Adam moments")
    return flat, optimizer_meta(groups, int(step)), None
