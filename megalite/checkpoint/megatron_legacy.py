"""Megatron-LM legacy checkpoints (``--ckpt-format torch``) read as megalite's global tensors, and converted.

The rank files (``SAVE/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``) are found and unpickled by
:mod:`megalite.checkpoint.megatron_legacy_files`, their model shards placed into global tensors by
:mod:`megalite.checkpoint.megatron_legacy_shards`, and their optimizer state converted by
:mod:`megalite.checkpoint.megatron_legacy_optim`.  The files are pickles, and unpickling runs code the file names,
so nothing is read without an explicit ``allow_pickle=True`` (``--allow-pickle``), which prints a warning line.
Only the converter calls this; megalite's own load path never unpickles.

MoE checkpoints (``args.num_experts``) with SequentialMLP experts keep each expert rank's files in
``mp_rank_TT[_PPP]_EEE``; with an expert tensor-parallel size other than tp, which files exist and which expert
shards each holds follows Megatron-Core's rank order (:func:`megalite.checkpoint.megatron_legacy_files.written_ranks`).
GroupedMLP experts (``--moe-grouped-gemm``: ``mlp.experts.weight1|2``, every local expert's matrix transposed side by
side) are split into those experts, weights and moments alike
(:func:`megalite.checkpoint.megatron_buffers.grouped_split`), then placed by the same rule.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from megalite.checkpoint import save_global_checkpoint
from megalite.checkpoint.files import fresh_output, move_into_place
from megalite.checkpoint.megatron_args import config_from_megatron_args
from megalite.checkpoint.megatron_dist import plain_dict
from megalite.checkpoint.megatron_legacy_files import (MODEL_FILE, RANK_DIR, TRACKER, legacy_directory,
                                                       model_chunks, rank_file, unpickle, written_ranks)
from megalite.checkpoint.megatron_legacy_optim import legacy_optimizer
from megalite.checkpoint.megatron_legacy_shards import assemble


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
    state = unpickle(first)
    args = state["args"]
    tp, pp = int(getattr(args, "tensor_model_parallel_size", 1)), int(getattr(args, "pipeline_model_parallel_size", 1))
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1) if getattr(args, "num_experts", None) else 1
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp) if getattr(args, "num_experts", None) else tp
    config = config_from_megatron_args(args, vocab_size)
    try:
        expert_ranks = written_ranks(args, tp, pp, ep, etp)
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    files = {key: rank_file(directory, *key[:2], pp, key[2], ep) for key in expert_ranks}
    sizes = f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}" + \
        (f" x expert_model_parallel_size {ep}" if ep > 1 else "")
    missing = [f for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{missing[0]} is missing ({len(missing)} of the {len(files)} rank files that the saved "
                         f"args' {sizes} need)")
    expected = {os.path.basename(os.path.dirname(f)) for f in files.values()}
    extra = sorted(name for name in os.listdir(directory) if RANK_DIR.fullmatch(name) and name not in expected)
    if extra:
        raise ValueError(f"{directory} holds {extra[0]}, which the saved args' {sizes} do not have")
    states = {key: state if key == (0, 0, 0) else unpickle(f) for key, f in files.items()}
    chunks = {key: model_chunks(states[key], f) for key, f in files.items()}
    tensors = assemble(config, chunks, tp, pp, directory, (etp, expert_ranks))
    meta, note = None, None
    if "optimizer" in state:
        moments, meta, note = legacy_optimizer(states, chunks, config, tp, pp, files, (etp, expert_ranks))
        tensors.update(moments)
    iteration = 0 if os.path.basename(directory) == "release" else int(state.get("iteration", 0))
    return LegacyCheckpoint(directory, iteration, config, tensors, getattr(args, "consumed_train_samples", None),
                            meta, note, plain_dict(state.get("opt_param_scheduler")))


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
