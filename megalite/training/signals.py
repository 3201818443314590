"""SIGTERM and SIGINT: save and stop at an iteration boundary, or exit when blocked in a collective.

SIGINT (Ctrl-C) is treated exactly like SIGTERM.  The handler only sets a flag, so no work happens
inside signal context; ranks agree on the flag every iteration, save, and exit 0.  A rank blocked
inside a collective (a peer has stalled) never returns to Python to see the flag, so a watcher
thread, woken through the interpreter's signal wakeup fd, gives the loop ``blocked_exit_s`` seconds
to reach the boundary and otherwise prints one line naming where it is blocked and exits with
status 128 + the signal (143 for SIGTERM).  The default of 20 s stays inside the 30 s that torchrun
and SLURM leave between SIGTERM and SIGKILL.
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
    """Records a SIGTERM or SIGINT instead of dying; ``agreed()`` tells every rank whether any rank got one.

    Ranks may receive the signal at different iterations; ``agreed`` takes the maximum over
    ``group`` so all ranks stop, and save, at the same iteration.  ``name`` is the signal this
    rank received (``"SIGTERM"`` when it only learnt of another rank's).  Must be created on the
    main thread.
    """

    def __init__(self, sigs: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
                 blocked_exit_s: float = BLOCKED_EXIT_S):
        self.sigs = tuple(sigs)
        self.sig = self.sigs[0]  # the signal received (the first of sigs until one is)
        self.blocked_exit_s = blocked_exit_s
        self.received = False
        self.stopping = False
        self._main = threading.main_thread().ident
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.sigs}
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="megalite-sigterm-watcher", daemon=True)
        self._watcher.start()

    @property
    def name(self) -> str:
        return signal.Signals(self.sig).name

    def _handle(self, signum, frame):
        if not self.received:
            self.sig = signum
        self.received = True

    def _watch(self):
        try:
            while True:
                data = self._reader.recv(64)
                if not data:
                    return
                arrived = [sig for sig in data if sig in self.sigs]  # the wakeup fd gets each signal's number
                if arrived:
                    sig = arrived[0]
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
        print(f"{rank_prefix()}error: {signal.Signals(sig).name} received {self.blocked_exit_s:.0f} s ago, but this "
              f"rank is still blocked {where}; exiting without saving", file=sys.stderr, flush=True)
        os._exit(128 + sig)

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
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self.stopping = True
        self._reader.shutdown(socket.SHUT_RDWR)
        self._watcher.join()
        self._writer.close()
        self._reader.close()
