"""Megatron-Core's distributed optimizer state (``--use-distributed-optimizer``) in megalite's terms.

Megatron-LM saves it in ``torch_dist`` as 'dp_reshardable' (its default): per model-parallel rank
(``dp_group_idx_<i>``), gradient buffer and bucket, one flat tensor per state key,
``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<dtypes>.bucket_idx_<b>.<param|exp_avg|exp_avg_sq>``,
whose length is the bucket's unpadded size; each DP rank wrote its contiguous share of it.  A gradient buffer
is a model chunk's (``gbuf_idx_<chunk>``: one, or one per interleaved chunk).  Where each parameter lies in a
bucket is Megatron-Core's gradient-buffer layout (``_ParamAndGradBuffer``), rebuilt by
:mod:`megalite.checkpoint.megatron_buffers`.  The bucket sizes the checkpoint holds must equal the rebuilt
ones, else the state is named and left out.  The step count and parameter groups are the sharded object
``optimizer.distributed.dp_group_idx_0.optimizer``.

Each model-parallel rank (tensor rank t, pipeline rank p: ``dp_group_idx_<t + tp x p>``) has a buffer per model
chunk of its own local parameters (the chunk's layers, its TP shards); each shard's state is placed
into its global tensor by :func:`megalite.checkpoint.sharding.global_param`, the one global layout (per-rank
SwiGLU ``[gate_r; up_r]`` rows, padded vocabulary rows cut), as the legacy reader places weights.

Megatron-LM's legacy format (``--ckpt-format torch``) keeps the same state in ``distrib_optim.pt`` beside each
model-parallel rank's ``model_optim_rng.pt`` (``save_parameter_state``: per gradient buffer (model chunk), the
flat state of the whole buffer, its buckets' unpadded parts gathered over DP and concatenated), cut by the same
layout, :func:`megalite.checkpoint.megatron_buffers.chunk_layouts` (:func:`legacy_distributed_optimizer`).

Under the Transformer-Engine spec (``--transformer-impl transformer_engine``) the order differs: TE's
LayerNormLinear registers its fused norm's parameters before its own weight and bias, and the fused norms sit in
``linear_qkv`` (after ``linear_proj``) and, in a dense layer, ``linear_fc1``
(:data:`megalite.checkpoint.megatron_buffers.TE_FUSED_NORMS`; an MoE layer keeps its pre-MLP norm apart).  A
shared expert's gate (``--moe-shared-expert-gate``, ``mlp.shared_experts.gate_weight``) precedes its linears.

An MoE run at ep > 1 chains two optimizers (``chained_0.`` the dense parameters', ``chained_1.`` the experts'):
each expert-model-parallel rank keeps its local experts' weights in buffers of their own, sharded over the expert
data-parallel group; each local expert's state is placed at its expert's index of megalite's stacked expert
weights.  SequentialMLP, TEGroupedMLP and GroupedMLP (``--moe-grouped-gemm``) register the local experts
differently (:data:`megalite.checkpoint.megatron_buffers.EXPERT_MODULES`): GroupedMLP's ``weight1``/``weight2``
hold each local expert's matrix transposed, read back into megalite's layout.

Read: a GPT saved at any tp, pp and ep (even or ``--decoder-first/last-pipeline-num-layers`` stages,
interleaved chunks, the stages of ``--pipeline-model-parallel-layout`` or of a split that counts the embedding or
loss as a layer, MTP depths on the last stage (the stage's copy of the word embeddings unread; with tied
embeddings also its unused output layer, a save only the legacy format holds: Megatron-Core 0.16's torch_dist
save of such a run fails its own check that the stage has no output weight), tied embeddings: the first stage's
copy's state; the experts of any of the three modules) with the local layer spec
(``--transformer-impl local``, module order :data:`megalite.checkpoint.megatron_buffers.LAYER_ORDER`) or
Transformer Engine's; megalite resumes it at any layout.  The legacy format's reader reads
the same layouts (the chained optimizers' buffers of an MoE run at ep > 1 in a list in ``distrib_optim.pt``).
Other saves are named.
"""

from __future__ import annotations

import math
import re

from dataclasses import replace

from megalite.checkpoint.megatron_buffers import (EXPERT_WEIGHTS, MTP_EMBEDDING_COPY, OUTPUT_COPY, buffer_args,
                                                  chunk_layouts, grouped_experts, local_expert, place, split_problem)
