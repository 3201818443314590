"""SIGTERM handling: save and stop at an iteration boundary, or exit when blocked in a collective.

The handler only sets a flag, so no work happens inside signal context; ranks agree on the flag
every iteration, save, and exit 0.  A rank blocked inside a collective (a peer has stalled) never
returns to Python to see the flag, so a watcher thread, woken through the interpreter's signal
wakeup fd, gives the loop ``blocked_exit_s`` seconds to reach the boundary and otherwise prints
one line naming where it is blocked and exits with status 143 (128 + SIGTERM).  The default of 20
s stays inside the 30 s that torchrun and SLURM leave between SIGTERM and SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from megalite import topology
from megalite.cli import rank_prefix
from megalite.stalls import group_in_stack

BLOCKED_EXIT_S = 20.0


class SigtermFlag:
    """Records a SIGTERM instead of dying; ``agreed()`` tells every rank whether any rank got one.

    Ranks may receive the signal at different iterations; ``agreed`` takes the maximum over
    ``group`` so all ranks stop, and save, at the same iteration.  Must be created on the main
    thread.
    """

    def __init__(self, sig: int = signal.SIGTERM, blocked_exit_s: float = BLOCKED_EXIT_S):
        self.sig = sig
        self.blocked_exit_s = blocked_exit_s
        self.received = False
        self.stopping = False
        self._main = threading.main_thread().ident
        self._previous = signal.signal(sig, self._handle)
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="megalite-sigterm-watcher", daemon=True)
        self._watcher.start()

    def _handle(self, signum, frame):
        self.received = True

    def _watch(self):
        try:
            while True:
                data = self._reader.recv(64)
                if not data:
                    return
                if self.sig in data:
                    break
        except OSError:
            return
        deadline = time.monotonic() + self.blocked_exit_s
        while time.monotonic() < deadline:
            if self.stopping:
                return
            time.sleep(0.2)
        frames = []
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        named = group_in_stack(reversed(frames))
        where = f"at {os.path.basename(frames[0].f_code.co_filename)}:{frames[0].f_lineno}" if frames else ""
        if named:
            where = f"in a collective on the {named[0]} group (ranks {named[1]}) {where}"
        print(f"{rank_prefix()}error: SIGTERM received {self.blocked_exit_s:.0f} s ago, but this rank is still "
              f"blocked {where}; exiting without saving", file=sys.stderr, flush=True)
        os._exit(128 + self.sig)

    def agreed(self, group=None) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            self.stopping = self.received
            return self.received
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=topology.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.stopping = bool(flag.item())
        return self.stopping

    def restore(self) -> None:
        """Reinstall the handler and wakeup fd that were active before, and stop the watcher."""
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(self.sig, self._previous)
        self.stopping = True
        self._reader.shutdown(socket.SHUT_RDWR)
        self._watcher.join()
        self._writer.close()
        self._reader.close()
