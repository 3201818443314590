"""The fault-injection campaign of issue 42: replays kills, corruptions and stalls against the real entry points
and prints one row per case (case | expected | observed | ok) and the totals.

``python -m tests.faults.campaign`` runs every case (about a minute: services, subprocesses, two-rank loads);
``--fast`` runs the in-process subset CI runs (seconds).  The exit status is 1 if any case failed.
Each case's ``run()`` returns the observed outcome as a short string; it is ok when ``expected`` occurs in it.
"""

import argparse
import dataclasses
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CASE_TIMEOUT = 300  # seconds; a case that hangs (a FIFO opened for reading, a lost collective) fails instead


@dataclasses.dataclass(frozen=True)
class Case:
    """One fault: ``run()`` injects it and returns what happened; ``fast`` cases run in-process in seconds."""

    name: str
    expected: str
    run: Callable[[], str]
    fast: bool = False


@dataclasses.dataclass(frozen=True)
class Result:
    case: Case
    observed: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.case.expected in self.observed


def in_scratch(body: Callable[[Path], str]) -> Callable[[], str]:
    """A ``run()`` that calls ``body`` with a fresh scratch directory, removed afterwards."""

    def run() -> str:
        with tempfile.TemporaryDirectory(prefix="megalite-fault-") as scratch:
            return body(Path(scratch))

    return run


def outcome(call: Callable[[], object]) -> str:
    """What ``call()`` did: ``returned`` or its exception as ``Type: message`` (the message's first line)."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - every failure is an outcome to report
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return "returned"


def _timed_out(signum, frame):
    raise TimeoutError(f"no outcome within {CASE_TIMEOUT} s")


def run_case(case: Case) -> Result:
    """Run one case under the per-case timeout; an unexpected exception is its observed outcome."""
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(CASE_TIMEOUT)
    try:
        observed = case.run()
    except Exception as err:  # noqa: BLE001 - a crash is an observation, not the end of the campaign
        observed = f"crashed: {type(err).__name__}: {err}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return Result(case, " ".join(observed.split()), time.monotonic() - start)


def cases(fast: bool) -> list[Case]:
    """Every case of the campaign, or only its fast ones."""
    from tests.faults import checkpoint_cases, runtime_cases

    every = checkpoint_cases.CASES + runtime_cases.CASES
    return [case for case in every if case.fast or not fast]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def table(results: list[Result]) -> str:
    """The campaign's table (observed clipped to one line; the full text of a failed case follows the table)
    and its totals line, ``N passed, M failed``."""
    lines = ["case | expected | observed | ok", "---|---|---|---"]
    for r in results:
        lines.append(f"{r.case.name} | {_clip(r.case.expected, 60)} | {_clip(r.observed, 110)} | "
                     f"{'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s)")
    for r in results:
        if not r.ok:
            lines.append(f"\n{r.case.name}: expected {r.case.expected!r}\n  observed {r.observed!r}")
    passed = sum(r.ok for r in results)
    lines.append(f"\n{passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="only the in-process cases (what CI runs)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    results = []
    for case in cases(args.fast):
        results.append(run_case(case))
        print(f"{'ok' if results[-1].ok else 'FAILED'}: {case.name}", file=sys.stderr, flush=True)
    print(table(results))
    print(f"wall time {time.monotonic() - start:.0f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
