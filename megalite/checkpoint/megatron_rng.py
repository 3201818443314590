"""Megatron-LM's RNG states in a ``torch_dist`` checkpoint, read without running pickled code.

Megatron-LM's ``get_rng_state`` saves, per pipeline and tensor rank (and context-parallel rank in newer
versions), one sharded object ``rng_state`` holding a list of states (one per data-parallel rank with
``--data-parallel-random-init``, else one): Python's ``random`` state, NumPy's global ``RandomState``, torch's
CPU generator, the current CUDA generator (absent on a CPU run) and the tensor-parallel tracker's CUDA states.
Each object is a ``torch.save`` archive inside a DCP data file; it is unpickled with
:func:`megalite.checkpoint.megatron_pickle.unpickle_data` (every class inert) and NumPy's key array rebuilt from
its raw bytes.  The tracker's states (``rng_tracker_states``: one CUDA generator state per tracker name,
``model-parallel-rng``, ``data-parallel-rng``, ``expert-parallel-rng``) are read as saved; which of them a run
can restore is the trainer's business (:func:`megalite.training.checkpointing.set_megatron_rng_state`).
"""

from __future__ import annotations

import numpy as np
import torch

from megalite.checkpoint.megatron_pickle import read_sharded_object

RNG_STATE = "rng_state"


def _keys(layout: dict, rank: int) -> list[str]:
    """The sharded-object names Megatron-LM gives the RNG states of ``rank`` (tp fastest, then cp, dp, pp)."""
    tp, cp, dp, pp = (int(layout.get(axis) or 1) for axis in ("tp", "cp", "dp", "pp"))
    tp_rank, cp_rank, pp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp * dp)
    return [f"{RNG_STATE}/shard_{pp_rank}.{tp_rank}_{pp}.{tp}",
            f"{RNG_STATE}/shard_{pp_rank}.{tp_rank}.{cp_rank}_{pp}.{tp}.{cp}"]


def _array(record) -> np.ndarray:
    """The NumPy array an inert ``numpy._core.multiarray._reconstruct`` record stands for."""
    if not (getattr(record, "qualname", "").endswith("multiarray._reconstruct") and isinstance(record.state, tuple)
            and len(record.state) == 5):
        raise ValueError("NumPy's RNG state holds no array")
    _, shape, dtype, _, raw = record.state
    if getattr(raw, "qualname", "") == "_codecs.encode":  # protocol-2 pickles keep the bytes as latin-1 text
        raw = raw.args[0].encode(raw.args[1])
    code, order = dtype.args[0], dtype.state[1] if isinstance(dtype.state, tuple) else "="
    return np.frombuffer(raw, dtype=np.dtype(code).newbyteorder(order)).reshape(shape).copy()


def read_rng_state(directory: str, metadata, layout: dict, rank: int) -> dict | None:
    """``{"python", "numpy", "cpu", "cuda", "tracker"}`` (``cuda`` None on a CPU run): the generator states
    Megatron-LM saved for ``rank`` of the saved ``layout``, as ``random.setstate``, ``np.random.set_state`` and
    ``torch.set_rng_state`` take them, and its tensor-parallel tracker's CUDA generator states by tracker name
    (``{}`` when it saved none); None when the checkpoint holds none.  ValueError when they are unreadable."""
    key = next((k for k in _keys(layout, rank) if k in metadata.state_dict_metadata), None)
    if key is None:
        return None
    try:
        states = read_sharded_object(directory, metadata, key)[0]
        dp_rank = (rank // (int(layout.get("tp") or 1) * int(layout.get("cp") or 1))) % int(layout.get("dp") or 1)
        state = states[dp_rank if len(states) > 1 else 0]
        name, keys, pos, has_gauss, cached = state["np_rng_state"]
        version, internal, gauss = state["random_rng_state"]
        tracker = dict(state.get("rng_tracker_states") or {})
        if not all(isinstance(name, str) and isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                   for name, value in tracker.items()):
            raise ValueError("its rng_tracker_states are not generator states by name")
        return {"python": (version, tuple(internal), gauss), "tracker": tracker,
                "numpy": (name, _array(keys), int(pos), int(has_gauss), float(cached)),
                "cpu": state["torch_rng_state"], "cuda": state.get("cuda_rng_state")}
    except Exception as err:  # zipfile, pickle and the records' shapes raise many kinds on a damaged object
        raise ValueError(f"Megatron-LM RNG state {key!r} in {directory} is unreadable: {type(err).__name__}: "
                         f"{err}") from None
