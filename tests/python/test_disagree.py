"""The generated disagreement family D on Gloo groups of 2 to 4 spawned processes."""

import pytest

import disagree_cases
from conftest import CaseResults

_results = CaseResults("disagree_cases", disagree_cases.CASES)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", disagree_cases.CASES)
def test_disagree_gloo(world, case):
    _results.check(world, case)