from megalite.checkpoint.megatron_optim import chain_groups, optimizer_meta
from megalite.checkpoint.meta import split_dims
from megalite.checkpoint.sharding import ShardContext, global_param, local_meta
from megalite.pipeline import split_layers

PREFIX = "optimizer.distributed.dp_group_idx_"
# Megatron-Core's state keys of a parameter's flat shard and megalite's names of them.
STATE_KEYS = {"param": "main", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+"
                     r"\.bucket_idx_(\d+)\.(\w+)$")


def dp_reshardable(saved) -> list[str] | None:
    """The key prefixes (``""``, or ``chained_<k>.`` of each chained optimizer: an MoE run at ep > 1) of a
    'dp_reshardable' distributed optimizer whose ``common.pt`` entry is ``saved``; None for another optimizer."""
    chained = isinstance(saved, dict) and bool(saved) and all(isinstance(k, int) for k in saved)
    chain = [saved[k] for k in sorted(saved)] if chained else [saved]
    if all(isinstance(s, dict) and s.get("param_state_sharding_type") == "dp_reshardable" for s in chain):
        return [f"chained_{k}." for k in range(len(chain))] if chained else [""]
    return None


def _inners(saved) -> list:
    """Megatron's inner optimizer states of ``saved``: one, a one-element list (a sharded object), or a list of the
    chained optimizers' (an MoE run at ep > 1: the dense parameters', then the experts')."""
    saved = saved if isinstance(saved, list) else [saved]
    return [s[0] if isinstance(s, list) and len(s) == 1 else s for s in saved]


def _run_problem(args: dict, config, names, saved):
    """What makes a distributed optimizer's save of the model ``config`` (parameters ``names``) unreadable, or
    ``(its dense parameter groups, why they cannot join megalite's two or None (:func:`chain_groups`), its inner
    optimizer states, its Adam step, :func:`buffer_args`, whether it has fp32 main weights of half-precision
    ones)`` from its saved args and Megatron's inner optimizer states ``saved`` (:func:`_inners`: ``param_groups``
    with ``step``)."""

    pp = int(args.get("pipeline_model_parallel_size") or 1)
    impl = args.get("transformer_impl")
    if impl not in ("local", "transformer_engine"):
        return (f"saved with transformer_impl {impl!r}; megalite reads it from runs of the local layer spec or of "
                "Transformer Engine's")
    layout = buffer_args(args)
    other = split_problem(args)
    try:
        split_layers(config.num_layers, pp, layout["vpp"], layout["first"], layout["last"],
                     stage_layers=layout["stage_layers"])
    except ValueError as err:
        other = other or str(err)
    if other:
        return f"saved with pipeline stages megalite does not place ({other})"
    dims = split_dims(config)
    unknown = [n for n in names if n not in dims or (place(n) is None and not n.endswith(tuple(EXPERT_WEIGHTS)))]
    if unknown:
        return f"of parameters whose place in Megatron's gradient buffer megalite does not know ({unknown[0]})"
    inners = _inners(saved)
    if not all(isinstance(inner, dict) and isinstance(inner.get("param_groups"), list) for inner in inners):
        return "without its parameter groups"
    steps = {g.get("step") for inner in inners for g in inner["param_groups"]}  # a float under torch's Adam
    step = next(iter(steps), None)
    if len(steps) != 1 or not isinstance(step, (int, float)) or step != int(step) or step < 1:
        return "without one Adam step count in its parameter groups"
    groups, problem = chain_groups(inners)
    return groups, problem, inners, int(step), layout, bool(args.get("bf16") or args.get("fp16"))


