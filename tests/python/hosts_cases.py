"""Cases for a Gloo group spanning simulated hosts (across_hosts.py runs them, then every case of
gloo_cases.py, which this module re-exports). SHARDGATHER_TEST_RANKS_PER_HOST is K, ranks
0..K-1 on the first host, and so on."""

import os

import torch

import plan_cases
import shardgather
from gloo_cases import *  # noqa: F401,F403  (the Gloo suite runs from this module too)
from gloo_cases import CASES as GLOO_CASES, T, make, reference, assert_same


def case_hosts_seen(rank, world):
    """Each rank counts only its host's ranks and knows every rank's host; nothing node-shared
    spans hosts: no host mailbox, and a plan asked for the node-shared window ("shared") runs
    "direct". "auto" (past the window's threshold, measuring it against "direct" on its first
    executions) and "hierarchical" run "hierarchical": one
    window per host, the streams between hosts over Gloo point to point. All bit-exact, step
    after step, with uneven, empty and small tensors mixed in."""
    k = int(os.environ["SHARDGATHER_TEST_RANKS_PER_HOST"])
    comm = shardgather.communicator()
    assert comm.ranks_on_host == k, (comm.ranks_on_host, k)
    assert comm.hosts == [r // k for r in range(world)], comm.hosts
    assert not comm.uses_host_mailbox
    # ~1.2 MB of f32 per rank (past the 1 MiB threshold), uneven; rank 1 has no int64 rows.
    shapes = [[(300_000 + 1000 * r,), (0 if r == 1 else 3, 2), ()] for r in range(world)]
    dtypes = [torch.float32, torch.int64, torch.bfloat16]
    runs_by_request = {"auto": "hierarchical", "shared": "direct", "hierarchical": "hierarchical"}
    for strategy, runs in runs_by_request.items():
        for step in range(3):
            params = [make(s, dt, 100 * step + 10 * rank + i)
                      for i, (s, dt) in enumerate(zip(shapes[rank], dtypes))]
            if step == 0:
                plan = shardgather.AllGatherPlan.create(params, None, shapes, strategy=strategy,
                                                        timeout=T)
            ref, _ = reference(params, world)
            out = plan.execute(params)
            want = plan_cases.auto_trial(step, runs) if strategy == "auto" else runs
            assert plan.last_stats["strategy"] == want, (strategy, step, plan.last_stats)
            assert_same(out, ref, world)


def case_unshard_hierarchical(rank, world):
    """An UnshardPlan over every dim kind (0, 1, last; uneven, padded, empty) with
    "hierarchical" across hosts: it runs, and every full tensor is bit-exact, step after step."""
    specs = plan_cases._param_specs(world)
    plan = shardgather.UnshardPlan(specs, world, rank, strategy="hierarchical", timeout=T)
    for step in range(2):
        shards = [plan_cases._local_shard(s, rank, world, i, step) for i, s in enumerate(specs)]
        fulls = plan.execute(shards)
        assert plan.last_stats["strategy"] == "hierarchical", plan.last_stats
        for i, s in enumerate(specs):
            plan_cases.same(fulls[i], plan_cases._expected_full(s, world, i, step),
                            "param %d step %d" % (i, step))


CASES = ["case_hosts_seen", "case_unshard_hierarchical"] + GLOO_CASES
