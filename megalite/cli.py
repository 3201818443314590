"""The entry wrapper of every command: each failing rank prints one ``error:`` line.

Bad input (a ValueError, which includes argument errors from ``megalite.flags.ArgumentParser``, or a
named file that does not exist) exits 2 with just that line; other failures exit 1.
"""

from __future__ import annotations

import os
import sys
import traceback

BAD_INPUT = 2
"""Exit status of a command given bad input (argparse's)."""


def rank_prefix() -> str:
    """``[rank N] `` under a multi-rank launch (torchrun sets RANK and WORLD_SIZE), else nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""


def _error_line(message: str) -> None:
    print(f"{rank_prefix()}error: {' '.join(message.split())}", file=sys.stderr, flush=True)


def run_cli(main, *args) -> int:
    """Call ``main(*args)`` and return the exit status: its own (an int, else 0), 2 for bad input, 1 for a failure.

    Each failing rank prints its own ``[rank N] error: <message>`` line, before the process group is
    torn down, so the message reaches the user even when the launcher kills the other ranks first.
    A ValueError or FileNotFoundError (bad input) is just that line; a collective that timed out
    names its group and the ranks that did not arrive; a dropped connection points at the peer that
    failed; other exceptions are bugs and print their traceback first.  Ctrl-C that reaches here
    (pretraining catches SIGINT once it trains, and saves and stops as on SIGTERM, see
    :mod:`megalite.training.signals`) is one line and status 130.  The process group is destroyed in
    every case, as gloo aborts otherwise.
    """
    try:
        status = main(*args)
    except KeyboardInterrupt:
        _error_line("interrupted (SIGINT)")
        return 130
    except (ValueError, FileNotFoundError) as err:
        _error_line(str(err))
        return BAD_INPUT
    except Exception as err:
        from megalite.stalls import describe_timeout, is_peer_failure, is_timeout

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
        topology = sys.modules.get("megalite.topology")  # not imported: no process group to destroy
        if topology is not None:
            topology.destroy()
    return status if isinstance(status, int) else 0
