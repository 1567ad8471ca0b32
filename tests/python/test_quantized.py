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


def test_a_plans_own_entries_follow_the_device_of_its_tensors():
    """follow_device (the quantized plans' entries): remade alike, shape, dtype and nesting, on
    the device of the first tensor given (the meta device here: CPU hosts have no CUDA); left
    as they are where they are there already or no tensor names a device."""
    import torch
    from shardgather.quantized import follow_device

    entries = [[torch.zeros(3, 4), (torch.zeros(2, dtype=torch.uint8), torch.ones(1))],
               [torch.zeros(5, dtype=torch.bfloat16)]]
    assert follow_device(entries, [torch.zeros(1)], None, None) is entries
    assert follow_device(entries, [], None, None) is entries
    moved = follow_device(entries, [None, torch.zeros(1, device="meta")], None, None)

    def flat(x):
        return [y for z in x for y in (flat(z) if isinstance(z, (list, tuple)) else [z])]

    assert [type(x) for x in moved] == [list, list] and isinstance(moved[0][1], tuple)
    assert [(t.shape, t.dtype, t.device.type) for t in flat(moved)] == [
        (t.shape, t.dtype, "meta") for t in flat(entries)]
