"""Optional extras in the benchmarks: a missing one costs a note, or one error line where the comparison
itself needs it, never a traceback halfway through a run."""

import importlib.util
import sys


def missing(module: str, extra: str) -> str | None:
    """None when ``module`` can be imported, else the command that installs it."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"pip install 'megalite[{extra}]'"


def require(module: str, extra: str, purpose: str) -> None:
    """Exit with status 2 and one error line before any work when ``purpose`` cannot run without ``module``."""
    install = missing(module, extra)
    if install:
        print(f"error: {purpose} needs {module} ({install})", file=sys.stderr)
        sys.exit(2)
