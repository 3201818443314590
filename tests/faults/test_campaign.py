"""The fault-injection campaign (tests/faults/campaign.py) as tests: its fast, in-process subset on every run,
the whole campaign under ``slow``.  Each prints the campaign's table (shown with ``pytest -s`` or on failure)."""

import pytest

from tests.faults import campaign
from tests.faults.campaign import Case, cases, run_case, table


def _campaign(fast: bool) -> None:
    results = [run_case(case) for case in cases(fast)]
    print(table(results))
    assert results and all(r.ok for r in results), table(results)


def test_the_fast_cases_all_behave_as_expected():
    assert {case.name for case in cases(fast=True)} < {case.name for case in cases(fast=False)}
    _campaign(fast=True)


@pytest.mark.slow
def test_the_whole_campaign_behaves_as_expected():
    _campaign(fast=False)


def test_a_case_that_misbehaves_or_crashes_fails_the_campaign(monkeypatch, capsys):
    def crash():
        raise OSError("boom")

    rows = [Case("behaves", "refused", lambda: "refused: bad file"), Case("misbehaves", "refused", lambda: "loaded it"),
            Case("crashes", "refused", crash)]
    monkeypatch.setattr(campaign, "cases", lambda fast: rows)
    assert campaign.main(["--fast"]) == 1
    out = capsys.readouterr().out
    assert "misbehaves | refused | loaded it | FAILED" in out
    assert "crashes | refused | crashed: OSError: boom | FAILED" in out
    assert "\n1 passed, 2 failed\n" in out
