"""Verifiable rewards: check a response's answer (math, exact match) or run its code against tests.

Each check returns a :class:`Verdict`, a reward of 1.0 or 0.0 and the reason, so a run can log why a response
scored 0.  Math answers are compared by ``math-verify`` (the optional ``verify`` extra), which parses LaTeX and
plain expressions and decides equivalence symbolically (``1/2``, ``0.5`` and ``\\frac{1}{2}`` are one answer).
Code runs in a separate Python process with a wall-clock and CPU time limit, an address-space limit
(``resource.setrlimit``), no core files, and no network: the child first tries to enter fresh user and network
namespaces (Linux ``unshare``, where unprivileged user namespaces are enabled: then no interface but a down
loopback exists) and, either way, replaces ``socket.socket`` with one that refuses (best effort only: code that
loads its own socket via ``ctypes`` passes that guard).  This is a grader for the model's own outputs, not a
sandbox for hostile code.

For the RL trainer, :func:`math_reward` is a ``--reward-fn`` (``megalite.rlhf.verifiers:math_reward``) and
:func:`answer_reward` turns ``prompt``/``answer`` records (``megalite.rlhf.math_task.read_answers``) into one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable, NamedTuple

from megalite.data.synthetic import arithmetic_answer


class Verdict(NamedTuple):
    """A verifier's reward (1.0 or 0.0) and why."""

    reward: float
    reason: str


def boxed_answer(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None when there is none
    or it is not closed."""
    if not isinstance(text, str):
        raise ValueError(f"the text to extract a \\boxed{{}} answer from must be a string, got {type(text).__name__}")
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


def _check_strings(response: str, answer: str) -> None:
    for name, value in (("response", response), ("answer", answer)):
        if not isinstance(value, str):
            raise ValueError(f"the {name} to verify must be a string, got {type(value).__name__}")
    if not answer.strip():
        raise ValueError("the reference answer is empty")


def check_exact(response: str, answer: str) -> Verdict:
    """1 when the response's answer (its last ``\\boxed{}`` if it has one, else the whole response), with
    whitespace runs collapsed, equals ``answer`` the same way."""
    _check_strings(response, answer)
    boxed = boxed_answer(response)
    given = " ".join((response if boxed is None else boxed).split())
    if given == " ".join(answer.split()):
        return Verdict(1.0, "exact match")
    return Verdict(0.0, f"answer {given[:80]!r} is not {answer!r}")


MATH_TIMEOUT_S = 5
"""Seconds math-verify may spend parsing, and comparing, one answer (its own default), on the main thread."""


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("math answers are checked with math-verify: pip install math-verify "
                          "(or megalite's extra: pip install 'megalite[verify]')") from None
    return math_verify


def check_math(response: str, answer: str) -> Verdict:
    """1 when math-verify finds the response's answer (a ``\\boxed{}`` one first, else the last expression it
    finds) equivalent to ``answer`` (plain or LaTeX, e.g. ``0.5`` or ``\\frac{1}{2}``).  A ValueError when
    math-verify cannot read ``answer`` itself: a reference that cannot be parsed would score every response 0."""
    _check_strings(response, answer)
    math_verify = _math_verify()
    # math-verify bounds its parsing and comparison with signal.alarm, which only the main thread may set (it
    # refuses elsewhere); off the main thread (a scoring server's serving thread) the checks run unbounded
    limit = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    given = math_verify.parse(response, parsing_timeout=limit)
    if not given:
        return Verdict(0.0, "no answer found in the response")
    if math_verify.verify(gold, given, timeout_seconds=limit):
        return Verdict(1.0, f"{given[-1]} equals {answer}")
    return Verdict(0.0, f"{given[-1]} is not {answer}")


def math_reward(prompt: str, response: str) -> float:
    """The RL trainer's "a+b=" task scored by :func:`check_math`: any form equivalent to the sum (``7``,
    ``7.0``, ``\\boxed{7}``) earns 1, where the default ``arithmetic_reward`` wants the digits exactly."""
    return check_math(response, arithmetic_answer(prompt)).reward


def answer_reward(records: list[dict], check: Callable[[str, str], Verdict] = check_math
                  ) -> Callable[[str, str], float]:
    """A ``(prompt, response) -> float`` reward that scores a response with ``check`` against its prompt's
    ``answer`` in ``records``; a ValueError for a prompt given two answers, or scored without one."""
    answers: dict[str, str] = {}
    for record in records:
        prompt, answer = record["prompt"], record["answer"]
        if answers.setdefault(prompt, answer) != answer:
            raise ValueError(f"prompt {prompt[:60]!r} has two answers, {answers[prompt]!r} and {answer!r}")

    def reward(prompt: str, response: str) -> float:
        if prompt not in answers:
            raise ValueError(f"no answer for prompt {prompt[:60]!r} among the {len(answers)} records")
        return check(response, answers[prompt]).reward
    return reward


_LAUNCHER = r"""
import ctypes, os, resource, socket, sys
def main():
    token = sys.stdin.buffer.read()
    path, seconds, memory, output = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
    except Exception:
        pass
    class NoNetwork(socket.socket):
        def __init__(self, *args, **kwargs):
            raise OSError("network access is disabled while verifying code")
    socket.socket = NoNetwork
    sys.argv = [path]
    with open(path) as file:
        code = compile(file.read(), path, "exec")
    try:
        exec(code, {"__name__": "__main__"})
    except SystemExit as stop:
        raise SystemExit(f"SystemExit({stop.code!r}) before the tests finished")
    sys.stdout.flush()
    os.write(1, token)
