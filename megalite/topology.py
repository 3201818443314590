"""Rank grids and process groups.

Ranks are laid out on a grid whose axes are named by ``order`` (Megatron-Core
semantics): the leftmost axis varies fastest in the global rank.  Dense layers
use the axes (tp, cp, dp, pp); expert layers fold onto the same ranks as
(etp, ep, expert_dp, pp).

``rank_groups`` is a pure function that needs no torch.distributed.
``initialize`` builds the process groups and returns a :class:`Topology`, which
layers take as their default through :func:`current`.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
from dataclasses import dataclass, field

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    names = [n.strip() for n in order.split("-") if n.strip()]
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ValueError(f"order {order!r}: unknown axis {unknown[0]!r}; known axes are {'-'.join(AXES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"order {order!r}: axis {repeated[0]!r} appears more than once")
    for name in AXES:
        if name not in names:
            if sizes.get(name, 1) != 1:
                raise ValueError(f"order {order!r} lacks axis {name!r}, whose size is {sizes[name]}")
            names.append(name)
    return names


def _grid_groups(sizes: dict[str, int], names: list[str], varying: tuple[str, ...]) -> list[list[int]]:
    """Groups of ranks that differ only along the ``varying`` axes.

    ``names`` lists the axes fastest first.  Groups are listed with the fixed
    axes' coordinates enumerated fastest-first as well, and ranks inside a group
    in increasing order of the varying coordinates (fastest first).
    """
    strides, stride = {}, 1
    for name in names:
        strides[name] = stride
        stride *= sizes[name]
    fixed = [n for n in names if n not in varying]
    inner = [n for n in names if n in varying]

    def coords(axes):
        ranges = [range(sizes[n]) for n in reversed(axes)]
        for combo in itertools.product(*ranges):
            yield dict(zip(reversed(axes), combo))

    groups = []
    for outer in coords(fixed):
        base = sum(outer[n] * strides[n] for n in fixed)
        groups.append(sorted(base + sum(c[n] * strides[n] for n in inner) for c in coords(inner)))
    return groups


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def rank_groups(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Return every axis's rank groups for a world of ``world_size`` ranks.

    Keys: tp, pp, dp, cp, dp_cp (dp x cp: the ranks that hold replicas of the
    dense weights, over which their gradients reduce), model (tp x pp),
    embedding (first and last pipeline stage), ep, expert_tp, expert_dp.
    Raises ValueError on sizes that do not divide the world or on a malformed
    ``order``.
    """
    etp = tp if etp is None else etp
    _check_positive(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    dense = tp * pp * cp
    if world_size % dense:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {dense}")
    expert = etp * ep * pp
    if world_size % expert:
        raise ValueError(f"world size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {expert}")
    dp = world_size // dense
    expert_dp = world_size // expert

    names = _parse_order(order, {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp})
    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": expert_dp, "pp": pp}

    groups = {
        "tp": _grid_groups(dense_sizes, names, ("tp",)),
        "pp": _grid_groups(dense_sizes, names, ("pp",)),
        "dp": _grid_groups(dense_sizes, names, ("dp",)),
        "cp": _grid_groups(dense_sizes, names, ("cp",)),
        "dp_cp": _grid_groups(dense_sizes, names, ("dp", "cp")),
        "model": _grid_groups(dense_sizes, names, ("tp", "pp")),
        "ep": _grid_groups(expert_sizes, names, ("ep",)),
        "expert_tp": _grid_groups(expert_sizes, names, ("tp",)),
        "expert_dp": _grid_groups(expert_sizes, names, ("dp",)),
    }
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    return groups


def rank_coordinates(world_size: int, **kwargs) -> list[dict[str, int]]:
    """Each rank's index along every axis (its position in that axis's group)."""
    groups = rank_groups(world_size, **kwargs)
    coords = [dict() for _ in range(world_size)]
    for axis in ("tp", "cp", "dp", "pp", "ep", "expert_tp", "expert_dp"):
        for group in groups[axis]:
            for index, rank in enumerate(group):
                coords[rank][axis] = index
    return coords


@dataclass
class Axis:
    """One parallel axis as seen by this rank."""

    name: str
    group: object
    ranks: list[int]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Topology:
    """The process groups of one rank, one :class:`Axis` per parallel dimension."""

    world_size: int
    global_rank: int
    tp: Axis
    pp: Axis
    dp: Axis
    cp: Axis
    dp_cp: Axis
    ep: Axis
    expert_tp: Axis
    expert_dp: Axis
    model: Axis
    embedding: Axis
    vpp: int | None = None
    virtual_stage: int = 0
    all_groups: dict[str, list[list[int]]] = field(default_factory=dict, repr=False)

    def is_first_stage(self, ignore_virtual: bool = True) -> bool:
        """True on the first pipeline stage (and, unless ignored, first virtual chunk)."""
        if not ignore_virtual and self.vpp is not None and self.virtual_stage != 0:
            return False
        return self.pp.rank == 0

    def is_last_stage(self, ignore_virtual: bool = True) -> bool:
        """True on the last pipeline stage (and, unless ignored, last virtual chunk)."""
        if not ignore_virtual and self.vpp is not None and self.virtual_stage != self.vpp - 1:
            return False
        return self.pp.rank == self.pp.size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping around)."""
        return self.pp.ranks[(self.pp.rank + 1) % self.pp.size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping around)."""
        return self.pp.ranks[(self.pp.rank - 1) % self.pp.size]

    def coordinates(self) -> dict[str, int]:
        return {a: getattr(self, a).rank for a in ("tp", "cp", "dp", "pp", "ep", "expert_tp", "expert_dp")}


