"""Reliability round 3 (round3_cases.py): the Python entry points' arguments on Gloo groups of
2 to 4 spawned processes, the threads backend and MPI."""

import pytest

import round3_cases
import shardgather
from conftest import CaseResults, check_on_threads, run_mpi_checks

_results = CaseResults("round3_cases", round3_cases.CASES)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", round3_cases.CASES)
def test_round3_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", round3_cases.CHECKS, ids=lambda c: c.__name__)
def test_round3_threads(world, check):
    check_on_threads(world, check)


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3])
def test_round3_mpi(np_):
    run_mpi_checks("round3_cases", np_, timeout=240)
