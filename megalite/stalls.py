"""Naming a stalled collective: which process group it ran on, and which ranks never arrived.

Gloo and NCCL report a timed-out collective without saying where.  :func:`describe_timeout`
recovers that from what the failing rank holds:

- the group: the innermost frame of the stack (the exception's traceback, or a live thread's
  stack) that holds a ProcessGroup, mapped onto the topology's axis names;
- the ranks that did not arrive: every rank whose collective times out says so in the job's
  key-value store (``megalite/timed_out/<rank>``) and waits a few seconds for its peers to do the
  same; peers of the group that never report were not in a collective at all, so they are the
  ones that stalled.
"""

from __future__ import annotations

import time
import traceback

import torch.distributed as dist

from megalite import topology

_KEY = "megalite/timed_out/"
_PEER_WAIT_S = 5.0


def is_timeout(err: BaseException) -> bool:
    """True for the error a backend raises when a collective exceeds the process-group timeout."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("timed out" in text or "collective operation timeout" in text)


def is_peer_failure(err: BaseException) -> bool:
    """True for the error a backend raises when a peer rank's connection drops (that rank failed)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        cause in text for cause in ("connection closed by peer", "connection reset by peer", "broken pipe"))


def _axis_of(group) -> tuple[str, list[int]] | None:
    if group is None:
        return None
    if topology.is_initialized():
        topo = topology.current()
        for name in ("tp", "cp", "dp", "pp", "ep", "expert_tp", "expert_dp", "model", "embedding"):
            axis = getattr(topo, name)
            if axis.group is group:
                return name, axis.ranks
    if dist.is_initialized() and group is dist.group.WORLD:
        return "world", list(range(dist.get_world_size()))
    return None


def _groups_in(frame_locals: dict):
    for value in frame_locals.values():
        if isinstance(value, dist.ProcessGroup):
            yield value
        for attr in ("group", "pp_group", "tp_group", "dp_group"):
            inner = getattr(value, attr, None) if not isinstance(value, (int, float, str, bytes)) else None
            if isinstance(inner, dist.ProcessGroup):
                yield inner


def group_in_stack(frames) -> tuple[str, list[int]] | None:
    """(axis name, ranks) of the innermost frame in ``frames`` (outermost first) that holds a topology group."""
    for frame in reversed(list(frames)):
        for group in _groups_in(frame.f_locals):
            named = _axis_of(group)
            if named is not None:
                return named
    return None


def _missing_peers(ranks: list[int]) -> list[int] | None:
    """Ranks of ``ranks`` that report no timed-out collective of their own within a few seconds."""
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        store.set(f"{_KEY}{me}", "1")
        deadline = time.monotonic() + _PEER_WAIT_S
        while True:
            missing = [r for r in ranks if r != me and not store.check([f"{_KEY}{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.2)
    except Exception:
        return None


def describe_timeout(err: BaseException) -> str:
    """One line naming the group of the timed-out collective and the ranks that did not arrive."""
    named = group_in_stack(frame for frame, _ in traceback.walk_tb(err.__traceback__))
    if named is None:
        where, ranks = "a collective", list(range(dist.get_world_size())) if dist.is_initialized() else []
    else:
        where, ranks = f"a collective on the {named[0]} group (ranks {named[1]})", named[1]
    missing = _missing_peers(ranks) if dist.is_initialized() else None
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive"
    elif missing == []:
        who = "every rank of the group reported a timeout too, so the stall is further along the chain"
    else:
        who = "the rank that did not arrive is unknown"
    return (f"{where} did not complete within --distributed-timeout-minutes; {who} "
            f"(backend: {str(err).splitlines()[0][:200]})")
