"""Megatron-LM legacy checkpoints (``--ckpt-format torch``) read as megalite's global tensors.

On disk (Megatron-LM's ``training/checkpointing.py``)::

    SAVE/latest_checkpointed_iteration.txt         the iteration, or "release"
    SAVE/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt      (``release/`` for a release)

one ``torch.save`` file per tensor rank ``TT`` and pipeline rank ``PPP`` (the suffix only when pp > 1),
holding ``args`` (the parsed command line), ``iteration``, ``model`` (``model0``, ``model1``, ... per
virtual stage), and optionally ``optimizer``, ``opt_param_scheduler`` and ``rng_state``.  Each model
entry is the stage's ``state_dict_for_save_checkpoint()``: Megatron-Core names (megalite's own), layer
indices local to the stage, and each rank's TP shard.  Every shard is placed into its global tensor by
:func:`megalite.checkpoint.sharding.global_param`, the one global layout, which already knows the
per-rank SwiGLU ``[gate_r; up_r]`` rows, the per-group QKV rows and the vocabulary padding (cut to the
real size).  Transformer Engine names of the fused norms are renamed to the local layers' names and its
``_extra_state`` entries (FP8 metadata, no weights) are dropped.

These files are pickles, and unpickling runs code the file names, so nothing is read without an
explicit ``allow_pickle=True`` (``--allow-pickle``), which prints a warning line.  Only the converter
calls this; megalite's own load path never unpickles.

Optimizer state: a non-distributed optimizer saves torch Adam's state in ``optimizer`` (inside
``optimizer`` with ``fp32_from_fp16_params``, the fp32 main weights, under fp16/bf16), numbered by
parameter in Megatron's group order: groups by weight-decay multiplier, each in the order of
``named_parameters()``, with biases and 1-D parameters undecayed (Megatron's default rule).  Each group
is matched to its parameters by that rule and every moment's shape is checked; the moments then take the
weights' way into global tensors (``optimizer.exp_avg.<name>``, as :mod:`megalite.checkpoint.state` writes
them).  A distributed optimizer (``--use-distributed-optimizer``) keeps the moments and main weights in
``mp_rank_TT[_PPP]/distrib_optim.pt`` beside each rank's file (Megatron-Core's ``save_parameter_state``: the
rank's whole flat gradient buffer gathered on its first DP rank), read under the same opt-in and cut into local
shards by the rebuilt buffer layout (:mod:`megalite.checkpoint.megatron_distopt`), then placed like the weights.
Not converted, with the reason as :attr:`LegacyCheckpoint.optimizer_note`: groups with other learning-rate
multipliers, and anything that does not match.  MoE checkpoints (``args.num_experts``) with SequentialMLP experts
keep each expert rank's files in ``mp_rank_TT[_PPP]_EEE`` (its local experts, ``mlp.experts.local_experts.<i>.``,
placed at their indices of megalite's stacked expert weights; the dense tensors, replicated, read from expert rank
0); their optimizer is Megatron-Core's chain of the dense and the expert optimizers: a list of both states in
``optimizer``, or with a distributed optimizer both buffers in each ``distrib_optim.pt``.
GroupedMLP experts (``--moe-grouped-gemm``: ``mlp.experts.weight1|2``, every local expert's matrix transposed side by
side) are split into those experts, weights and moments alike.  An expert tensor-parallel size other than tp is
refused: megalite reads it in the torch_dist format.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import torch

from megalite.checkpoint import global_shapes, save_global_checkpoint
from megalite.checkpoint.meta import split_dims
from megalite.checkpoint.files import fresh_output, move_into_place
from megalite.checkpoint.megatron_args import config_from_megatron_args
from megalite.checkpoint.megatron_dist import plain_dict
from megalite.checkpoint.megatron_names import megalite_name
from megalite.checkpoint.megatron_buffers import OUTPUT_COPY, grouped_split, local_expert
from megalite.checkpoint.megatron_distopt import expert_param, legacy_distributed_optimizer
from megalite.checkpoint.megatron_optim import OPTIMIZER_STATE_KEYS, chain, chain_groups, optimizer_meta
from megalite.checkpoint.sharding import ShardContext, global_param, local_meta, place
from megalite.checkpoint.state import OPTIMIZER_KEYS

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_FILE = "distrib_optim.pt"
"""A distributed optimizer's state beside each rank's MODEL_FILE (Megatron-Core's ``save_parameter_state``)."""
_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class LegacyCheckpoint:
    """A Megatron-LM legacy checkpoint in megalite's terms."""

    directory: str
    iteration: int
    config: object
    tensors: dict[str, torch.Tensor]
    consumed_samples: int | None
    optimizer: dict | None
    """megalite's optimizer JSON state (``num_steps``, ``scaler``, ``param_groups``) when the moments were converted."""
    optimizer_note: str | None
    """Why the saved optimizer state was not converted (None: converted, or none saved)."""
    scheduler: dict | None = None
    """Megatron-LM's ``OptimizerParamScheduler.state_dict()`` (``opt_param_scheduler``) when saved, so that
    ``--load`` of the conversion continues its schedule as a torch_dist one does."""


def legacy_directory(path: str) -> str | None:
    """The iteration directory of a Megatron-LM legacy checkpoint that ``path`` names, or None (nothing unpickled).

    ``path`` is a save directory (its ``latest_checkpointed_iteration.txt`` names ``iter_XXXXXXX`` or
    ``release``) or an iteration directory holding ``mp_rank_*`` directories.
    """
    if not os.path.isdir(path):
        return None
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(path, "release")
        if not text.isdigit():
            raise ValueError(f"{tracker} holds {text[:40]!r}, neither an iteration number nor 'release'")
        directory = os.path.join(path, f"iter_{int(text):07d}")
        if not os.path.isdir(directory):
            raise ValueError(f"{tracker} names iteration {int(text)}, but {directory} does not exist")
        return directory
    if any(_RANK_DIR.fullmatch(name) for name in os.listdir(path)):
        return path
    return None


def rank_file(directory: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Megatron-LM's file of tensor rank ``tp_rank``, pipeline rank ``pp_rank`` and expert rank ``ep_rank`` in an
    iteration directory."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "") + \
        (f"_{ep_rank:03d}" if ep_size > 1 else "")
    return os.path.join(directory, name, MODEL_FILE)


def _unpickle(path: str) -> dict:
    """One rank file, memory-mapped (tensors are read when placed) unless torch < 1.6 wrote it (no zip archive)."""
    state = _load(path)
    if not isinstance(state, dict) or "args" not in state:
        raise ValueError(f"{path} holds no Megatron-LM checkpoint (no 'args' entry)")
    return state


def _load(path: str):
    """A pickle file of the checkpoint (behind the opt-in), memory-mapped unless torch < 1.6 wrote it."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a damaged zip or pickle raises many types
        raise ValueError(f"{path} is not a readable Megatron-LM checkpoint file: {type(err).__name__}: {err}") from None
    return state


def _chunks(state: dict, path: str) -> list[dict]:
    """The model state dicts of one rank file, one per virtual pipeline stage."""
    if "model" in state:
        return [state["model"]]
    chunks = [state[f"model{v}"] for v in range(len(state)) if f"model{v}" in state]
    if not chunks:
        raise ValueError(f"{path} holds no 'model' entry")
    return chunks


def _layers(chunk: dict) -> int:
    return len({int(m.group(1)) for m in map(_LAYER.match, chunk) if m})


def _global_name(name: str, offset: int) -> str:
    match = _LAYER.match(name)
    if match is None:
        return name
    rest = name[match.end():]
    return f"decoder.layers.{int(match.group(1)) + offset}.{megalite_name(rest)}"


def read_megatron_legacy(path: str, *, allow_pickle: bool = False, vocab_size: int | None = None) -> LegacyCheckpoint:
    """The Megatron-LM legacy checkpoint ``path`` names (save or iteration directory) as global tensors.

    ``allow_pickle`` must be True (the files are pickles).  ``vocab_size``: the real vocabulary size when
    the saved args lack it (see :func:`megalite.checkpoint.megatron_args.vocabulary_size`).  ValueError on
    anything missing or contradictory (the pickle opt-in, the args and the rank files are checked first).
    """
    directory = legacy_directory(path)
    if directory is None:
        raise ValueError(f"{path} holds no Megatron-LM legacy checkpoint: no {TRACKER} and no mp_rank_* directories")
    if not allow_pickle:
        raise ValueError(f"{directory} is a Megatron-LM legacy checkpoint, whose {MODEL_FILE} files are Python "
                         "pickles that can run code when read; pass --allow-pickle (allow_pickle=True) only if you "
                         "trust them")
    print(f"warning: unpickling the Megatron-LM checkpoint {directory} (--allow-pickle): this runs whatever code "
          "the files name; only use it for files you trust", file=sys.stderr, flush=True)
    candidates = [rank_file(directory, 0, 0, 1), rank_file(directory, 0, 0, 2), rank_file(directory, 0, 0, 2, 0, 2)]
    first = next((f for f in candidates if os.path.isfile(f)), None)
    if first is None:
        raise ValueError(f"{directory} has none of {', '.join(os.path.relpath(c, directory) for c in candidates)}")
    state = _unpickle(first)
    args = state["args"]
    tp, pp = int(getattr(args, "tensor_model_parallel_size", 1)), int(getattr(args, "pipeline_model_parallel_size", 1))
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1) if getattr(args, "num_experts", None) else 1
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    if getattr(args, "num_experts", None) and etp != tp:
        raise ValueError(f"{directory}: a legacy-format MoE checkpoint with expert_tensor_parallel_size {etp} (not the "
                         f"tensor-parallel size {tp}) is not supported; megalite reads those in --ckpt-format "
                         "torch_dist")
    config = config_from_megatron_args(args, vocab_size)
    files = {(t, p, e): rank_file(directory, t, p, pp, e, ep) for p in range(pp) for t in range(tp) for e in range(ep)}
    sizes = f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}" + \
        (f" x expert_model_parallel_size {ep}" if ep > 1 else "")
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{missing[0]} is missing ({len(missing)} of the {len(files)} rank files that the saved "
                         f"args' {sizes} need)")
    expected = {os.path.basename(os.path.dirname(f)) for f in files.values()}
    extra = sorted(name for name in os.listdir(directory) if _RANK_DIR.fullmatch(name) and name not in expected)
    if extra:
        raise ValueError(f"{directory} holds {extra[0]}, which the saved args' {sizes} do not have")
    states = {key: state if key == (0, 0, 0) else _unpickle(f) for key, f in files.items()}
    chunks = {key: _chunks(states[key], f) for key, f in files.items()}
    tensors = _assemble(config, chunks, tp, pp, directory)
    meta, note = None, None
    if "optimizer" in state:
        moments, meta, note = _optimizer(states, chunks, config, tp, pp, files)
        tensors.update(moments)
    iteration = 0 if os.path.basename(directory) == "release" else int(state.get("iteration", 0))
    return LegacyCheckpoint(directory, iteration, config, tensors, getattr(args, "consumed_train_samples", None),
                            meta, note, plain_dict(state.get("opt_param_scheduler")))


def _optimizer(states: dict, chunks: dict, config, tp: int, pp: int, files: dict):
    """``(optimizer global tensors, megalite's optimizer JSON state, None)`` from every rank's saved optimizer
    (``files``: each rank's :data:`MODEL_FILE`), or ``({}, None, why it cannot be converted)``."""
    directory = os.path.dirname(os.path.dirname(files[(0, 0, 0)]))
    if getattr(states[(0, 0, 0)]["args"], "use_distributed_optimizer", False):
        return _distributed(states, chunks, config, tp, pp, files)
    found = {key: _optimizer_entries(states[key].get("optimizer"), chunks[key]) for key in states}
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
                            for name, value in _assemble(config, moments, tp, pp, directory).items()})
    return tensors, found[(0, 0, 0)][1], None


def _distributed(states: dict, chunks: dict, config, tp: int, pp: int, files: dict):
    """As :func:`_optimizer`, for a distributed optimizer: each model-parallel rank's ``distrib_optim.pt`` (its
    flat buffer's state, read under the same pickle opt-in) cut into local shards by the rebuilt gradient-buffer
    layout (:func:`megalite.checkpoint.megatron_distopt.legacy_distributed_optimizer`), then placed like weights."""
    directory = os.path.dirname(os.path.dirname(files[(0, 0, 0)]))
    files = {key: os.path.join(os.path.dirname(f), DISTRIB_FILE) for key, f in files.items()}
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        return {}, None, f"it is a distributed optimizer's state whose {missing[0]} is missing"
    offsets = _offsets(chunks, pp)
    names = {(t, p, e): [{_global_name(name, offsets[(v, p)]): name for name, tensor in chunk.items()
                          if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")}
                         for v, chunk in enumerate(per_stage)] for (t, p, e), per_stage in chunks.items()}
    local = {key: [{name: tuple(chunks[key][v][ours].shape) for name, ours in chunk.items()}
                   for v, chunk in enumerate(per_rank)] for key, per_rank in names.items()}
    buffers = {key: _load(f) for key, f in files.items()}
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
                            for name, value in _assemble(config, moments, tp, pp, directory).items()})
    return tensors, meta, None


def _no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default rule: biases and 1-D parameters are not decayed."""
    return name.endswith(".bias") or tensor.dim() == 1


def _optimizer_entries(saved, chunks: list[dict]):
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


def _offsets(chunks: dict, pp: int, with_total: bool = False):
    """``{(virtual stage, pipeline stage): its first layer's global number}`` of ``{(tp_rank, pp_rank, ep_rank):
    [state dict per virtual stage]}`` (layers are numbered within each chunk; global order is virtual stage, then
    pipeline stage), and with ``with_total`` the number of layers."""
    offsets, total = {}, 0
    for v in range(len(chunks[(0, 0, 0)])):
        for p in range(pp):
            offsets[(v, p)] = total
            total += _layers(chunks[(0, p, 0)][v])
    return (offsets, total) if with_total else offsets


def _assemble(config, chunks: dict, tp: int, pp: int, directory: str) -> dict[str, torch.Tensor]:
    """Global tensors from ``{(tp_rank, pp_rank, ep_rank): [state dict per virtual stage]}`` (each expert rank's
    local experts placed in megalite's stacked expert weights; the dense tensors read from expert rank 0)."""
    dims = split_dims(config)
    expected = global_shapes(config)
    offsets, total = _offsets(chunks, pp, with_total=True)
    if total != config.num_layers:
        raise ValueError(f"{directory} holds {total} transformer layers, but the saved args say num_layers "
                         f"{config.num_layers}")
    out, filled = {}, {}
    ep = 1 + max(e for _, _, e in chunks)
    for (t, p, e), per_stage in chunks.items():
        for v, chunk in enumerate(per_stage):
            for key, value in grouped_split(chunk, config.moe.num_experts // ep if config.moe else 1):
                if key.endswith("_extra_state") or value is None:
                    continue
                name = _global_name(key, offsets[(v, p)])
                if name == OUTPUT_COPY and not config.untie_embeddings_and_output_weights:
                    continue  # the last stage's copy of tied word embeddings (pipeline stages)
                ctx = ShardContext(tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep, etp_rank=t, etp_size=tp)
                expert = expert_param(name, tuple(value.shape), config.moe.num_experts, dims, config, ctx) \
                    if config.moe is not None else None
                if expert is not None:
                    value = value.view(expert[1])
                    gp = expert[2]
                elif name not in dims:
                    raise ValueError(f"{directory}: {key} (stage {p}, tensor rank {t}) is no parameter of the model "
                                     "the saved args describe")
                elif e > 0:
                    continue  # an expert rank's replica of expert rank 0's dense tensor
                else:
                    gp = global_param(name, local_meta(value.shape, dims[name]), config,
                                      ShardContext(tp_rank=t, tp_size=tp))
                if gp.alias or (dims.get(gp.name) is None and t > 0):
                    continue  # a tied output layer's copy, or a TP replica of rank 0's tensor
                if tuple(gp.shape) != expected.get(gp.name):
                    raise ValueError(f"{directory}: {key} of tensor rank {t} has shape {tuple(value.shape)}, which "
                                     f"makes a global {tuple(gp.shape)}; the saved args need {expected.get(gp.name)}")
                target = out.setdefault(gp.name, torch.empty(gp.shape, dtype=value.dtype))
                filled[gp.name] = filled.get(gp.name, 0) + place(target, value, gp.pieces)
    missing = [name for name, shape in expected.items() if filled.get(name, 0) != torch.Size(shape).numel()]
    if missing:
        raise ValueError(f"{directory} does not hold all of {missing[0]} (nor of {len(missing) - 1} other tensors)")
    return out


def convert_megatron_legacy(path: str, output: str, *, allow_pickle: bool = False,
                            vocab_size: int | None = None) -> LegacyCheckpoint:
    """Write the Megatron-LM legacy checkpoint ``path`` as a megalite checkpoint in ``output`` (loads at any layout).

    The iteration and the consumed samples (the data position) travel, so ``--load`` resumes there.
    """
    tmp = fresh_output(output)
    legacy = read_megatron_legacy(path, allow_pickle=allow_pickle, vocab_size=vocab_size)
    extra = {"consumed_samples": legacy.consumed_samples or 0, "megatron_legacy": legacy.directory,
             "optimizer": legacy.optimizer, "megatron_scheduler": legacy.scheduler}
    save_global_checkpoint(tmp, legacy.config, legacy.tensors, iteration=legacy.iteration, extra=extra)
    move_into_place(tmp, output)
    return legacy
