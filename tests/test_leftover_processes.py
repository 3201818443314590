"""tests/leftover_processes.py finds (and stops) the processes a session's tests orphaned, not its own children."""

import os
import subprocess
import sys
import uuid

import pytest

from tests import leftover_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_an_orphan_is_found_and_stopped_a_child_is_not():
    token = uuid.uuid4().hex  # not this session's: its own check stays clean
    env = {**os.environ, leftover_processes.VARIABLE: token}
    child = subprocess.Popen(["sleep", "30"], env=env)
    # The shell starts a sleep in the background and exits: the sleep is orphaned.
    shell = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], env=env, capture_output=True,
                           text=True, check=True)
    orphan = int(shell.stdout)
    try:
        assert leftover_processes.orphans(token, os.getpid()) == {orphan: "sleep 30"}
        assert leftover_processes.stop_orphans(token, os.getpid(), wait_s=0.5) == {orphan: "sleep 30"}
        assert leftover_processes.stop_orphans(token, os.getpid(), wait_s=5) == {}  # killed: gone within moments
        assert child.poll() is None  # a child is not an orphan
    finally:
        child.kill()
        child.wait()


def test_a_process_that_exits_while_read_is_not_running(monkeypatch):
    """/proc/PID/stat of a process that exits between the open and the read raises ESRCH (ProcessLookupError, as a
    test_launch_faults wait saw): not running, not an error."""
    import builtins

    class Vanished:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise ProcessLookupError(3, "No such process")

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: Vanished() if str(path).startswith("/proc/")
                        else real_open(path, *a, **k))
    assert leftover_processes.running(os.getpid()) is False
