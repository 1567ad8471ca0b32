"""The generated disagreement family D on Gloo groups (the same table as the C++ suites'
tests/reliability/rel_cases.cc kDRows): every rank but the last makes the reference call, the
last rank the same call with one thing changed; every rank must raise the same class naming
the disagreement, from the pre-flight header alone (one collective), well within the
deadline, and the group stays usable. Run by conftest.run_cases."""

import time

import torch

import shardgather
from gloo_cases import T

FOREACH = dict(op="foreach")
EXECUTE = dict(op="execute")

# (id, expected class, needle, min world, reference call, the last rank's call)
ROWS = [
    ("op_foreach_nohint", "MismatchError", "shapes hint", 2, FOREACH, dict(op="foreach", hint=False)),
    ("op_create", "MismatchError", "operation differs", 2, FOREACH, dict(op="create")),
    ("op_create_nohint", "MismatchError", "operation differs", 2, FOREACH,
     dict(op="create", hint=False)),
    ("op_execute", "MismatchError", "operation differs", 2, FOREACH, EXECUTE),
    ("op_unshard", "MismatchError", "operation differs", 2, FOREACH, dict(op="unshard")),
    ("op_unshard_execute", "MismatchError", "operation differs", 2, EXECUTE,
     dict(op="unshard_execute")),
    ("strategy_packed", "MismatchError", "strategy differs", 2, EXECUTE,
     dict(op="execute", strategy="packed")),
    ("strategy_per_tensor", "MismatchError", "strategy differs", 2, EXECUTE,
     dict(op="execute", strategy="per_tensor")),
    ("strategy_shared", "MismatchError", "strategy differs", 2, EXECUTE,
     dict(op="execute", strategy="shared")),
    ("strategy_foreach", "MismatchError", "strategy differs", 2, FOREACH,
     dict(op="foreach", strategy="packed")),
    ("strategy_foreach_nohint", "MismatchError", "strategy differs", 2,
     dict(op="foreach", hint=False), dict(op="foreach", hint=False, strategy="packed")),
    ("strategy_create", "MismatchError", "strategy differs", 2, dict(op="create"),
     dict(op="create", strategy="packed")),
    ("count_foreach", "MismatchError", "tensor count", 2, FOREACH, dict(op="foreach", extra=1)),
    ("count_nohint", "MismatchError", "tensor count", 2, dict(op="foreach", hint=False),
     dict(op="foreach", hint=False, extra=1)),
    ("count_execute", "MismatchError", "tensor count", 2, EXECUTE, dict(op="execute", extra=1)),
    ("dtype_0", "MismatchError", "dtype of tensor 0", 2, FOREACH,
     dict(op="foreach", dtype0=torch.float64)),
    ("dtype_130", "MismatchError", "index >= 128", 2, dict(op="foreach", many=True),
     dict(op="foreach", many=True, dtype130=torch.int32)),
    ("dtype_execute", "MismatchError", "dtype of tensor 0", 2, EXECUTE,
     dict(op="execute", dtype0=torch.float64)),
    ("hint_row", "MismatchError", "shapes hint / plan differs", 2, FOREACH,
     dict(op="foreach", shift=1)),
    ("plan_shapes", "MismatchError", "shapes hint / plan differs", 2, EXECUTE,
     dict(op="execute", shift=1)),
    ("plan_world", "InvalidArgumentError", "the plan was built for", 2, EXECUTE,
     dict(op="execute", world_delta=1)),
    ("timeout", "InvalidArgumentError", "timeout must be", 2, FOREACH,
     dict(op="foreach", timeout=-1.0)),
    ("unshard_sizes", "MismatchError", "shapes hint / plan differs", 3,
     dict(op="unshard_execute"), dict(op="unshard_execute", swap=True)),
]


def _dtypes(c):
    n = (131 if c.get("many") else 3) + c.get("extra", 0)
    d = [torch.float32] * n
    d[0], d[1], d[2] = c.get("dtype0", torch.float32), torch.bfloat16, torch.int64
    if c.get("many"):
        d[130] = c.get("dtype130", torch.float32)
    return d


def _shape(c, r, i):
    if i == 0:
        return (r + 1 + (c.get("shift", 0) if r == 0 else 0), 4)
    return {1: (6,), 2: (2, r)}.get(i, (i % 3,))


def _rows(c, world):
    return [[_shape(c, r, i) for i in range(len(_dtypes(c)))] for r in range(world)]


def _specs(c, world):
    rows, specs = _rows(c, world), []
    for i, dt in enumerate(_dtypes(c)):
        dim = 1 if i == 2 else 0
        sizes = [row[i][dim] for row in rows]
        if c.get("swap"):
            sizes[0], sizes[1] = sizes[1], sizes[0]
        full = list(rows[0][i])
        full[dim] = sum(sizes)
        specs.append(shardgather.ShardSpec(dt, tuple(full), dim, sizes=sizes))
    return specs


def _call(c, rank, world, params):
    timeout = c.get("timeout", T)
    rows = _rows(c, world + c.get("world_delta", 0))
    hint = rows if c.get("hint", True) else None
    strategy = c.get("strategy", "direct")
    op = c["op"]
    if op == "foreach":
        return shardgather.foreach_all_gather(params, None, hint, timeout=timeout,
                                              strategy=strategy)
    if op == "create":
        return shardgather.AllGatherPlan.create(params, None, hint, strategy=strategy,
                                                timeout=timeout)
    if op == "execute":
        plan = shardgather.AllGatherPlan(_dtypes(c), rows, rank, strategy=strategy,
                                         timeout=timeout)
        return plan.execute(params)
    if op == "unshard":
        return shardgather.unshard(params, _specs(c, world), strategy=strategy, timeout=timeout)
    plan = shardgather.UnshardPlan(_specs(c, world), world, rank, strategy=strategy,
                                   timeout=timeout)
    return plan.execute(params)


def case_every_disagreement_fails_alike(rank, world):
    comm = shardgather.communicator()
    odd = rank == world - 1
    ran = 0
    for cid, cls, needle, min_world, ref, other in ROWS:
        if world < max(min_world, 2):
            continue
        c = other if odd else ref
        params = [torch.ones(_shape(c, rank, i), dtype=dt) for i, dt in enumerate(_dtypes(c))]
        before, start = comm.collectives_issued, time.monotonic()
        try:
            _call(c, rank, world, params)
        except shardgather.ShardgatherError as e:
            assert type(e).__name__ == cls, (cid, type(e).__name__, str(e))
            assert needle in str(e), (cid, str(e))
        else:
            raise AssertionError("%s: rank %d returned success" % (cid, rank))
        assert comm.collectives_issued - before == 1, (cid, comm.collectives_issued - before)
        assert time.monotonic() - start < T / 3, (cid, time.monotonic() - start)
        # The group stays usable: a valid call right after succeeds on every rank.
        out = shardgather.foreach_all_gather([torch.full((2,), float(rank))], timeout=T)
        assert all(torch.equal(out[0][r], torch.full((2,), float(r))) for r in range(world))
        ran += 1
    assert world == 1 or ran >= len(ROWS) - 1, ran


CASES = ["case_every_disagreement_fails_alike"]
