"""The processes a test session would leave behind (Linux ``/proc``).

Each pytest process puts a token of its own in the environment (``MEGALITE_TEST_SESSION``, tests/conftest.py), so
every process its tests start carries it, and whatever those start in turn.  A process that carries the token but is
no longer a descendant of that pytest process was orphaned (its parent exited or was killed without stopping it):
nothing in the session will stop it, and it outlives the run, as the Manager server process of a Megatron-Core save
did when run_distributed killed the rank that started it.
"""

from __future__ import annotations

import os
import signal
import time

VARIABLE = "MEGALITE_TEST_SESSION"


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def _processes() -> dict[int, tuple[int, bytes]]:
    """``{pid: (parent pid, environment block)}`` of every live (not zombie) process this user may read."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, parent = f.read().rsplit(b")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if state != b"Z":
            found[int(entry)] = (int(parent), environ)
    return found


def orphans(token: str, root: int) -> dict[int, str]:
    """``{pid: command line}`` of the live processes whose environment holds ``VARIABLE=token`` and that are neither
    ``root`` nor one of its descendants."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    family, todo = set(), [root]
    while todo:
        pid = todo.pop()
        family.add(pid)
        todo.extend(children.get(pid, ()))
    marker = f"{VARIABLE}={token}".encode()
    found = {}
    for pid, (_, environ) in processes.items():
        if pid not in family and marker in environ.split(b"\0"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
    return found


def stop_orphans(token: str, root: int, wait_s: float = 10.0) -> dict[int, str]:
    """The :func:`orphans` still running after up to ``wait_s`` seconds (one that is exiting, such as a Ray worker
    whose raylet a test just stopped, is given that long), each then killed."""
    deadline = time.monotonic() + wait_s
    left = orphans(token, root)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = orphans(token, root)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
