"""async_op=True on Gloo groups of 1 to 4 spawned processes (see async_cases)."""

import pytest

import async_cases
from conftest import CaseResults

_results = CaseResults("async_cases", async_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", async_cases.CASES)
def test_async_gloo(world, case):
    _results.check(world, case)
