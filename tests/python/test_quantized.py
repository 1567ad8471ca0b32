"""Quantized unshards (quantized_cases.py), bit for bit against the references: the threads
backend at worlds 1 to 7, Gloo groups of 2 to 4 spawned processes, MPI at 2 to 4 ranks."""

import pytest

import quantized_cases
import shardgather
from conftest import CaseResults, check_on_threads, run_mpi_checks

_results = CaseResults("quantized_cases", quantized_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("check", quantized_cases.CHECKS, ids=lambda c: c.__name__)
def test_quantized_threads(world, check):
    check_on_threads(world, check)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", quantized_cases.CASES)
def test_quantized_gloo(world, case):
    _results.check(world, case)


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_quantized_mpi(np_):
    run_mpi_checks("quantized_cases", np_, timeout=240)