def distributed_optimizer(args: dict, config, shapes: dict[str, tuple[int, ...]], bucket_sizes: dict,
                          saved) -> tuple[dict, dict | None, str | None]:
    """``({megalite optimizer tensor name: [(Megatron bucket key, start, local shape, pieces, transposed)]}, megalite's
    optimizer JSON state, None)`` for a 'dp_reshardable' save of the model ``config`` whose model tensors have
    Megatron's global shapes ``shapes`` (megalite names; the vocabulary padded), whose flat bucket tensors have the
    lengths ``bucket_sizes`` (DCP key: length), and whose sharded objects ``saved`` (:func:`_inners`) hold
    Megatron's inner optimizer states (``[chained_<k>.]optimizer.distributed.dp_group_idx_0.optimizer``);
    ``({}, None, why not)`` otherwise.  Each model-parallel rank (``dp_group_idx`` tp_rank + tp x pp_rank) has its
    own buffer of each model chunk's local parameters (``gbuf_idx`` the chunk); at ep > 1 each expert-model-parallel
    rank (etp_rank + etp x (ep_rank + ep x pp_rank)) has one of its local experts in the second chained optimizer
    (``chained_1.``).  Each of a tensor's parts is one rank's local shard at ``start`` of a bucket, whose ``pieces``
    (:func:`megalite.checkpoint.sharding.global_param`) place it in the global tensor (``transposed``: the bucket
    holds the shard's last two dimensions swapped, a GroupedMLP expert's).  The last stage's copy of
    tied embeddings is not read: the first stage's copy has the same state."""

    def no(why):
        return {}, None, f"it is a distributed optimizer's state ('dp_reshardable') {why}"

    found = _run_problem(args, config, shapes, saved)
    if isinstance(found, str):
        return no(found)
    groups, problem, inners, step, layout, mixed = found
    if problem:
        return {}, None, problem
    tp, pp, ep, etp = layout["tp"], layout["pp"], layout["ep"], layout["etp"]
    expert_chain = ep > 1 and bool(args.get("num_experts"))
    if len(inners) != 1 + expert_chain:
        return no(f"of {len(inners)} chained optimizers, not the {1 + expert_chain} of its dense and expert "
                  "parameters")
    keys = {}
    for key, length in bucket_sizes.items():
        match = _BUCKET.match(key)
        if match is None:
            return no(f"in a gradient buffer megalite does not know ({key})")
        chain, rank, gbuf, bucket = (int(g or 0) for g in match.group(1, 2, 3, 4))
        keys.setdefault(chain, {}).setdefault(rank, {}).setdefault(gbuf, {}).setdefault(bucket, {})[
            match.group(5)] = (key, length)
    flat = {}
    # (chain, buffer ranks: (dp_group_idx, pipeline rank, tensor rank, expert rank)), expert tensor-parallel size)
    passes = [(0, [(t + tp * p, p, t, 0) for p in range(pp) for t in range(tp)], tp)]
    if expert_chain:
        passes.append((1, [(t + etp * (e + ep * p), p, t, e) for p in range(pp) for e in range(ep)
                           for t in range(etp)], etp))
    for chain, ranks, expert_tp in passes:
        if sorted(keys.get(chain, {})) != [rank for rank, *_ in sorted(ranks)]:
            return no(f"of model-parallel ranks {sorted(keys.get(chain, {}))}, not the {len(ranks)} of its tp={tp} x "
                      f"pp={pp}{f' x ep={ep}' if chain else ''}")
        for rank, p, t, e in ranks:
            try:
                chunks = chunk_layouts(config, shapes, p, **layout, experts=chain == 1)
            except ValueError as err:
                return no(str(err))
            why = _read_rank(flat, keys[chain][rank], chunks, config, shapes, mixed,
                             ShardContext(tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep, etp_rank=t,
                                          etp_size=expert_tp))
            if why:
                return no(f"{why} for model-parallel rank {rank}")
    if not all(f"optimizer.{k}.{n}" in flat for n in shapes for k in ("exp_avg", "exp_avg_sq")):
        return no("without Adam moments")
    return flat, optimizer_meta(groups, step), None


