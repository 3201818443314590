"""Top-level error handling for training scripts: each failing rank prints one line and exits 1."""

from __future__ import annotations

import os
import sys
import traceback

from megalite import topology
from megalite.training.stalls import describe_timeout, is_peer_failure, is_timeout


def rank_prefix() -> str:
    """``[rank N] `` under a multi-rank launch (torchrun sets RANK and WORLD_SIZE), else nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""


def _error_line(message: str) -> None:
    print(f"{rank_prefix()}error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def run_cli(main) -> int:
    """Call ``main()``; on failure every failing rank prints ``[rank N] error: <message>`` and 1 is returned.

    Each rank prints its own line, before the process group is torn down, so the message reaches
    the user even when the launcher kills the other ranks first.  A ValueError (bad input) is just
    that line; a collective that timed out names its group and the ranks that did not arrive; a
    dropped connection points at the peer that failed; other exceptions are bugs and print their
    traceback first.  Ctrl-C before training starts (once it runs, SIGINT saves and stops like
    SIGTERM, see :mod:`signals`) is one line and status 130.  The process group is destroyed
    in every case, as gloo aborts otherwise.
    """
    try:
        main()
    except KeyboardInterrupt:
        _error_line("interrupted (SIGINT) before training started; nothing was saved")
        return 130
    except ValueError as err:
        _error_line(str(err))
        return 1
    except Exception as err:
        if is_timeout(err):
            _error_line(describe_timeout(err))
        elif is_peer_failure(err):
            _error_line(f"lost the connection to another rank, which failed or was killed first (see its error "
                        f"line): {str(err).splitlines()[0][:200]}")
        else:
            traceback.print_exc()
            _error_line(f"{type(err).__name__}: {err}")
        return 1
    finally:
        topology.destroy()
    return 0
