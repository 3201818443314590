"""``run_once``: a scenario that several checks share (a unit test and the fault campaign in tests/faults that
replays it, or several campaign cases observing one run) runs once per test session; a later caller checks the
earlier call's result instead of running it again."""

import functools
import inspect

_RESULTS = {}


def run_once(scenario):
    """Decorate ``scenario(scratch, *args, **kwargs)``, whose first argument is a fresh scratch directory and whose
    result is plain data (not the files it leaves there): a later call with the same other arguments returns the
    first call's result (for a coroutine function, a coroutine that does).  A call that raises is not kept."""

    def key(args, kwargs):
        return scenario, args, tuple(sorted(kwargs.items()))

    if inspect.iscoroutinefunction(scenario):
        @functools.wraps(scenario)
        async def remembered(scratch, *args, **kwargs):
            if key(args, kwargs) not in _RESULTS:
                _RESULTS[key(args, kwargs)] = await scenario(scratch, *args, **kwargs)
            return _RESULTS[key(args, kwargs)]
    else:
        @functools.wraps(scenario)
        def remembered(scratch, *args, **kwargs):
            if key(args, kwargs) not in _RESULTS:
                _RESULTS[key(args, kwargs)] = scenario(scratch, *args, **kwargs)
            return _RESULTS[key(args, kwargs)]

    return remembered
