"""tests/forked_commands.py: a command run in a forked child prints and exits exactly as ``python ARGV`` does."""

import os
import subprocess
import sys

from tests.forked_commands import ForkedCommands

SCRIPT = '''
import atexit, sys, threading, time, warnings
print("argv", sys.argv, "path0", sys.path[0], "name", __name__, "stdin", repr(sys.stdin.read()))
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "message":
    sys.exit("bye")
warnings.warn("careful")
sys.exit(int(sys.argv[1]))
'''


def test_forked_commands_print_and_exit_as_fresh_interpreters(tmp_path):
    script = tmp_path / "command.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    commands = [([str(script), arg], work, {"EXTRA": "1"}) for arg in ("raise", "message", "3", "0")]
    commands += [(["-m", "json.tool", "missing.json"], work, {}), (["-m", "json.tool", "--no-such-flag"], work, {})]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    with ForkedCommands(env, preload=("json.tool",), timeout=60) as helper:  # two batches from one helper
        forked = helper.run(commands[:4]) + helper.run(commands[4:])
    for (argv, cwd, extra), got in zip(commands, forked):
        real = subprocess.run([sys.executable, *argv], cwd=cwd, env={**env, **extra}, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)
        assert got.args == [sys.executable, *argv]
        assert (got.returncode, got.stdout, got.stderr) == (real.returncode, real.stdout, real.stderr), argv
    assert [got.returncode for got in forked] == [1, 1, 3, 0, 2, 2]
    assert "ValueError: boom" in forked[0].stderr and "atexit ran" in forked[0].stdout
