"""unshard_stream on spawned Gloo groups, the threads backend and MPI (world 1 to 4)."""

import pytest

import shardgather
import stream_cases
from conftest import CaseResults, run_mpi_script, run_ranks

_results = CaseResults("stream_cases", stream_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", stream_cases.CASES)
def test_stream_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("check", stream_cases.CHECKS, ids=lambda c: c.__name__)
def test_stream_threads(world, check):
    _, errors = run_ranks(world, lambda r, comm: check(r, world, comm))
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e


MPI_SCRIPT = r"""
import sys
from mpi4py import MPI
import shardgather
sys.path.insert(0, sys.argv[1])
import stream_cases
comm = shardgather.mpi_communicator(MPI.COMM_WORLD)
for check in stream_cases.CHECKS:
    check(comm.rank, comm.size, comm)
print("MPI-OK", comm.rank)
"""


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_stream_mpi(np_):
    run_mpi_script(MPI_SCRIPT, np_, timeout=240)
