"""Top-level error handling for training scripts: one clear line on rank 0 and exit status 1."""

from __future__ import annotations

import os
import sys

from megalite import topology


def run_cli(main) -> int:
    """Call ``main()``; a ValueError prints ``error: <message>`` once (rank 0) and returns 1.

    The process group is destroyed in every case, as gloo aborts otherwise.
    Other exceptions are bugs and keep their traceback.
    """
    try:
        main()
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        topology.destroy()
    return 0
