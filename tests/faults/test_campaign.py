"""The fault-injection campaign (tests/faults/campaign.py) as tests: its fast, in-process subset on every run,
the whole campaign under ``slow``.  Each prints the campaign's table (shown with ``pytest -s`` or on failure)."""

import pytest

from tests.faults.campaign import cases, run_case, table


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
