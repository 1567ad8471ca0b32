"""AllGatherPlan, UnshardPlan and unshard on Gloo groups of 1 to 4 spawned processes and on the
threads backend."""

import threading

import pytest
import torch

import plan_cases
import shardgather
from conftest import CaseResults, run_ranks

_results = CaseResults("plan_cases", plan_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", plan_cases.CASES)
def test_plans_gloo(world, case):
    _results.check(world, case)


def _on_threads(world, fn):
    _, errors = run_ranks(world, fn)
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError("rank %d: %r" % (r, e)) from e


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plans_threads(world):
    def fn(r, comm):
        specs = plan_cases._param_specs(world)
        shards = [plan_cases._local_shard(s, r, world, i) for i, s in enumerate(specs)]
        plan = shardgather.UnshardPlan(specs, world, r, timeout=10)
        for _ in range(3):
            full = plan.execute(shards, comm)
            for i, s in enumerate(specs):
                plan_cases.same(full[i], plan_cases._expected_full(s, world, i), "param %d" % i)
        full = shardgather.unshard(shards, specs, comm, timeout=10)
        for i, s in enumerate(specs):
            plan_cases.same(full[i], plan_cases._expected_full(s, world, i), "one-shot %d" % i)
        params = plan_cases._gather_params(r)
        gplan = shardgather.AllGatherPlan.create(params, comm, timeout=10)
        for _ in range(3):
            plan_cases._check_gather(gplan.execute(params, comm), world, 0)
        bad = [torch.zeros(5, 3)] if r == world - 1 else shards[:1]
        with pytest.raises(shardgather.InvalidArgumentError, match="rank %d" % (world - 1)):
            shardgather.unshard(bad, specs[:1], comm, timeout=10)

    _on_threads(world, fn)


def test_plan_one_thread_at_a_time():
    """A second thread entering execute() on a busy plan gets an error, not a data race."""
    group = shardgather.ThreadGroup(2)
    params = [torch.ones(4)]
    plans = [shardgather.AllGatherPlan([torch.float32], [[(4,)], [(4,)]], r, timeout=5)
             for r in range(2)]
    started = threading.Event()

    def blocked():
        started.set()
        plans[0].execute(params, group[0])  # waits for rank 1, which comes late

    t = threading.Thread(target=blocked)
    t.start()
    started.wait()
    import time

    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="another thread"):
        plans[0].execute(params, group[0])
    plans[1].execute(params, group[1])
    t.join(10)
    assert not t.is_alive()
