"""Run many ``python ...`` command lines as children forked from one interpreter that imported torch once.

A test that checks what a command prints and how it exits (bad input is one ``error:`` line and exit 2) needs
the command's own process, but a fresh interpreter spends seconds of CPU importing torch, and the CLI tests start
dozens.  ``ForkedCommands`` starts one helper interpreter (this file as a script) with the commands'
environment; it imports ``preload`` and forks one child per command of each batch.  A child is what
``python ARGV`` would be: its own process and process group, the command's working directory and environment,
``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, the script or ``-m`` module run as ``__main__``,
an uncaught exception printed as a traceback with exit status 1, then the interpreter's exit (``SystemExit``'s
status, non-daemon threads joined, ``atexit``; not the teardown of every module); stdin is empty, stdout and
stderr are captured.  Whatever the preloaded imports printed comes first in every command's output, as in each
fresh process.

Only what runs at import differs: the helper imported ``preload`` once, under the shared ``env``, so a
command's ``extra_env`` must not be something those imports read (ports, ranks and file names are fine).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# What most commands import first (torch, the launcher, the flag table and the GPT trainer): seconds of CPU each.
PRELOAD = ("torch", "torch.distributed.run", "megalite.training.flags", "megalite.training.gpt")


class ForkedCommands:
    """One helper interpreter that imported ``preload`` under ``env``; ``run`` forks a batch of commands from it.

    Batches run one after another (a later batch may depend on files an earlier one wrote); ``close`` (or the end
    of a ``with`` block) stops the helper.
    """

    def __init__(self, env: dict, preload=PRELOAD, timeout: float = 300.0):
        self.timeout = timeout
        self._helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(list(preload))],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)

    def run(self, commands: list[tuple[list[str], str, dict]]) -> list[subprocess.CompletedProcess]:
        """Run every ``(argv after the interpreter, cwd, extra_env)`` at once; each one's ``CompletedProcess``
        (``args`` is the full command line, ``[sys.executable, *argv]``).  A command still running after
        ``timeout`` seconds is killed with its process group (return code -9)."""
        batch = {"timeout": self.timeout, "commands": [{"argv": list(argv), "cwd": str(cwd), "env": dict(extra)}
                                                       for argv, cwd, extra in commands]}
        self._helper.stdin.write(json.dumps(batch) + "\n")
        self._helper.stdin.flush()
        ready, _, _ = select.select([self._helper.stdout], [], [], self.timeout + 120)
        reply = self._helper.stdout.readline() if ready else ""
        if not reply:
            self._helper.kill()
            raise RuntimeError(f"{__file__} did not answer (exit {self._helper.wait()}):\n{self._helper.stderr.read()}")
        return [subprocess.CompletedProcess([sys.executable, *argv], r["returncode"], r["stdout"], r["stderr"])
                for (argv, _, _), r in zip(commands, json.loads(reply))]

    def close(self) -> None:
        self._helper.stdin.close()
        self._helper.wait(timeout=60)
        self._helper.stdout.close()
        self._helper.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_commands(commands: list[tuple[list[str], str, dict]], env: dict, preload=PRELOAD,
                 timeout: float = 300.0) -> list[subprocess.CompletedProcess]:
    """One batch of ``ForkedCommands(env, preload, timeout).run(commands)``."""
    with ForkedCommands(env, preload, timeout) as forked:
        return forked.run(commands)


def _child(command: dict, out: str, err: str) -> None:
    """Become ``python ARGV`` in this forked process and exit as the interpreter would; never returns."""
    os.setpgid(0, 0)
    os.chdir(command["cwd"])
    os.environ.update(command["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    argv = command["argv"]
    status = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            # A fresh interpreter has not imported the module it runs; a preloaded copy would make runpy warn.
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException as error:  # noqa: BLE001 - the interpreter prints any uncaught exception and exits 1
        frames = error.__traceback__
        while frames.tb_next and frames.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            frames = frames.tb_next  # from the command's own frames on, as the interpreter shows it
        traceback.print_exception(type(error), error, frames)
        status = 1
    # The interpreter's exit: join non-daemon threads, run atexit, flush.  Tearing down every module, as
    # finalization would, is skipped: in a forked child it copies the whole torch heap page by page.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_status(code) -> int:
    """The exit status of ``SystemExit(code)``: None is 0, an integer itself, anything else is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _serve(preload: list[str]) -> None:
    """Import the preloads, then for each batch (a JSON line on stdin) fork every command and answer with their
    results (a JSON line on stdout)."""
    replies, own_stderr = os.fdopen(os.dup(1), "w"), os.dup(2)
    scratch = tempfile.mkdtemp(prefix="megalite-forked-")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(os.path.join(scratch, f"preload.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        for module in preload:
            importlib.import_module(module)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(own_stderr, 2)
    preamble = {}
    for name in ("stdout", "stderr"):
        with open(os.path.join(scratch, f"preload.{name}"), errors="replace") as f:
            preamble[name] = f.read()
    for line in sys.stdin:
        batch = json.loads(line)
        replies.write(json.dumps(_run_batch(batch["commands"], batch["timeout"], preamble, scratch)) + "\n")
        replies.flush()
    shutil.rmtree(scratch)


def _run_batch(commands: list[dict], timeout: float, preamble: dict, scratch: str) -> list[dict]:
    children = {}
    for i, command in enumerate(commands):
        out, err = (os.path.join(scratch, f"{i}.{name}") for name in ("stdout", "stderr"))
        pid = os.fork()
        if pid == 0:
            _child(command, out, err)
        children[pid] = i
    codes = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in children:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            for pid, i in children.items():
                if i not in codes:
                    os.killpg(pid, signal.SIGKILL)
            deadline = float("inf")
        elif pid == 0:
            time.sleep(0.05)
    results = []
    for i in range(len(commands)):
        result = {"returncode": codes[i]}
        for name in ("stdout", "stderr"):
            with open(os.path.join(scratch, f"{i}.{name}"), errors="replace") as f:
                result[name] = preamble[name] + f.read()
        results.append(result)
    return results


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
