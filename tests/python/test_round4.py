"""Reliability round 4 (round4_cases.py): steps that never pair, aliasing destinations (family
A), the disagreement family over the reshard, quantize= and WeightSync, and the classes and
figures round 4 found wrong; on Gloo groups of 2 to 4 spawned processes, the threads backend
and MPI."""

import pytest

import round4_cases
import shardgather
from conftest import CaseResults, check_on_threads, run_mpi_checks

_results = CaseResults("round4_cases", round4_cases.CASES)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", round4_cases.CASES)
def test_round4_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("check", round4_cases.CHECKS, ids=lambda c: c.__name__)
def test_round4_threads(world, check):
    check_on_threads(world, check)


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_round4_mpi(np_):
    run_mpi_checks("round4_cases", np_, timeout=400)