def _read_rank(flat: dict, buffers: dict, chunks: list, config, shapes: dict, mixed: bool, ctx: ShardContext):
    """Add to ``flat`` (:func:`distributed_optimizer`'s) the state of one rank's local parameters, its gradient
    buffers ``buffers`` (``{gbuf: {bucket: {state key: (DCP key, length)}}}``) laid out as ``chunks``
    (:func:`chunk_layouts`), at ``ctx``'s coordinates; why not (a string) when the buckets are others."""
    dims = split_dims(config)
    if sorted(buffers) != list(range(len(chunks))):
        return f"whose gradient buffers {sorted(buffers)} are not one per model chunk ({len(chunks)})"
    for chunk, (local, names, places, unpadded) in enumerate(chunks):
        rank = buffers[chunk]
        if sorted(rank) != list(range(len(unpadded))) or any(
                length != unpadded[b] for b, by_state in rank.items() for _, length in by_state.values()):
            sizes = {b: max(length for _, length in s.values()) for b, s in sorted(rank.items())}
            return f"whose buckets ({sizes}) are not the {unpadded} elements megalite's rebuild of Megatron's " \
                   "gradient buffer gives"
        for name, (bucket, start) in zip(names, places):
            if name in (OUTPUT_COPY, MTP_EMBEDDING_COPY) and name not in shapes:
                continue  # the last stage's copy of the word embeddings (tied, or for MTP layers)
            # GroupedMLP's weight1|2: its local experts one after the other, each matrix transposed
            grouped = grouped_experts(name, local[name], config.moe.num_experts // ctx.ep_size if config.moe else 1)
            for part, at, stored in grouped or [(name, 0, None)]:
                expert = local_expert(part)
                if expert is None:
                    if dims[name] is None and ctx.tp_rank > 0:
                        break  # a replica of tensor rank 0's
                    ours, shape = name, local[name]
                    pieces = global_param(name, local_meta(shape, dims[name]), config,
                                          replace(ctx, ep_rank=0, ep_size=1)).pieces
                else:  # one local expert: its own place along the expert dimension
                    ours, shape, found = expert_param(part, stored[::-1] if stored else local[part],
                                                      shapes[expert[0]][0], dims, config, ctx)
                    pieces = found.pieces
                for state, key in STATE_KEYS.items():
                    if state in rank[bucket] and (state != "param" or mixed):  # fp32: the main weights are the model's
                        flat.setdefault(f"optimizer.{key}.{ours}", []).append((rank[bucket][state][0], start + at,
                                                                               shape, pieces, stored is not None))
    return None


def expert_param(name: str, shape: tuple[int, ...], count: int, dims: dict, config, ctx: ShardContext):
    """``(megalite's stacked expert weight, the local shard's shape with its expert dimension (1, ...), its
    :class:`megalite.checkpoint.sharding.GlobalParam`)`` of one local expert's weight ``name``
    (:func:`megalite.checkpoint.megatron_buffers.local_expert`'s) of local shape ``shape`` on the (expert tensor,
    expert) rank of ``ctx`` (``ep_size`` ranks of ``count`` experts), or None for another parameter."""
    expert = local_expert(name)
    if expert is None:
        return None
    ours, index = expert
    shape = (1, *shape)
    meta = local_meta(shape, dims[ours])
    meta.expert_parallel = True
    context = replace(ctx, ep_rank=ctx.ep_rank * (count // ctx.ep_size) + index, ep_size=count)
    return ours, shape, global_param(ours, meta, config, context)


def legacy_distributed_optimizer(args: dict, config, saved, buffers: dict, local: dict):
    """``({(tp rank, pp rank, ep rank): [{megalite state key: {parameter: local shard}} per model chunk]}, megalite's
    optimizer JSON state)`` of a legacy save's distributed optimizer, or why it cannot be read (a string).
    ``saved``: the ``optimizer`` entry of ``model_optim_rng.pt`` (Megatron's ``DistributedOptimizer.state_dict()``:
    the inner optimizer's ``param_groups`` with ``step``; at ep > 1 a list, the dense parameters' and the experts'
    chained optimizers'); ``buffers``: each model-parallel rank's ``distrib_optim.pt`` (``save_parameter_state``:
    per gradient buffer (model chunk) and dtype, the flat ``param``/``exp_avg``/``exp_avg_sq`` of the whole buffer,
    its buckets' unpadded parts gathered from the DP ranks and concatenated; at ep > 1 a list of the chained
    optimizers' (None where the rank is not the dense optimizer's first DP rank)); ``local``: each rank's
    ``[{parameter (global layer numbers; Megatron's local expert names): local shape} per model chunk]``.
    Each buffer is cut by :func:`chunk_layouts`, the torch_dist reader's rule, which must give the rank's saved
    parameters and shapes; the last stage's copy of tied embeddings is not read (the first stage's has its state),
    nor the dense state of expert-parallel ranks after the first (the first's has it)."""
    chain = saved if isinstance(saved, list) else [saved]
    inners = [s.get("optimizer") if isinstance(s, dict) else None for s in chain]
    tied = not config.untie_embeddings_and_output_weights
    dims = split_dims(config)
    copies = (OUTPUT_COPY, MTP_EMBEDDING_COPY) if tied else (MTP_EMBEDDING_COPY,)  # not read: as the first stage's
    names = {(local_expert(n) or (n,))[0] for chunks in local.values() for chunk in chunks for n in chunk
             if n not in copies}
    found = _run_problem(args, config, names, inners)
    if isinstance(found, str):
        return f"it is a distributed optimizer's state {found}"
    groups, problem, inners, step, layout, mixed = found
    if problem:
        return problem
    expert_chain = layout["ep"] > 1 and bool(args.get("num_experts"))
    if len(inners) != 1 + expert_chain:
        return (f"it is a distributed optimizer's state of {len(inners)} chained optimizers, not the "
                f"{1 + expert_chain} of its dense and expert parameters")
    shapes = {}  # Megatron's global shapes (the vocabulary padded; experts stacked), from the first ranks' shards
    for (t, _, e), chunks in local.items():
        for chunk in chunks:
            for n, shape in chunk.items():
                expert = local_expert(n)
                if expert and expert[1] is None:  # GroupedMLP's weight1|2: one expert's shape
                    shape = grouped_experts(n, shape, config.moe.num_experts // layout["ep"])[0][2][::-1]
                if t == 0 and e == 0 and (n in names or expert):
                    ours, lead = (n, ()) if expert is None else (expert[0], (config.moe.num_experts,))
                    dim = dims[ours] - len(lead) if dims[ours] is not None else None
                    shapes[ours] = (*lead, *(d * layout["tp"] if i == dim else d for i, d in enumerate(shape)))
    out = {}
    for (t, p, e), buffer in buffers.items():
        where = f"the distrib_optim.pt of tensor rank {t}, pipeline rank {p}" + (f", expert rank {e}" if e else "")
        flats = buffer if expert_chain and isinstance(buffer, list) and len(buffer) == 2 else [buffer]
        per_chunk = out.setdefault((t, p, e), [{} for _ in local[(t, p, e)]])
        for experts, flat in enumerate(flats):
            if not experts and e > 0:
                continue  # the dense state is the first expert rank's
            try:
                chunks = chunk_layouts(config, shapes, p, **layout, experts=bool(experts))
            except ValueError as err:
                return f"it is a distributed optimizer's state {err}"
            gbufs = {k: v for k, v in flat.items() if k != "buckets_coalesced"} if isinstance(flat, dict) else {}
            if (not isinstance(flat, dict) or not flat.get("buckets_coalesced")
                    or sorted(gbufs) != list(range(len(chunks))) or any(len(d) != 1 for d in gbufs.values())):
                return (f"{where} is not Megatron-Core's coalesced gradient buffers (save_parameter_state), one per "
                        f"model chunk ({len(chunks)})" + (" of its dense and its expert parameters" if expert_chain
                                                          else ""))
            for chunk, (shards, order, places, unpadded) in enumerate(chunks):
                saved_shards = {n: s for n, s in local[(t, p, e)][chunk].items()
                                if not expert_chain or (local_expert(n) is not None) == bool(experts)}
                if shards != saved_shards:
                    return (f"{where}: the parameters of its model chunk {chunk} are not those megalite's rebuild of "
                            "Megatron's gradient buffer gives")
                world = next(iter(gbufs[chunk].values()))
                if world.get("numel_unpadded") != sum(unpadded) or any(
                        world[k].numel() != sum(unpadded) for k in STATE_KEYS if k in world):
                    return (f"{where} holds {world.get('numel_unpadded')} elements in its buffer {chunk}, not the "
                            f"{sum(unpadded)} of megalite's rebuild of Megatron's gradient buffer")
                if any(key not in world for key in ("exp_avg", "exp_avg_sq")):
                    return f"{where} holds no Adam moments"
                offsets = [sum(unpadded[:b]) for b in range(len(unpadded))]
                for name, (bucket, start) in zip(order, places):
                    if name in copies:
                        continue
                    begin, shape = offsets[bucket] + start, shards[name]
                    for state, ours in STATE_KEYS.items():
                        if state in world and (state != "param" or mixed):
                            per_chunk[chunk].setdefault(ours, {})[name] = \
                                world[state][begin:begin + math.prod(shape)].view(shape)
    return out, optimizer_meta(groups, step)