main()
"""
OUTPUT_LIMIT = 16 << 20
"""Bytes a checked program may write to a file (its stdout and stderr are files too)."""


def check_code(program: str, tests: str, time_limit: float = 5.0, memory_mb: int = 512) -> Verdict:
    """1 when ``program`` followed by ``tests`` (Python statements that raise on failure, e.g. ``assert``
    lines) runs to the end in a fresh interpreter within ``time_limit`` seconds (wall clock; CPU time is limited
    the same) and ``memory_mb`` MiB of address space; 0 with the reason (failed assertion or other error,
    timeout, killed by a signal) else.  Exit status 0 alone is not a pass: the launcher writes a random token
    to stdout after the tests, so a program that exits early (``sys.exit(0)``, ``os._exit(0)``) fails."""
    for name, value in (("program", program), ("tests", tests)):
        if not isinstance(value, str):
            raise ValueError(f"the {name} to run must be a string, got {type(value).__name__}")
    if not tests.strip():
        raise ValueError("no tests to run the program against: a program with no tests would always pass")
    if not time_limit > 0:
        raise ValueError(f"the time limit must be positive, got {time_limit}")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise ValueError(f"the memory limit must be an integer of at least 64 MiB (Python's own start), got {memory_mb}")
    token = os.urandom(16).hex().encode()
    with tempfile.TemporaryDirectory(prefix="megalite-verify-") as folder:
        path = os.path.join(folder, "solution.py")
        with open(path, "w") as file:
            file.write(program + "\n\n" + tests + "\n")
        command = [sys.executable, "-I", "-c", _LAUNCHER, path, str(max(1, int(time_limit + 0.999))),
                   str(memory_mb << 20), str(OUTPUT_LIMIT)]
        with open(os.path.join(folder, "out"), "w+b") as out, open(os.path.join(folder, "err"), "w+b") as err:
            process = subprocess.Popen(command, cwd=folder, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                       start_new_session=True, env={"PATH": os.defpath})
            try:
                process.communicate(input=token, timeout=time_limit)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                return Verdict(0.0, f"timed out after {time_limit:g} s")
            finished = _tail(out, len(token)) == token
            error = _tail(err, 4096).decode(errors="replace").strip().splitlines()
    if process.returncode == 0 and finished:
        return Verdict(1.0, "all tests passed")
    if process.returncode == 0:
        return Verdict(0.0, "exit 0 before the tests finished")
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name
        cause = " (CPU time limit)" if name == "SIGXCPU" else ""
        return Verdict(0.0, f"killed by {name}{cause}")
    return Verdict(0.0, f"exit {process.returncode}: {error[-1][:200] if error else 'no error output'}")


def _tail(file, size: int) -> bytes:
    """The last ``size`` bytes of an open binary file."""
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - size))
    return file.read()
