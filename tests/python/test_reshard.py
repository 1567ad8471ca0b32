"""ReshardPlan and reshard from Python: Gloo groups of 1 to 4 spawned processes and the threads
backend (worlds 1, 3 and 5), every destination checked bit for bit (reshard_cases.py)."""

import pytest

import reshard_cases
from conftest import CaseResults, check_on_threads

_results = CaseResults("reshard_cases", reshard_cases.CASES)
_kills = CaseResults("reshard_cases", ["exit_case_source_killed_mid_reshard"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", reshard_cases.CASES)
def test_reshard_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [1, 3, 5])
@pytest.mark.parametrize("case", reshard_cases.CASES)
def test_reshard_threads(world, case):
    check_on_threads(world, getattr(reshard_cases, case))


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_source_killed_mid_reshard(world):
    _kills.check(world, "exit_case_source_killed_mid_reshard")
