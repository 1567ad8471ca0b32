"""The threads backend driven from Python threads, and the MPI backend under mpirun."""

import threading
import time

import pytest
import torch

import shardgather
from conftest import run_mpi_script, run_ranks
from gloo_cases import DTYPES, make, raw


def params_of(rank):
    rows = [2, 3, 1, 2][rank % 4]
    params = [make((rows, 3), dt, 10 * rank + k) for k, dt in enumerate(DTYPES)]
    return params + [make((), torch.float32, rank), torch.empty(rank, 0), make((5, 4), torch.float64, rank).t()]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_threads_matches_expected(world):
    results, errors = run_ranks(
        world, lambda r, c: shardgather.foreach_all_gather(params_of(r), c, timeout=10)
    )
    assert errors == [None] * world
    expected = [params_of(r) for r in range(world)]
    for out in results:
        assert type(out) is list and len(out) == len(expected[0])
        for i, per_rank in enumerate(out):
            for r, t in enumerate(per_rank):
                e = expected[r][i]
                assert t.dtype == e.dtype and t.shape == e.shape
                assert torch.equal(raw(t), raw(e.contiguous()))


def test_threads_timeout_and_poison():
    def fn(r, c):
        if r == 1:
            return None  # never calls
        start = time.monotonic()
        with pytest.raises(shardgather.CollectiveTimeout, match="rank 0"):
            shardgather.foreach_all_gather([torch.ones(2)], c, timeout=0.3)
        assert time.monotonic() - start < 2.0
        assert c.is_poisoned
        with pytest.raises(shardgather.CommAbortedError):
            shardgather.foreach_all_gather([torch.ones(2)], c, timeout=0.3)
        return True

    results, errors = run_ranks(2, fn)
    assert errors == [None, None] and results[0]


def test_threads_abort_wakes_blocked_call():
    group = shardgather.ThreadGroup(2)
    caught = []

    def blocked():
        try:
            shardgather.foreach_all_gather([torch.ones(2)], group[0], timeout=30)
        except shardgather.ShardgatherError as e:
            caught.append(e)

    t = threading.Thread(target=blocked)
    start = time.monotonic()
    t.start()
    time.sleep(0.2)
    group[1].abort()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - start < 3
    assert isinstance(caught[0], shardgather.CommunicationError)


def test_threads_gil_released():
    ticks = [0]

    def fn(r, c):
        if r == 1:
            time.sleep(0.5)
        else:
            ticker = threading.Thread(target=lambda: [ticks.__setitem__(0, ticks[0] + 1) or time.sleep(0.001) for _ in range(300)])
            ticker.start()
        shardgather.foreach_all_gather([torch.ones(2)], c, timeout=10)
        return ticks[0]

    results, errors = run_ranks(2, fn)
    assert errors == [None, None]
    assert results[0] > 100, results


def test_group_none_without_init_is_value_error():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        shardgather.foreach_all_gather([torch.ones(1)])


def test_exception_hierarchy():
    assert issubclass(shardgather.InvalidArgumentError, ValueError)
    assert issubclass(shardgather.CountOverflowError, shardgather.InvalidArgumentError)
    assert issubclass(shardgather.MismatchError, RuntimeError)
    assert issubclass(shardgather.CollectiveTimeout, TimeoutError)
    for cls in (shardgather.InvalidArgumentError, shardgather.MismatchError,
                shardgather.CollectiveTimeout, shardgather.CommAbortedError):
        assert issubclass(cls, shardgather.ShardgatherError)
    assert issubclass(shardgather.ShardgatherError, RuntimeError)


MPI_SCRIPT = r"""
import sys, torch
from mpi4py import MPI
import shardgather
sys.path.insert(0, sys.argv[1])
from test_threads_mpi import params_of
from gloo_cases import raw
comm = shardgather.mpi_communicator(MPI.COMM_WORLD)
rank, world = comm.rank, comm.size
out = shardgather.foreach_all_gather(params_of(rank), comm, timeout=30)
for i, per_rank in enumerate(out):
    for r, t in enumerate(per_rank):
        e = params_of(r)[i].contiguous()
        assert t.dtype == e.dtype and t.shape == e.shape and torch.equal(raw(t), raw(e)), (i, r)
try:
    shardgather.foreach_all_gather([torch.ones(2)] * (rank + 1), comm, timeout=30)
    raise SystemExit("expected MismatchError")
except shardgather.MismatchError:
    pass
print("MPI-OK", rank)
"""


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3])
def test_mpi_backend_from_python(np_):
    run_mpi_script(MPI_SCRIPT, np_, timeout=120)
