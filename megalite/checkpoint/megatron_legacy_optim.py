"""The optimizer state of a Megatron-LM legacy checkpoint in megalite's terms.

A non-distributed optimizer saves torch Adam's state in ``optimizer`` (inside ``optimizer`` with
``fp32_from_fp16_params``, the fp32 main weights, under fp16/bf16), numbered by parameter in Megatron's group order:
groups by weight-decay multiplier, each in the order of ``named_parameters()``, with biases and 1-D parameters
undecayed (Megatron's default rule).  Each group is matched to its parameters by that rule and every moment's shape
is checked; the moments then take the weights' way into global tensors (``optimizer.exp_avg.<name>``, as
:mod:`megalite.checkpoint.state` writes them).  An MoE run's optimizer is Megatron-Core's chain of the dense and the
expert optimizers (a list of both states), joined as the torch_dist reader joins them
(:mod:`megalite.checkpoint.megatron_optim`).  A distributed optimizer (``--use-distributed-optimizer``) keeps the
moments and main weights in each rank's ``distrib_optim.pt`` (Megatron-Core's ``save_parameter_state``: the rank's
whole flat gradient buffer gathered on its first DP rank), cut into local shards by the rebuilt buffer layout
(:mod:`megalite.checkpoint.megatron_distopt`).  What cannot be converted (groups with other learning-rate
multipliers, anything that does not match) is returned as the reason instead.
"""

from __future__ import annotations

import os

import torch

from megalite.checkpoint.megatron_buffers import local_expert
from megalite.checkpoint.megatron_distopt import legacy_distributed_optimizer
from megalite.checkpoint.megatron_legacy_files import DISTRIB_FILE, load_pickle
from megalite.checkpoint.megatron_legacy_shards import assemble, global_name, layer_offsets
from megalite.checkpoint.megatron_optim import OPTIMIZER_STATE_KEYS, chain, chain_groups, optimizer_meta
from megalite.checkpoint.state import OPTIMIZER_KEYS


def legacy_optimizer(states: dict, chunks: dict, config, tp: int, pp: int, files: dict,
                     expert_tp: tuple[int, dict]):
    """``(optimizer global tensors, megalite's optimizer JSON state, None)`` from every rank's saved optimizer
    (``files``: each rank's :data:`MODEL_FILE`; ``expert_tp``: as :func:`assemble`'s), or ``({}, None, why it cannot
    be converted)``."""
    directory = os.path.dirname(os.path.dirname(files[(0, 0, 0)]))
    if getattr(states[(0, 0, 0)]["args"], "use_distributed_optimizer", False):
        if expert_tp[0] != tp:
            return {}, None, (f"it is a distributed optimizer's state at expert_tensor_parallel_size {expert_tp[0]} "
                              f"(not the tensor-parallel size {tp}), which megalite reads in --ckpt-format torch_dist")
        return _distributed(states, chunks, config, tp, pp, files)
    found = {key: optimizer_entries(states[key].get("optimizer"), chunks[key]) for key in states}
    note = next((entry for entry in found.values() if isinstance(entry, str)), None)
    if note is None and len({meta["num_steps"] for _, meta in found.values()}) > 1:
        note = f"the ranks' Adam steps differ ({sorted({meta['num_steps'] for _, meta in found.values()})})"
    if note is not None:
        return {}, None, note
    tensors = {}
    for key in (*OPTIMIZER_KEYS, "main"):
        if all(key in e for entries, _ in found.values() for chunk in entries for e in chunk.values()):
            moments = {rank: [{name: e[key] for name, e in chunk.items()} for chunk in entries]
                       for rank, (entries, _) in found.items()}
            tensors.update({f"optimizer.{key}.{name}": value
                            for name, value in assemble(config, moments, tp, pp, directory, expert_tp).items()})
    return tensors, found[(0, 0, 0)][1], None


