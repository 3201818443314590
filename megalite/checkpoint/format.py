"""The on-disk checkpoint format: atomic per-rank files of global-tensor pieces.

Layout under a save directory::

    latest                       the newest complete iteration, as text
    iter_0000100/rank_00000.pt   one file per saving rank

Each rank file is a ``torch.save`` dict holding ``iteration``, ``world_size``, ``rank``, the
model's ``config`` (a GPTConfig as a dict), the ``layout`` it was saved under and ``tensors``:
``{global name: {"shape": global shape, "pieces": [(offset, tensor), ...]}}``.  Every piece is a
box of the global tensor starting at ``offset``; pieces of one tensor never overlap, and together
the files cover every global tensor.  Other keys (optimizer scalars, scheduler, RNG, data
position) are free-form per-rank state.

Writes are atomic: ranks write into ``iter_N.tmp``, then rank 0 renames it to ``iter_N`` and
replaces ``latest`` through a temporary file, fsyncing along the way.  A save killed at any moment
leaves the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from megalite.checkpoint.sharding import box_slices, intersect

FORMAT_VERSION = 2
LATEST = "latest"

ARCHITECTURE_FIELDS = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                       "num_query_groups", "max_position_embeddings", "position_embedding_type", "rotary_base",
                       "normalization", "norm_eps", "activation", "add_bias_linear",
                       "untie_embeddings_and_output_weights", "moe_layer_freq")
MOE_ARCHITECTURE_FIELDS = ("num_experts", "ffn_hidden_size", "topk", "activation", "add_bias", "router_order")


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(save_dir: str, iteration: int, state: dict, *, rank: int = 0, world_size: int = 1,
                     barrier=None) -> str:
    """Write this rank's ``state`` for ``iteration`` and publish the checkpoint atomically.

    Every rank of the default group calls this; ``barrier`` (a no-argument callable, None for a
    single process) separates creating the temporary directory, writing, and publishing.
    Returns the final iteration directory.
    """
    barrier = barrier or (lambda: None)
    final = iteration_dir(save_dir, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    barrier()
    _write_file(rank_file(tmp, rank), {"version": FORMAT_VERSION, "iteration": iteration,
                                       "world_size": world_size, "rank": rank, **state})
    barrier()
    if rank == 0:
        _publish(save_dir, tmp, final, iteration)
    barrier()
    return final


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Move the complete ``tmp`` directory to ``final``, then point ``latest`` at it."""
    _fsync(tmp)
    previous = None
    if os.path.exists(final):
        previous = final + ".old"
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(final, previous)
    os.rename(tmp, final)
    _fsync(save_dir)
    pointer = os.path.join(save_dir, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    _fsync(save_dir)
    if previous is not None:
        shutil.rmtree(previous)


def read_latest(save_dir: str) -> int | None:
    """The iteration named by ``save_dir/latest``, or None when there is none."""
    pointer = os.path.join(save_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint pointer {pointer} is corrupt: {text[:40]!r} is not an iteration number")
    return int(text)


def config_to_dict(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


def config_from_dict(values: dict):
    """The GPTConfig (with its MoEConfig) saved by :func:`config_to_dict`."""
    from megalite.models import GPTConfig

    values = dict(values)
    if values.get("moe") is not None:
        from megalite.moe import MoEConfig

        values["moe"] = MoEConfig(**values["moe"])
    return GPTConfig(**values)


def architecture_mismatch(saved: dict, config) -> str | None:
    """The first architecture field where ``saved`` (a config dict) and ``config`` differ, in words."""
    current = config_to_dict(config)
    for name in ARCHITECTURE_FIELDS:
        if saved.get(name) != current.get(name):
            return f"{name} is {saved.get(name)!r} in the checkpoint but {current.get(name)!r} in the model"
    saved_moe, moe = saved.get("moe"), current.get("moe")
    if (saved_moe is None) != (moe is None):
        return (f"the checkpoint {'has' if saved_moe else 'has no'} MoE layers but the model "
                f"{'has' if moe else 'has none'}")
    for name in MOE_ARCHITECTURE_FIELDS if moe is not None else ():
        if saved_moe.get(name) != moe.get(name):
            return f"moe.{name} is {saved_moe.get(name)!r} in the checkpoint but {moe.get(name)!r} in the model"
    return None


class CheckpointReader:
    """All rank files of one checkpoint, memory-mapped, with global tensors readable by region.

    ``path`` is a save directory (its ``latest`` iteration is read) or an iteration directory.
    Every problem (no such directory, no checkpoint, a missing or unreadable rank file) raises
    ValueError naming the file, so all ranks that open the same checkpoint fail alike.
    """

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint directory {path} does not exist")
        iteration = read_latest(path)
        self.directory = iteration_dir(path, iteration) if iteration is not None else path
        if not os.path.isdir(self.directory):
            raise ValueError(f"{path}/latest names iteration {iteration}, but {self.directory} does not exist")
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("rank_") and n.endswith(".pt"))
        if not names:
            raise ValueError(f"{path} holds no checkpoint: no 'latest' file and no rank_*.pt files")
        self.files = [self._load(os.path.join(self.directory, n)) for n in names]
        head = self.files[0]
        self.iteration, self.world_size = head["iteration"], head["world_size"]
        present = {f["rank"] for f in self.files}
        missing = sorted(set(range(self.world_size)) - present)
        if missing:
            raise ValueError(f"checkpoint {self.directory} was saved by {self.world_size} ranks but the files of "
                             f"ranks {missing} are missing")
        self.config_dict = head.get("config")
        self.layout = head.get("layout", {})
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        for f in self.files:
            for name, entry in f["tensors"].items():
                self.shapes[name] = tuple(entry["shape"])
                self.pieces.setdefault(name, []).extend(entry["pieces"])

    @staticmethod
    def _load(path: str) -> dict:
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as err:
            raise ValueError(f"checkpoint file {path} is unreadable (truncated or corrupt): {err}") from None
        if not isinstance(state, dict) or state.get("version") != FORMAT_VERSION or "tensors" not in state:
            raise ValueError(f"checkpoint file {path} is not a megalite checkpoint of format version {FORMAT_VERSION}")
        return state

    def rank_state(self, rank: int) -> dict:
        """The free-form state that ``rank`` saved (without tensors)."""
        for f in self.files:
            if f["rank"] == rank:
                return {k: v for k, v in f.items() if k != "tensors"}
        raise ValueError(f"checkpoint {self.directory} has no file for rank {rank}")

    @property
    def config(self):
        """The saved GPTConfig, or None for a model without one."""
        return None if self.config_dict is None else config_from_dict(self.config_dict)

    def check_architecture(self, config) -> None:
        """ValueError naming the first difference between the saved and the given GPTConfig."""
        if self.config_dict is None or config is None:
            return
        mismatch = architecture_mismatch(self.config_dict, config)
        if mismatch:
            raise ValueError(f"checkpoint {self.directory} holds a different architecture: {mismatch}")

    def has(self, name: str) -> bool:
        return name in self.shapes

    def read_into(self, name: str, out: torch.Tensor, offset: tuple[int, ...]) -> None:
        """Fill ``out`` with the region of global tensor ``name`` that starts at ``offset``."""
        if name not in self.shapes:
            raise ValueError(f"checkpoint {self.directory} has no tensor {name!r}")
        shape = self.shapes[name]
        want = tuple((o, o + s) for o, s in zip(offset, out.shape))
        if len(shape) != out.dim() or any(hi > size for (_, hi), size in zip(want, shape)):
            raise ValueError(f"{name}: region {want} lies outside the saved global shape {shape}")
        filled = 0
        for piece_offset, tensor in self.pieces[name]:
            have = tuple((o, o + s) for o, s in zip(piece_offset, tensor.shape))
            common = intersect(want, have)
            if common is None:
                continue
            out[box_slices(common, offset)] = tensor[box_slices(common, piece_offset)]
            filled += _volume(common)
        if filled != out.numel():
            raise ValueError(f"checkpoint {self.directory}: tensor {name!r} region {want} is covered for only "
                             f"{filled} of {out.numel()} elements; a shard file is missing or truncated")

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole global tensor ``name``."""
        if name not in self.shapes:
            raise ValueError(f"checkpoint {self.directory} has no tensor {name!r}")
        pieces = self.pieces[name]
        out = torch.empty(self.shapes[name], dtype=dtype or pieces[0][1].dtype)
        self.read_into(name, out, (0,) * out.dim())
        return out


def _volume(box) -> int:
    count = 1
    for lo, hi in box:
        count *= hi - lo
    return count
