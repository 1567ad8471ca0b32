"""foreach_all_gather on torch.distributed Gloo groups of 1 to 4 spawned processes."""

import pytest

import gloo_cases
from conftest import CaseResults

_results = CaseResults("gloo_cases", gloo_cases.CASES)
_timeouts = CaseResults("gloo_cases", ["timeout_case_stalled_peer"])
_aborts = CaseResults("gloo_cases", ["timeout_case_abort_wakes_a_waiting_rank"])
_exits = CaseResults("gloo_cases", ["exit_case_peer_exits"])
_releases = CaseResults("gloo_cases", ["release_case_group_destroyed_then_dropped"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", gloo_cases.CASES)
def test_gloo(world, case):
    _results.check(world, case)


def test_gloo_timeout():
    _timeouts.check(2, "timeout_case_stalled_peer")


def test_gloo_abort():
    _aborts.check(2, "timeout_case_abort_wakes_a_waiting_rank")


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_peer_exit(world):
    _exits.check(world, "exit_case_peer_exits")


def test_gloo_group_destroyed_then_dropped():
    _releases.check(2, "release_case_group_destroyed_then_dropped")
