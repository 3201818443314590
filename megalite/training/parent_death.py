"""Workers die with their launcher: no orphan keeps training and writing into ``--save``.

Under torchrun, each worker asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill it when
its parent, the torchrun agent, exits, however the agent exits (``kill -9`` included).  A killed
save leaves only an ``iter_N.tmp`` directory; the previous checkpoint stays ``latest``.  The
TrainingService's local workers arm the same signal against their driver (:func:`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent exits (Linux); True when armed.

    ``parent`` is the pid the caller expects as its parent: if it is already gone (the signal
    was armed too late to fire), this process exits at once.  The signal follows the parent
    *thread* that started this process, so start it from a thread that lives as long as the parent.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True


def exit_with_parent() -> bool:
    """Arm the parent-death signal when launched by torchrun on Linux; True when armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return die_with_parent(os.getppid())
