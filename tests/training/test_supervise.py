"""tools/supervise.py: SIGTERM stops the supervisor at any moment, with no further attempt (issue 42)."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPERVISE = os.path.join(ROOT, "tools", "supervise.py")
# Each attempt appends its pid to the log file, then exits 1 (or, with "sleep", waits to be signalled).
ATTEMPT = "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); sys.argv[2] == 'sleep' and " \
          "time.sleep(60); sys.exit(1)"


def start_supervise(log, mode):
    return subprocess.Popen([sys.executable, SUPERVISE, "--max-restarts", "3", "--restart-delay", "60", "--",
                             sys.executable, "-c", ATTEMPT, str(log), mode, "--load", "unused"],
                            stderr=subprocess.PIPE, text=True)


def sigterm_during_the_restart_delay(log) -> tuple[int, str, int]:
    """Run an attempt that fails under ``tools/supervise.py`` (``--restart-delay 60``), send the supervisor SIGTERM
    while it waits to restart, and return its exit status, its stderr and the number of attempts started."""
    proc = start_supervise(log, "fail")
    try:
        assert "restarting from the last checkpoint in 60 s" in proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        _, err = proc.communicate()
    finally:
        proc.kill()
    return code, err, len(log.read_text().split())


@pytest.mark.slow
def test_sigterm_during_the_restart_delay_stops_without_another_attempt(tmp_path):
    code, err, attempts = sigterm_during_the_restart_delay(tmp_path / "attempts")
    assert code == 128 + signal.SIGTERM
    assert "supervise: SIGTERM received; not restarting" in err
    assert attempts == 1


@pytest.mark.slow
def test_sigterm_during_an_attempt_stops_it_and_the_supervisor(tmp_path):
    log = tmp_path / "attempts"
    proc = start_supervise(log, "sleep")
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text().endswith("\n")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM  # the attempt's own status: killed by SIGTERM
    child = int(log.read_text().split()[0])
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split(")")[-1].split()[0] == "Z"
    assert len(log.read_text().split()) == 1
