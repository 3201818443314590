"""Workers die with their launcher: no orphan keeps training and writing into ``--save``.

Under torchrun, each worker asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill it when
its parent, the torchrun agent, exits, however the agent exits (``kill -9`` included).  A killed
save leaves only an ``iter_N.tmp`` directory; the previous checkpoint stays ``latest``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> bool:
    """Arm the parent-death signal when launched by torchrun on Linux; True when armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        # The launcher died before the signal was armed.
        os._exit(1)
    return True
