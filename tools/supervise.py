"""Automatic restart: rerun a training launch until it finishes or runs out of restarts.

    python tools/supervise.py --max-restarts 3 -- \
        torchrun --nproc_per_node 8 examples/pretrain_gpt.py --save ckpt/run --load ckpt/run ...

Each attempt is a fresh torchrun, so it gets a fresh rendezvous, store and set of ports; with
``--load`` naming the ``--save`` directory it resumes from the last checkpoint, and megalite's
exact resume makes the finished run's losses those of an uninterrupted run.  A launch that exits
0 (finished) ends the loop; any other exit (a killed worker, a lost node, a stalled collective, and
also a SIGTERM sent to torchrun directly, since torchrun exits 1 after forwarding a signal however its
workers exit) starts the next attempt after ``--restart-delay`` seconds.
SIGTERM and SIGINT, at any moment, are passed on to the running launch (if one runs) and stop the loop: the
supervisor then exits with the launch's status, or 128 + the signal number when it came between attempts.
Each attempt sees its number in ``MEGALITE_RESTART_ATTEMPT`` (0 first).

Why not ``torchrun --max-restarts``: on torch 2.13 with gloo, a worker group restarted inside the
same torchrun fails in ``init_process_group`` (it connects to the dead worker's old port) or hangs,
which a plain torch script reproduces; a new torchrun process does not have that state.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from megalite.cli import run_cli
from megalite.flags import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(prog="supervise", description=__doc__.split("\n")[0])
    parser.add_argument("--max-restarts", type=int, default=3, help="attempts after the first (default 3)")
    parser.add_argument("--restart-delay", type=float, default=5.0, help="seconds between attempts (default 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the launch command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: supervise.py [options] -- torchrun ...")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if "--load" not in command:
        parser.error("the command needs --load (normally the --save directory) so that a restart resumes")

    state = {"proc": None, "stop": None}

    def forward(signum, frame):
        state["stop"] = signum
        if state["proc"] is not None and state["proc"].poll() is None:
            state["proc"].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    for attempt in range(args.max_restarts + 1):
        if state["stop"] is not None:  # the signal came during the restart delay
            print(f"supervise: {signal.Signals(state['stop']).name} received; not restarting", file=sys.stderr,
                  flush=True)
            return 128 + state["stop"]
        env = {**os.environ, "MEGALITE_RESTART_ATTEMPT": str(attempt)}
        state["proc"] = subprocess.Popen(command, env=env)
        if state["stop"] is not None:  # the signal came while the launch was being started
            state["proc"].send_signal(state["stop"])
        code = state["proc"].wait()
        if code < 0:  # killed by a signal: report it as a shell does
            code = 128 - code
        if code == 0 or state["stop"] is not None:
            return code
        left = args.max_restarts - attempt
        if left:
            print(f"supervise: attempt {attempt + 1} exited with status {code}; restarting from the last checkpoint "
                  f"in {args.restart_delay:g} s ({left} restart{'s' if left > 1 else ''} left)",
                  file=sys.stderr, flush=True)
            resume = time.monotonic() + args.restart_delay
            while state["stop"] is None and time.monotonic() < resume:
                time.sleep(min(0.1, max(resume - time.monotonic(), 0.0)))
    print(f"supervise: giving up after {args.max_restarts + 1} attempts; the last exit status was {code}",
          file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(run_cli(main))
