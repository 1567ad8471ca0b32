"""async_op=True on Gloo groups (run on every rank by conftest.run_cases): a started call
returns a Work at once, the caller computes while it moves, and wait() returns what the
blocking call returns, or raises its error, on every rank."""

import time

import torch

import shardgather
from gloo_cases import T, assert_same, make, reference


def _params(rank):
    return [
        make((rank + 2, 3), torch.float32, 10 + rank),
        make((rank,), torch.bfloat16, 20 + rank),
        make((4, rank + 1), torch.int64, 30 + rank),
    ]


def _compute():
    a = torch.randn(256, 256)
    for _ in range(4):
        a = torch.tanh(a @ a) * 0.5
    return a


def case_started_calls_match_blocking(rank, world):
    params = _params(rank)
    ref, hint = reference(params, world)
    no_hint = shardgather.foreach_all_gather(params, async_op=True, timeout=T)
    with_hint = shardgather.foreach_all_gather(params, None, hint, async_op=True, timeout=T)
    assert isinstance(no_hint, shardgather.Work)
    _compute()  # the caller's own work while both move
    assert_same(no_hint.wait(), ref, world)
    assert_same(with_hint.wait(), ref, world)
    assert no_hint.is_completed()
    assert_same(no_hint.wait(), ref, world)  # a second wait returns the same result

    plan = shardgather.AllGatherPlan.create(params, None, hint, timeout=T)
    for _ in range(3):
        work = plan.execute(params, async_op=True)
        _compute()
        assert_same(work.wait(), ref, world)
    assert plan.last_stats["payload_collectives"] == (1 if world > 1 else 0)

    specs = [shardgather.ShardSpec(torch.float32, (5, 2 * world), 1)]
    shards = [torch.arange(10, dtype=torch.float32).reshape(5, 2) + 100 * rank]
    full = shardgather.unshard(shards, specs, timeout=T)
    assert torch.equal(shardgather.unshard(shards, specs, async_op=True, timeout=T).wait()[0],
                       full[0])
    uplan = shardgather.UnshardPlan(specs, world, rank, timeout=T)
    assert torch.equal(uplan.execute(shards, async_op=True).wait()[0], full[0])
    out = [torch.empty(5, 2 * world)]
    got = uplan.execute(shards, outputs=out, async_op=True).wait()
    assert got[0] is out[0] and torch.equal(out[0], full[0])


def case_started_calls_complete_in_order(rank, world):
    params = _params(rank)
    ref, hint = reference(params, world)
    plan = shardgather.AllGatherPlan.create(params, None, hint, timeout=T)
    outs = [torch.empty(plan.output_bytes, dtype=torch.uint8) for _ in range(4)]
    works = [plan.execute(params, out=o, async_op=True) for o in outs]
    last = shardgather.foreach_all_gather(params, async_op=True, timeout=T)
    assert_same(last.wait(), ref, world)
    # The last one started completed, so every one started before it did too.
    assert all(w.is_completed() for w in works)
    for w in works:
        assert_same(w.wait(), ref, world)


def case_error_raised_on_every_ranks_wait(rank, world):
    if world == 1:
        return
    bad = world - 1
    params = _params(rank)
    ref, hint = reference(params, world)
    mine = list(params)
    if rank == bad:
        mine[2] = make((4, rank + 7), torch.int64, 0)  # not this rank's row of the hint
    start = time.monotonic()
    work = shardgather.foreach_all_gather(mine, None, hint, async_op=True, timeout=T)
    try:
        work.wait()
    except shardgather.InvalidArgumentError as e:
        assert ("failed on rank %d" % bad) in str(e) and "tensor 2" in str(e), str(e)
    else:
        raise AssertionError("a wrong shape must raise from every rank's wait()")
    assert time.monotonic() - start < T / 3
    # A binding-side error (a non-tensor) raises at the call on that rank, and from the peers'
    # wait(): the same class and message everywhere.
    try:
        if rank == bad:
            shardgather.foreach_all_gather(params[:1] + ["x"], async_op=True, timeout=T)
            raise AssertionError("a non-tensor must raise at the call")
        shardgather.foreach_all_gather(params[:2], async_op=True, timeout=T).wait()
    except shardgather.InvalidTypeError as e:
        assert ("rank %d" % bad) in str(e) and "params[1]" in str(e), str(e)
    else:
        raise AssertionError("a non-tensor must raise on every rank")
    # The group stays usable.
    assert_same(shardgather.foreach_all_gather(params, async_op=True, timeout=T).wait(), ref, world)


CASES = [
    "case_started_calls_match_blocking",
    "case_started_calls_complete_in_order",
    "case_error_raised_on_every_ranks_wait",
]
