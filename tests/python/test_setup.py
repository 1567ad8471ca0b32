"""The first call on a torch group: timeout, GIL, locks, environment (see setup_cases)."""

import pytest

import setup_cases
from conftest import CaseResults

_results = CaseResults("setup_cases", setup_cases.CASES)
_timeouts = CaseResults("setup_cases", ["timeout_case_first_call_honours_timeout"])
_late = CaseResults("setup_cases", ["timeout_case_late_rank_zero_bytes"])
_ctrl_c = CaseResults("setup_cases", ["timeout_case_ctrl_c_in_gloo_waits"])
_ctrl_c_setup = CaseResults("setup_cases", ["timeout_case_ctrl_c_during_setup"])
_ctrl_c_sync = CaseResults("setup_cases", ["timeout_case_ctrl_c_in_weight_sync"])
_ctrl_c_payload = CaseResults("setup_cases", ["timeout_case_ctrl_c_in_gloo_payload_gather",
                                              "timeout_case_ctrl_c_in_gloo_payload_scatter",
                                              "timeout_case_ctrl_c_then_late_peer"])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", setup_cases.CASES)
def test_setup_gloo(world, case):
    _results.check(world, case)


@pytest.mark.parametrize("world", [2, 3])
def test_first_call_honours_timeout(world):
    _timeouts.check(world, "timeout_case_first_call_honours_timeout")


@pytest.mark.parametrize("world", [2, 3])
def test_late_rank_zero_bytes(world):
    _late.check(world, "timeout_case_late_rank_zero_bytes")


def test_ctrl_c_in_gloo_waits():
    _ctrl_c.check(2, "timeout_case_ctrl_c_in_gloo_waits")


def test_ctrl_c_in_weight_sync():
    _ctrl_c_sync.check(2, "timeout_case_ctrl_c_in_weight_sync")


def test_ctrl_c_during_setup():
    _ctrl_c_setup.check(2, "timeout_case_ctrl_c_during_setup")


@pytest.mark.parametrize("case", ["timeout_case_ctrl_c_in_gloo_payload_gather",
                                  "timeout_case_ctrl_c_in_gloo_payload_scatter",
                                  "timeout_case_ctrl_c_then_late_peer"])
def test_ctrl_c_in_gloo_payload(case):
    _ctrl_c_payload.check(2, case)
