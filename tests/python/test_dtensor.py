"""shardgather.full_tensors and DTensor inputs on Gloo groups of 1 to 4 spawned processes
(see dtensor_cases)."""

import pytest

import dtensor_cases
from conftest import CaseResults

_results = CaseResults("dtensor_cases", dtensor_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", dtensor_cases.CASES)
def test_dtensor_gloo(world, case):
    _results.check(world, case)

