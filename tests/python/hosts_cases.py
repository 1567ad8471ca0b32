"""Cases for a Gloo group spanning simulated hosts (across_hosts.py runs them, then every case of
gloo_cases.py, which this module re-exports). SHARDGATHER_TEST_RANKS_PER_HOST is K, ranks
0..K-1 on the first host, and so on."""

import os

import torch

import shardgather
from gloo_cases import *  # noqa: F401,F403  (the Gloo suite runs from this module too)
from gloo_cases import CASES as GLOO_CASES, T, make, reference, assert_same


def case_hosts_seen(rank, world):
    """Each rank counts only its host's ranks and knows every rank's host; nothing node-shared
    spans hosts: no host mailbox, and a plan asked for the node-shared window ("shared") or
    for "hierarchical" (which torch groups do not offer yet: no all_to_all_scatter) runs
    "direct", bit-exact, step after step."""
    k = int(os.environ["SHARDGATHER_TEST_RANKS_PER_HOST"])
    comm = shardgather.communicator()
    assert comm.ranks_on_host == k, (comm.ranks_on_host, k)
    assert comm.hosts == [r // k for r in range(world)], comm.hosts
    assert not comm.uses_host_mailbox
    shapes = [[(300_000 + 1000 * r,), (3, 2)] for r in range(world)]  # past the window's threshold
    for strategy in ("auto", "shared", "hierarchical"):
        params = [make(shapes[rank][0], torch.float32, rank), make(shapes[rank][1], torch.int64, rank)]
        plan = shardgather.AllGatherPlan.create(params, None, shapes, strategy=strategy, timeout=T)
        ref, _ = reference(params, world)
        for _step in range(2):
            out = plan.execute(params)
            assert plan.last_stats["strategy"] == "direct", (strategy, plan.last_stats)
            assert_same(out, ref, world)


CASES = ["case_hosts_seen"] + GLOO_CASES
