"""unshard_stream on spawned Gloo groups, the threads backend and MPI (world 1 to 4)."""

import pytest

import shardgather
import stream_cases
from conftest import CaseResults, check_on_threads, run_mpi_checks

_results = CaseResults("stream_cases", stream_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", stream_cases.CASES)
def test_stream_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("check", stream_cases.CHECKS, ids=lambda c: c.__name__)
def test_stream_threads(world, check):
    check_on_threads(world, check)


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_stream_mpi(np_):
    run_mpi_checks("stream_cases", np_, timeout=240)