_CURRENT: Topology | None = None


def _free_port() -> int:
    """A free TCP port for a single-process run, so concurrent runs never clash."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device():
    """This rank's compute device: its current GPU when the default process group runs NCCL, else the CPU.

    The one place that decides where a rank's tensors go (models, collective buffers, flags), so a
    gloo job on a machine with GPUs stays on the CPU.  Without a process group it is the CPU.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_backend() -> str:
    """NCCL when every rank on this node has a GPU of its own, else gloo on the CPU.

    A job with more local ranks than GPUs (the 8-rank CPU demo on a one-GPU
    machine) runs on gloo rather than failing to pick a device.
    """
    import torch

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def initialize(tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, ep: int = 1,
               etp: int | None = None, order: str = DEFAULT_ORDER, backend: str | None = None,
               timeout_s: float = 600.0, ranks: list[int] | None = None) -> Topology:
    """Create the process groups for this layout and make them the current topology.

    Initializes the default group from torchrun's environment when needed.
    Every rank validates the layout before any collective, so bad sizes raise
    ValueError on all ranks instead of hanging.  ``ranks`` lays the grid over
    those global ranks only (e.g. the trainer ranks when others serve rollouts);
    every rank still calls this, and a rank outside gets axes of size 0 (no group).
    """
    global _CURRENT
    import torch
    import torch.distributed as dist

    if vpp is not None:
        _check_positive(vpp=vpp)
        if pp == 1 and vpp > 1:
            raise ValueError(f"virtual pipeline size {vpp} needs pipeline size > 1, got pp={pp}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank_groups(world if ranks is None else len(ranks), tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
        backend = backend or _default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "MASTER_ADDR" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend=backend, timeout=timeout)
    world, me = dist.get_world_size(), dist.get_rank()
    members = list(range(world)) if ranks is None else list(ranks)
    if len(set(members)) != len(members) or not all(0 <= r < world for r in members):
        raise ValueError(f"topology ranks {members} must be distinct ranks of the world of {world}")
    groups = {name: [[members[i] for i in g] for g in axis_groups] for name, axis_groups in
              rank_groups(len(members), tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order).items()}

    made: dict[tuple[int, ...], object] = {}
    axes = {}
    for name, axis_groups in groups.items():
        mine = None
        for ranks in axis_groups:
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(ranks=ranks, timeout=timeout)
            if me in ranks:
                mine = ranks
        if mine is None:
            axes[name] = Axis(name, None, [], -1)
        else:
            axes[name] = Axis(name, made[tuple(mine)], list(mine), mine.index(me))
    _CURRENT = Topology(world_size=len(members), global_rank=me, vpp=vpp, all_groups=groups, **axes)
    return _CURRENT


def current() -> Topology:
    """The topology made by :func:`initialize`; raises if there is none."""
    if _CURRENT is None:
        raise RuntimeError("no megalite topology: call megalite.topology.initialize() first")
    return _CURRENT


def is_initialized() -> bool:
    return _CURRENT is not None


def destroy() -> None:
    """Forget the current topology and tear down the default process group."""
    global _CURRENT
    import torch.distributed as dist

    _CURRENT = None
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_group(group, axis: str):
    """``group`` if given, else the current topology's group for ``axis``.

    Returns None when there is no topology at all: single-process use, where
    every collective is skipped.
    """
    if group is not None:
        return group
    if _CURRENT is None:
        return None
    return getattr(_CURRENT, axis).group


def group_size(group) -> int:
    """World size of ``group``; 1 for None (single-process use)."""
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for None (single-process use)."""
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


def _format_grid(world_size: int, **kwargs) -> str:
    groups = rank_groups(world_size, **kwargs)
    coords = rank_coordinates(world_size, **kwargs)
    lines = []
    dp = world_size // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))
    sizes = ", ".join(f"{k}={v}" for k, v in kwargs.items() if v is not None)
    lines.append(f"world size {world_size}: {sizes}, dp={dp}")
    lines.append("")
    lines.append("rank  " + "  ".join(f"{a:>9}" for a in coords[0]))
    for rank, c in enumerate(coords):
        lines.append(f"{rank:>4}  " + "  ".join(f"{v:>9}" for v in c.values()))
    lines.append("")
    for name, axis_groups in groups.items():
        lines.append(f"{name} groups ({len(axis_groups)} of size {len(axis_groups[0])}):")
        for g in axis_groups:
            lines.append("  " + str(g))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m megalite.topology``: the rank grid of the shared parallel-size flags."""
    # Imported here, so that tensor_parallel's import of topology loads nothing more.
    from megalite.flags import PARALLEL, SHARED_FLAGS, ArgumentParser, Flag, FlagTable

    parser = ArgumentParser(prog="python -m megalite.topology",
                            description="Print every rank's coordinates and every process group.")
    FlagTable((Flag("--world-size", PARALLEL, type=int, required=True),)).add_to(parser)
    SHARED_FLAGS.add_to(parser, [f.name for f in SHARED_FLAGS if f.group == PARALLEL])
    FlagTable((Flag("--order", PARALLEL, default=DEFAULT_ORDER,
                    help="the rank grid's axes, fastest-varying first"),)).add_to(parser)
    args = parser.parse_args(argv)
    print(_format_grid(args.world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                       cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
                       etp=args.expert_tensor_parallel_size, order=args.order))
    return 0


if __name__ == "__main__":
    from megalite.cli import run_cli

    sys.exit(run_cli(main))
