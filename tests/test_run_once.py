"""tests/run_once.py: a scenario runs once per set of arguments (the scratch directory aside); failures are not kept."""

import asyncio

import pytest

from tests.run_once import run_once


def test_a_scenario_runs_once_per_arguments_and_a_failure_is_retried(tmp_path):
    calls = []

    @run_once
    def scenario(scratch, sig, backend="local"):
        calls.append((scratch, sig, backend))
        if backend == "broken" and len(calls) == 1:
            raise OSError("first call fails")
        return [sig, backend]

    with pytest.raises(OSError):
        scenario(tmp_path / "a", 9, backend="broken")
    assert scenario(tmp_path / "b", 9, backend="broken") == [9, "broken"]
    assert scenario(tmp_path / "c", 9) is scenario(tmp_path / "d", 9)
    assert scenario(tmp_path / "e", 15) == [15, "local"]
    assert [call[0].name for call in calls] == ["a", "b", "c", "e"]

    @run_once
    async def coroutine(scratch):
        calls.append(scratch)
        return object()

    first, second = asyncio.run(coroutine(tmp_path / "f")), asyncio.run(coroutine(tmp_path / "g"))
    assert first is second and calls[-1] == tmp_path / "f" and len(calls) == 5
