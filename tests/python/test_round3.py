"""Reliability round 3 (round3_cases.py): the Python entry points' arguments on Gloo groups of
2 to 4 spawned processes, the threads backend and MPI."""

import pytest

import round3_cases
import shardgather
from conftest import CaseResults, run_mpi_script, run_ranks

_results = CaseResults("round3_cases", round3_cases.CASES)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", round3_cases.CASES)
def test_round3_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", round3_cases.CHECKS, ids=lambda c: c.__name__)
def test_round3_threads(world, check):
    _, errors = run_ranks(world, lambda r, comm: check(r, world, comm))
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e


MPI_SCRIPT = r"""
import sys
from mpi4py import MPI
import shardgather
sys.path.insert(0, sys.argv[1])
import round3_cases
comm = shardgather.mpi_communicator(MPI.COMM_WORLD)
for check in round3_cases.CHECKS:
    check(comm.rank, comm.size, comm)
print("MPI-OK", comm.rank)
"""


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3])
def test_round3_mpi(np_):
    run_mpi_script(MPI_SCRIPT, np_, timeout=240)
