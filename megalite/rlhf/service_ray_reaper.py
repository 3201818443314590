"""A local Ray cluster that a TrainingService started dies with the driver, ``kill -9`` included.

Ray ties ``gcs_server`` and the raylet to the driver that started them (parent-death signal), and its workers
exit with the raylet, but its dashboard and runtime-env agents, on seeing the raylet die, first try to report
that to the (dead) GCS and give up only after a fixed 60 s; no Ray option shortens it (Ray 2.60).  So after
``ray.init`` starts a cluster, :class:`Reaper` starts this file as a small watcher process (standard library
only, so it starts in milliseconds).  It is given the processes ``ray.init`` started, learns every second the
processes they start (the agents, the workers), and reads a pipe whose write end only the driver holds.  When
the driver exits, however it exits, the read ends (end of file) and the watcher SIGKILLs those processes,
each checked by its start time, so a reused pid is never hit.  :meth:`Reaper.release`, after a clean
``ray.shutdown()``, lets the watcher exit without killing anything.  It never runs ``ray stop``, which would
stop other users' clusters on the machine.  Without ``/proc`` (not Linux) there is no watcher.

The watcher does not arm the parent-death signal (:mod:`megalite.training.parent_death`): a process that
signal kills cannot act on it, and it follows the driver *thread* that started the watcher, not the driver.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

POLL_SECONDS = 1.0  # how often the watcher looks for processes the cluster started
RELEASE = "release\n"  # the driver's line that lets the watcher exit without killing


def processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, name) of every running process (zombies, which have
    exited, are left out); empty without ``/proc``."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError):  # it exited meanwhile
            continue
        fields = rest.split()  # from the state (field 3); the start time is field 22
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[19]), name)
    return table


def descendants(roots: dict[int, int]) -> dict[int, tuple[int, str]]:
    """pid -> (start time, name) of the running processes among ``roots`` (pid -> start time) and of every
    process they started, their children's children included."""
    table = processes()
    found = {pid: (start, table[pid][2]) for pid, start in roots.items() if table.get(pid, (0, None))[1] == start}
    frontier = list(found)
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start, name) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = (start, name)
                frontier.append(pid)
    return found


def children(parent: int) -> dict[int, int]:
    """pid -> start time of ``parent``'s running children."""
    return {pid: start for pid, (ppid, start, _) in processes().items() if ppid == parent}


class Reaper:
    """The driver's handle on the watcher of the processes ``roots`` (pid -> start time) and theirs."""

    def __init__(self, roots: dict[int, int]):
        self._watcher = None
        if not roots:  # none found (no /proc)
            return
        # Its own session: a Ctrl-C to the driver's process group does not stop it before the driver exits.
        self._watcher = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), *(f"{pid}:{start}" for pid, start in roots.items())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)

    def release(self) -> None:
        """The cluster was shut down cleanly: let the watcher exit without killing anything."""
        if self._watcher is not None:
            self._watcher.stdin.write(RELEASE)
            self._watcher.stdin.close()
            self._watcher.wait()
            self._watcher = None


def _watch(roots: dict[int, int]) -> None:
    """Learn the processes of ``roots`` until stdin ends; SIGKILL them unless the driver sent :data:`RELEASE`."""
    known = descendants(roots)
    while not select.select([sys.stdin], [], [], POLL_SECONDS)[0]:
        known.update(descendants(roots))
    if sys.stdin.readline() == RELEASE:
        return
    # Children of a known process that is still running (a worker's own children): their last chance to be seen.
    known.update(descendants({pid: start for pid, (start, _) in known.items()}))
    table = processes()
    for pid, (start, _) in known.items():
        if table.get(pid, (0, None))[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it exited meanwhile
                pass


if __name__ == "__main__":
    _watch({int(pid): int(start) for pid, start in (arg.split(":") for arg in sys.argv[1:])})