def _distributed(states: dict, chunks: dict, config, tp: int, pp: int, files: dict):
    """As :func:`legacy_optimizer`, for a distributed optimizer: each model-parallel rank's ``distrib_optim.pt`` (its
    flat buffer's state, read under the same pickle opt-in) cut into local shards by the rebuilt gradient-buffer
    layout (:func:`megalite.checkpoint.megatron_distopt.legacy_distributed_optimizer`), then placed like weights."""
    directory = os.path.dirname(os.path.dirname(files[(0, 0, 0)]))
    files = {key: os.path.join(os.path.dirname(f), DISTRIB_FILE) for key, f in files.items()}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        return {}, None, f"it is a distributed optimizer's state whose {missing[0]} is missing"
    offsets = layer_offsets(chunks, pp)
    names = {(t, p, e): [{global_name(name, offsets[(v, p)], p): name for name, tensor in chunk.items()
                          if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")}
                         for v, chunk in enumerate(per_stage)] for (t, p, e), per_stage in chunks.items()}
    local = {key: [{name: tuple(chunks[key][v][ours].shape) for name, ours in chunk.items()}
                   for v, chunk in enumerate(per_rank)] for key, per_rank in names.items()}
    buffers = {key: load_pickle(f) for key, f in files.items()}
    found = legacy_distributed_optimizer(vars(states[(0, 0, 0)]["args"]), config, states[(0, 0, 0)]["optimizer"],
                                         buffers, local)
    if isinstance(found, str):
        return {}, None, found
    per_rank, meta = found
    tensors = {}
    for key in ("exp_avg", "exp_avg_sq", "main"):
        if any(key in by_key for per_chunk in per_rank.values() for by_key in per_chunk):
            moments = {rank: [{names[rank][v][name]: t for name, t in by_key.get(key, {}).items()}
                              for v, by_key in enumerate(per_chunk)] for rank, per_chunk in per_rank.items()}
            tensors.update({f"optimizer.{key}.{name}": value
                            for name, value in assemble(config, moments, tp, pp, directory).items()})
    return tensors, meta, None


def _no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default rule: biases and 1-D parameters are not decayed."""
    return name.endswith(".bias") or tensor.dim() == 1


def optimizer_entries(saved, chunks: list[dict]):
    """``([{name: {"exp_avg", "exp_avg_sq"[, "main"]}} per chunk], megalite's optimizer JSON state)`` of one rank's
    saved Megatron optimizer, or the reason it cannot be converted (a string).  An MoE run's ``ChainedOptimizer``
    saves a list of two: the dense parameters' optimizer, then the local experts' (``mlp.experts.local_experts.``);
    their groups join megalite's two as in the torch_dist reader (:func:`megalite.checkpoint.megatron_optim.chain_groups`)."""
    chained = chain(saved)
    if len(chained) > 2:
        return f"it is a chain of {len(chained)} optimizers, not a dense and an expert one"
    inners = [s.get("optimizer", s) if isinstance(s, dict) else None for s in chained]
    if not all(isinstance(inner, dict) and inner.get("state") for inner in inners):
        return "it holds no Adam moments (a distributed optimizer keeps them in distrib_optim.pt, DP-sharded)"
    if not all(isinstance(inner.get("param_groups"), list) for inner in inners):
        return "it holds no parameter groups (not Adam)"
    groups, problem = chain_groups(inners)
    if problem:
        return problem
    params = [(v, name, t) for v, chunk in enumerate(chunks) for name, t in chunk.items()
              if isinstance(t, torch.Tensor) and not name.endswith("_extra_state")]
    entries, steps = [{} for _ in chunks], set()
    for k, (outer, inner) in enumerate(zip(chained, inners)):
        mine = [p for p in params if len(chained) == 1 or (local_expert(p[1]) is not None) == (k == 1)]
        why = _inner_entries(outer, inner, mine, entries, steps)
        if why is not None:
            return why if len(chained) == 1 else f"its chained optimizer {k}: {why}"
    if len(steps) != 1:
        return f"its parameters have different Adam steps ({sorted(steps)})"
    return entries, optimizer_meta(groups, steps.pop())


def _inner_entries(outer: dict, inner: dict, params: list, entries: list[dict], steps: set) -> str | None:
    """Fill ``entries`` (per chunk ``{name: {megalite's state key: tensor}}``) and ``steps`` from one of Megatron's
    optimizers (``outer``: its state dict, with ``fp32_from_fp16_params`` under fp16/bf16; ``inner``: torch Adam's),
    whose groups hold ``params`` (``(chunk, name, tensor)``) by Megatron's default rule; or say why they cannot be."""
    mains = outer.get("fp32_from_fp16_params") if "optimizer" in outer else None
    for g, group in enumerate(inner["param_groups"]):
        undecayed = group.get("wd_mult", 1.0) == 0.0
        members = [p for p in params if _no_weight_decay(p[1], p[2]) == undecayed]
        if len(members) != len(group["params"]):
            return f"its group {g} has {len(group['params'])} parameters, the default rule gives {len(members)}"
        if mains is not None and len(mains[g]) != len(members):
            return f"its group {g} mixes fp32 and half-precision parameters"
        for j, (index, (v, name, tensor)) in enumerate(zip(group["params"], members)):
            state = inner["state"].get(index, {})
            if "exp_avg" not in state or tuple(state["exp_avg"].shape) != tuple(tensor.shape):
                return f"its state {index} does not fit {name} {tuple(tensor.shape)}"
            entries[v][name] = {OPTIMIZER_STATE_KEYS[key]: state[key] for key in ("exp_avg", "exp_avg_sq")}
            if mains is not None:
                if tuple(mains[g][j].shape) != tuple(tensor.shape):
                    return f"its fp32 main weight {g}.{j} does not fit {name} {tuple(tensor.shape)}"
                entries[v][name][OPTIMIZER_STATE_KEYS["fp32_param"]] = mains[g][j]
            steps.add(int(state.get("step", 0)))
    return None
