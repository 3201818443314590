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
