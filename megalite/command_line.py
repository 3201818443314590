"""What megalite's ``python -m`` inspection commands share: print a report, or one error line and status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable


def print_report(make_report: Callable[[], str]) -> int:
    """Print ``make_report()`` and return 0; bad input (a ValueError) prints ``error: <message>`` on stderr
    and returns 2, the exit status for bad input, so a command's ``main`` can return it."""
    try:
        print(make_report())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
