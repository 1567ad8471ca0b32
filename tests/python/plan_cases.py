"""Plan and unshard cases run on every rank of a spawned Gloo group (see conftest.run_cases).

Every rank can build every rank's data (seeded by rank, tensor and step), so the expected full
tensors are torch.cat of the per-rank chunks along the shard dim, and the expected gather is
each rank's own tensors: both compared bit for bit."""

import torch
import torch.distributed as dist

import shardgather
from gloo_cases import DTYPES, make, raw

T = 30.0


def same(a, b, where):
    assert a.dtype == b.dtype, (where, a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (where, tuple(a.shape), tuple(b.shape))
    assert torch.equal(raw(a.contiguous()), raw(b.contiguous())), where


# ---- unshard -------------------------------------------------------------------------------


def _param_specs(world):
    """(spec, shard builder) per parameter: every dim kind, uneven, padded, empty."""
    uneven = [3, 0, 5, 1][:world]
    out = []
    # torch.chunk-style along dims 0, 1 and the last (negative), mixed dtypes
    out.append(shardgather.ShardSpec(torch.float32, (7, 5, 3), 0))
    out.append(shardgather.ShardSpec(torch.bfloat16, (4, 9, 2), 1))
    out.append(shardgather.ShardSpec(torch.int16, (3, 2, 10), -1))
    out.append(shardgather.ShardSpec(torch.bool, (6, 5), -1))
    # explicit uneven sizes (one rank empty from world 2 on), along dims 0 and 1
    out.append(shardgather.ShardSpec(torch.float64, (sum(uneven), 4), 0, sizes=uneven))
    out.append(shardgather.ShardSpec(torch.int8, (2, sum(uneven), 3), 1, sizes=uneven))
    # padded (FSDP-style: every local shard has the same rows), along dims 0 and 1
    out.append(shardgather.ShardSpec(torch.float16, (5, 3), 0, padded_size=-(-5 // world) + 1))
    out.append(
        shardgather.ShardSpec(torch.int64, (2, 9), 1, sizes=[9] + [0] * (world - 1), padded_size=9)
    )
    # empty parameters: nothing along the shard dim, and a zero elsewhere
    out.append(shardgather.ShardSpec(torch.float32, (0, 4), 0))
    out.append(shardgather.ShardSpec(torch.float32, (4, 0), 0))
    # a single row over many ranks: most shards empty
    out.append(shardgather.ShardSpec(torch.uint8, (1, 8), 0))
    return out


def _sizes(spec, world):
    return list(spec.sizes) if spec.sizes else shardgather.chunk_sizes(
        spec.full_shape[spec.shard_dim], world
    )


def _real_shard(spec, r, world, i, step=0):
    dim = spec.shard_dim % len(spec.full_shape)
    shape = list(spec.full_shape)
    shape[dim] = _sizes(spec, world)[r]
    return make(tuple(shape), spec.dtype, 1000 * step + 100 * r + i)


def _local_shard(spec, r, world, i, step=0):
    """The real shard, padded with junk rows along the shard dim when the spec is padded."""
    real = _real_shard(spec, r, world, i, step)
    if not spec.padded_size:
        return real
    dim = spec.shard_dim % len(spec.full_shape)
    shape = list(spec.full_shape)
    shape[dim] = spec.padded_size - real.shape[dim]
    junk = torch.full(shape, 77, dtype=spec.dtype) if spec.dtype != torch.bool else torch.ones(
        shape, dtype=torch.bool
    )
    return torch.cat([real, junk], dim)


def _expected_full(spec, world, i, step=0):
    dim = spec.shard_dim % len(spec.full_shape)
    return torch.cat([_real_shard(spec, r, world, i, step) for r in range(world)], dim)


def case_unshard_one_shot(rank, world):
    specs = _param_specs(world)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    full = shardgather.unshard(shards, specs, timeout=T)
    assert type(full) is list and len(full) == len(specs)
    for i, s in enumerate(specs):
        same(full[i], _expected_full(s, world, i), "param %d" % i)
        assert tuple(full[i].shape) == tuple(s.full_shape)
    assert shardgather.unshard([], [], timeout=T) == []


def case_unshard_one_shot_to_dst(rank, world):
    """dst on the one-shot unshard: rank dst gets the full parameters, the others an empty list."""
    specs = _param_specs(world)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    for dst in range(world):
        full = shardgather.unshard(shards, specs, dst=dst, timeout=T)
        if rank != dst:
            assert full == [], (dst, full)
            continue
        for i, s in enumerate(specs):
            same(full[i], _expected_full(s, world, i), "dst %d param %d" % (dst, i))
    try:
        shardgather.unshard(shards, specs, dst=world if rank == 0 else 0, timeout=T)
    except shardgather.InvalidArgumentError as e:
        assert "rank 0" in str(e) and "dst" in str(e), e
    else:
        raise AssertionError("a dst outside the group on rank 0 must fail on every rank")


def case_shapes_hint_named_alike(rank, world):
    """The hint under its C++ / AllGatherPlan name, under the seed's name, and both (refused)."""
    params = _gather_params(rank)
    hint = [[tuple(t.shape) for t in _gather_params(r)] for r in range(world)]
    _check_gather(shardgather.foreach_all_gather(params, shapes_across_group=hint, timeout=T),
                  world, 0)
    _check_gather(shardgather.foreach_all_gather(params, None, hint, timeout=T), world, 0)
    plan = shardgather.AllGatherPlan.create(params, shapes_across_group=hint, timeout=T)
    _check_gather(plan.execute(params), world, 0)
    for call in (lambda: shardgather.foreach_all_gather(params, None, hint,
                                                        shapes_across_group=hint, timeout=T),
                 lambda: shardgather.AllGatherPlan.create(params, None, hint,
                                                          shapes_across_group=hint, timeout=T)):
        try:
            call()
        except shardgather.InvalidArgumentError as e:
            assert "given twice" in str(e), e
        else:
            raise AssertionError("a hint given twice must fail")
    _check_gather(shardgather.foreach_all_gather(params, timeout=T), world, 0)  # still usable


def case_every_plan_from_a_group(rank, world):
    """One API shape: every plan is built from a group by for_group (the same plan as the pure
    constructor with the group's size and rank; AllGatherPlan's also with quantize, with and
    without the hint), and an unshard plan's output keyword is ``out`` (``outputs`` still
    works; both at once fails on every rank, and the group works after)."""
    specs = _param_specs(world)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    for dst in (None, world - 1):
        full = shardgather.UnshardPlan.for_group(specs, timeout=T, dst=dst).execute(shards)
        if dst not in (None, rank):
            assert full == [], full
            continue
        for i, s in enumerate(specs):
            same(full[i], _expected_full(s, world, i), "dst %s param %d" % (dst, i))
    plan = shardgather.UnshardPlan.for_group(specs, timeout=T)
    for keyword in ("out", "outputs"):
        outputs = [torch.empty(s.full_shape, dtype=s.dtype) for s in specs]
        got = plan.execute(shards, **{keyword: outputs})
        assert all(a is b for a, b in zip(got, outputs)), keyword
        for i, s in enumerate(specs):
            same(outputs[i], _expected_full(s, world, i), "%s param %d" % (keyword, i))
    outputs = [torch.empty(s.full_shape, dtype=s.dtype) for s in specs]
    try:
        plan.execute(shards, out=outputs, outputs=outputs if rank == world - 1 else None)
    except shardgather.InvalidArgumentError as e:
        assert "given twice" in str(e), e
    else:
        raise AssertionError("out and outputs at once on the last rank must fail everywhere")
    for i, s in enumerate(specs):  # usable after, and the refused call wrote nothing
        same(plan.execute(shards)[i], _expected_full(s, world, i), "after param %d" % i)

    hint = [_gather_shapes(r) for r in range(world)]
    params = _gather_params(rank)
    for plan in (shardgather.AllGatherPlan.for_group(params, timeout=T),
                 shardgather.AllGatherPlan.for_group(params, shapes_across_group=hint,
                                                     timeout=T)):
        assert plan.world_size == world and plan.rank == rank
        _check_gather(plan.execute(params), world, 0)
    rows = [[(2 + r, 64)] for r in range(world)]
    mine = [make(rows[rank][0], torch.bfloat16, 7 + rank)]
    want = shardgather.AllGatherPlan([torch.bfloat16], rows, rank, timeout=T,
                                     quantize="mxfp8").execute(mine)
    for hinted in (None, rows):
        got = shardgather.AllGatherPlan.for_group(mine, shapes_across_group=hinted, timeout=T,
                                                  quantize="mxfp8").execute(mine)
        for r in range(world):
            for a, b in zip(got[0][r], want[0][r]):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (hinted, r)


def case_unshard_plan_steady_state(rank, world):
    """Many executions: bit-exact each time, the plan's buffer and full tensors never change."""
    specs = _param_specs(world)
    plan = shardgather.UnshardPlan(specs, world, rank, timeout=T)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    first = plan.execute(shards)
    ptr = plan.buffer.data_ptr()
    for step in range(1, 12):
        fresh = [_local_shard(s, rank, world, i, step) for i, s in enumerate(specs)]
        for dst, src in zip(shards, fresh):
            dst.copy_(src)  # same input tensors, new values: as a training step would
        full = plan.execute(shards)
        assert plan.buffer.data_ptr() == ptr, "the plan's buffer must be reused"
        for i, s in enumerate(specs):
            assert full[i] is first[i], "the full tensors must be the cached views"
            same(full[i], _expected_full(s, world, i, step), "step %d param %d" % (step, i))
    stats = plan.last_stats
    assert "metadata_collectives" not in stats, stats  # an execution never exchanges metadata
    assert stats["payload_collectives"] >= (1 if world > 1 else 0), stats


def case_unshard_into_outputs(rank, world):
    specs = _param_specs(world)
    for strategy in ("auto", "packed", "per_tensor"):
        plan = shardgather.UnshardPlan(specs, world, rank, strategy=strategy, timeout=T)
        outputs = [torch.empty(s.full_shape, dtype=s.dtype) for s in specs]
        shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
        got = plan.execute(shards, None, outputs)
        assert all(a is b for a, b in zip(got, outputs))
        for i, s in enumerate(specs):
            same(outputs[i], _expected_full(s, world, i), "%s param %d" % (strategy, i))


def case_unshard_non_contiguous_shard(rank, world):
    spec = shardgather.ShardSpec(torch.float32, (6, 4 * world), 1)
    real = _real_shard(spec, rank, world, 0)
    shard = real.t().contiguous().t()  # same values, column-major strides
    assert not shard.is_contiguous()
    (full,) = shardgather.unshard([shard], [spec], timeout=T)
    same(full, _expected_full(spec, world, 0), "strided shard")


def case_unshard_wrong_shard_shape(rank, world):
    """A wrong shard shape on the last rank raises on every rank; the group stays usable."""
    specs = [shardgather.ShardSpec(torch.float32, (4 * world, 3), 0)]
    plan = shardgather.UnshardPlan(specs, world, rank, timeout=T)
    good = [_real_shard(specs[0], rank, world, 0)]
    bad = [torch.zeros(5, 3)] if rank == world - 1 else good
    for call in (lambda s: plan.execute(s), lambda s: shardgather.unshard(s, specs, timeout=T)):
        try:
            call(bad)
        except shardgather.InvalidArgumentError as e:
            assert isinstance(e, ValueError)
            assert ("rank %d" % (world - 1)) in str(e) and "tensor 0" in str(e), str(e)
        else:
            raise AssertionError("a wrong shard shape must raise on every rank")
    (full,) = plan.execute(good)
    same(full, _expected_full(specs[0], world, 0), "after the error")


def case_unshard_bad_arguments(rank, world):
    # The pure constructor exchanges nothing: its argument error is raised by the first execute,
    # on every rank (through the header), and by the plan's accessors on this rank.
    shards = [torch.ones(1, 4)]
    for bad in (
        lambda: shardgather.UnshardPlan([shardgather.ShardSpec(torch.float32, (4, 4), 2)], world,
                                        rank, timeout=T),
        lambda: shardgather.UnshardPlan(
            [shardgather.ShardSpec(torch.float32, (4, 4), 0, sizes=[1] * (world + 1))], world,
            rank, timeout=T),
        lambda: shardgather.UnshardPlan([], world, rank, strategy="fastest", timeout=T),
    ):
        plan = bad()
        for call in (lambda: plan.execute(shards), lambda: plan.specs):
            try:
                call()
            except shardgather.InvalidArgumentError as e:
                assert isinstance(e, ValueError), e
            else:
                raise AssertionError("expected InvalidArgumentError")
    try:
        shardgather.ShardSpec(torch.complex64, (4,), 0)
    except ValueError:
        pass
    else:
        raise AssertionError("an unsupported dtype must raise ValueError")
    try:
        shardgather.ShardSpec("float32", (4,), 0)
    except TypeError:
        pass
    else:
        raise AssertionError("a dtype that is not a torch.dtype must raise TypeError")
    # A non-tensor shard on one rank: InvalidTypeError (a TypeError) on every rank, naming it.
    specs = [shardgather.ShardSpec(torch.float32, (2 * world,), 0)]
    plan = shardgather.UnshardPlan(specs, world, rank, timeout=T)
    shards = ["oops"] if rank == 0 else [torch.ones(2)]
    try:
        plan.execute(shards)
    except shardgather.InvalidTypeError as e:
        assert isinstance(e, TypeError) and "shards[0]" in str(e) and "rank 0" in str(e), str(e)
    else:
        raise AssertionError("a non-tensor shard must raise on every rank")
    assert plan.execute([torch.ones(2)])[0].sum() == 2 * world


# ---- AllGatherPlan -------------------------------------------------------------------------


def _gather_shapes(r):
    rows = [2, 3, 1, 0][r % 4]
    return [(rows, 5)] * len(DTYPES) + [(), (7,), (r, 0)]


def _gather_params(r, step=0):
    shapes = _gather_shapes(r)
    dtypes = DTYPES + [torch.float32, torch.float64, torch.int32]
    return [make(s, dt, 10000 * step + 100 * r + k) for k, (s, dt) in enumerate(zip(shapes, dtypes))]


def _check_gather(out, world, step):
    expected = [_gather_params(r, step) for r in range(world)]
    assert type(out) is list and len(out) == len(expected[0])
    for i, per_rank in enumerate(out):
        assert type(per_rank) is list and len(per_rank) == world
        for r, t in enumerate(per_rank):
            same(t, expected[r][i], "step %d tensor %d rank %d" % (step, i, r))
            assert not t.requires_grad


def case_gather_plan_steady_state(rank, world):
    """create (hint and no hint), many executions into the plan's buffer: bit-exact each time,
    the buffer's data_ptr and the result tensors unchanged, no metadata collective."""
    hint = [_gather_shapes(r) for r in range(world)]
    params = _gather_params(rank)
    for plan in (
        shardgather.AllGatherPlan.create(params, timeout=T),
        shardgather.AllGatherPlan.create(params, None, hint, timeout=T),
        shardgather.AllGatherPlan.create(params, None, hint, preflight=False, timeout=T),
    ):
        assert plan.world_size == world and plan.rank == rank and plan.strategy == "auto"
        first = plan.execute(params)
        _check_gather(first, world, 0)
        ptr = plan.buffer.data_ptr()
        for step in range(1, 15):
            for dst, src in zip(params, _gather_params(rank, step)):
                dst.copy_(src)
            before = shardgather.communicator().collectives_issued
            out = plan.execute(params)
            issued = shardgather.communicator().collectives_issued - before
            assert plan.buffer.data_ptr() == ptr, "the plan's buffer must be reused"
            assert all(a is b for x, y in zip(out, first) for a, b in zip(x, y)), "cached views"
            _check_gather(out, world, step)
            st = plan.last_stats  # no collective beyond the header, the payload and setup
            assert issued == (st["preflight_collectives"] + st["payload_collectives"]
                              + st["setup_collectives"]), (issued, st)
        assert plan.buffer.numel() == plan.output_bytes
        for dst, src in zip(params, _gather_params(rank)):
            dst.copy_(src)


def case_gather_plan_pure_and_out(rank, world):
    hint = [_gather_shapes(r) for r in range(world)]
    params = _gather_params(rank)
    dtypes = [p.dtype for p in params]
    for strategy in ("direct", "packed", "per_tensor"):
        plan = shardgather.AllGatherPlan(dtypes, hint, rank, strategy=strategy, timeout=T)
        assert plan.strategy == strategy
        out_buf = torch.empty(plan.output_bytes // 8 + 1, dtype=torch.float64)
        out = plan.execute(params, dist.group.WORLD, out_buf)
        assert plan.buffer is None, "with out, the plan allocates nothing"
        assert plan.last_stats["strategy"] == strategy
        _check_gather(out, world, 0)
        base = out_buf.data_ptr()
        assert all(base <= t.data_ptr() < base + out_buf.numel() * 8 or t.numel() == 0
                   for row in out for t in row)
        again = plan.execute(params, None, out_buf)
        assert all(a is b for x, y in zip(again, out) for a, b in zip(x, y))


def case_gather_plan_wrong_shape(rank, world):
    """A tensor that does not match the plan on one rank raises on every rank."""
    hint = [_gather_shapes(r) for r in range(world)]
    params = _gather_params(rank)
    plan = shardgather.AllGatherPlan.create(params, None, hint, timeout=T)
    bad = list(params)
    if rank == world - 1:
        bad[1] = torch.zeros(9, 5, dtype=params[1].dtype)
    try:
        plan.execute(bad)
    except shardgather.InvalidArgumentError as e:
        assert ("rank %d" % (world - 1)) in str(e) and "tensor 1" in str(e), str(e)
    else:
        raise AssertionError("a wrong shape must raise on every rank")
    bad = list(params)
    if rank == 0:
        bad[0] = None
    try:
        plan.execute(bad)
    except shardgather.InvalidTypeError as e:
        assert isinstance(e, TypeError) and "params[0]" in str(e) and "rank 0" in str(e), str(e)
    else:
        raise AssertionError("a non-tensor must raise on every rank")
    _check_gather(plan.execute(params), world, 0)


def case_result_lists_reused_until_edited(rank, world):
    """A steady-state execution returns the very lists it returned before (no new Python
    containers, so no cyclic-GC pass per step); a caller that edited them gets new, correct ones
    and keeps its edited lists untouched."""
    import gc

    hint = [_gather_shapes(r) for r in range(world)]
    params = _gather_params(rank)
    plan = shardgather.AllGatherPlan.create(params, None, hint, timeout=T)
    first = plan.execute(params)
    assert plan.execute(params) is first
    first[0].append("mine")  # the caller's edit stays the caller's
    again = plan.execute(params)
    assert again is not first and first[0][-1] == "mine" and len(again[0]) == world
    _check_gather(again, world, 0)
    assert all(a is b for x, y in zip(again, first) for a, b in zip(x, y)), "cached views"
    again[1] = None
    again2 = plan.execute(params)
    assert again2 is not again and again[1] is None
    _check_gather(again2, world, 0)
    assert plan.execute(params) is again2
    # Into a caller's buffer: the lists follow the buffer, as the views do.
    buf = torch.empty(plan.output_bytes, dtype=torch.uint8)
    into = plan.execute(params, None, buf)
    assert into is not again2 and plan.execute(params, None, buf) is into
    _check_gather(into, world, 0)
    # Unshard: the flat list of full tensors, likewise.
    specs = _param_specs(world)
    uplan = shardgather.UnshardPlan(specs, world, rank, timeout=T)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    full = uplan.execute(shards)
    assert uplan.execute(shards) is full
    full.reverse()
    fresh = uplan.execute(shards)
    assert fresh is not full and fresh[0] is full[-1]
    for i, s in enumerate(specs):
        same(fresh[i], _expected_full(s, world, i), "param %d" % i)
    # No cyclic-GC pass is triggered by the executions themselves (1000 tensors per call would
    # allocate 1001 lists per call, past the default threshold of 700, without the reuse).
    many = [torch.full((3,), float(rank)) for _ in range(1000)]
    big = shardgather.AllGatherPlan.create(many, None, [[(3,)] * 1000] * world, timeout=T)
    big.execute(many)
    passes = []
    callback = lambda phase, info: passes.append(phase) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(callback)
    try:
        for _ in range(50):
            out = big.execute(many)
    finally:
        gc.callbacks.remove(callback)
    assert len(passes) < 10, "%d GC passes in 50 executions" % len(passes)
    assert torch.equal(out[999][world - 1], torch.full((3,), float(world - 1)))


def auto_trial(step, window):
    """What an "auto" plan runs at `step` of its first shardgather.AUTO_TRIAL_RUNS executions
    when its rule picks `window`: the window and "direct" in turn, the window first."""
    if window == "direct":
        return "direct"
    assert step < shardgather.AUTO_TRIAL_RUNS, "past the trials the choice is measured"
    return window if step % 2 == 0 else "direct"


def case_shared_window_on_one_host(rank, world):
    """On one host, "auto" measures the node-shared window (the group only carries the pre-flight
    and barriers) against direct at any size, whether those go through the host mailbox (the
    default communicator) or over the group. It and an explicit "shared" must be bit-exact step
    after step, uneven and with small tensors mixed in, for both plans."""
    big = [(300_000 + 1000 * r,) for r in range(world)]  # ~1.2 MB of f32, uneven across ranks
    shapes = [[big[r], (3, 2), (), (0,)] for r in range(world)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.int8]

    def params_of(r, step):
        return [make(s, dt, 1000 * step + 10 * r + k) for k, (s, dt) in enumerate(zip(shapes[r], dtypes))]

    for strategy, preflight in (("auto", True), ("shared", True), ("shared", False)):
        params = params_of(rank, 0)
        plan = shardgather.AllGatherPlan.create(params, None, shapes, strategy=strategy,
                                                preflight=preflight, timeout=T)
        for step in range(4):
            for dst, src in zip(params, params_of(rank, step)):
                dst.copy_(src)
            out = plan.execute(params)
            ran = plan.last_stats["strategy"]
            want = "direct" if world == 1 else "shared"
            if strategy == "auto":
                want = auto_trial(step, want)  # auto measures the window against direct
            assert ran == want, (strategy, step, ran, plan.last_stats["why"])
            for i in range(len(dtypes)):
                for r in range(world):
                    same(out[i][r], params_of(r, step)[i], "%s step %d tensor %d rank %d" % (strategy, step, i, r))
    over_group = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", True, False)
    for comm in (None, over_group):
        for name, keep in (("big", slice(None)), ("small", slice(1, None))):
            params = params_of(rank, 0)[keep]
            plan = shardgather.AllGatherPlan.create(params, comm, [s[keep] for s in shapes], timeout=T)
            for step in range(3):
                for dst, src in zip(params, params_of(rank, step)[keep]):
                    dst.copy_(src)
                out = plan.execute(params, comm)
                ran = plan.last_stats["strategy"]
                want = auto_trial(step, "direct" if world == 1 else "shared")
                assert ran == want, (comm, name, step, ran, plan.last_stats["why"])
                for i in range(len(params)):
                    for r in range(world):
                        same(out[i][r], params_of(r, step)[keep][i], "%s step %d tensor %d rank %d" % (name, step, i, r))
    spec = shardgather.ShardSpec(torch.float32, (300_000 * world + 7, 2), 0)
    uplan = shardgather.UnshardPlan([spec], world, rank, timeout=T)
    for step in range(3):
        full = uplan.execute([_local_shard(spec, rank, world, 0, step)])
        want = auto_trial(step, "shared" if world > 1 else "direct")
        assert uplan.last_stats["strategy"] == want, (step, uplan.last_stats)
        same(full[0], _expected_full(spec, world, 0, step), "unshard step %d" % step)


def case_plans_moving_the_payload_two_ways(rank, world):
    """Plans of the same shapes built with different strategies on different ranks: every rank
    raises MismatchError from the header, with nothing written, and the group stays usable.
    (Before the strategy was in the header, per_tensor against direct returned wrong bytes on
    one rank and killed the other's process in Gloo.)"""
    if world == 1:
        return
    params = _gather_params(rank)
    hint = [[tuple(t.shape) for t in _gather_params(r)] for r in range(world)]
    dtypes = [t.dtype for t in params]
    for mine, theirs in (("per_tensor", "direct"), ("shared", "direct"), ("packed", "per_tensor")):
        strategy = mine if rank == 0 else theirs
        # create() exchanges a header (the requested strategies differ); the pure constructor
        # does not, so its first execution is where every rank finds out.
        for build in (
            lambda: shardgather.AllGatherPlan.create(params, None, hint, strategy=strategy,
                                                     timeout=T),
            lambda: shardgather.AllGatherPlan(dtypes, hint, rank, strategy=strategy, timeout=T),
        ):
            out = None
            try:
                plan = build()
                out = torch.full((plan.output_bytes,), 0xEE, dtype=torch.uint8)
                plan.execute(params, out=out)
            except shardgather.MismatchError as e:
                assert "strategy differs" in str(e), str(e)
            else:
                raise AssertionError("%s against %s must raise on every rank" % (mine, theirs))
            assert out is None or bool((out == 0xEE).all()), "a mismatched execution wrote"
    _check_gather(shardgather.AllGatherPlan.create(params, None, hint, timeout=T).execute(params),
                  world, 0)


def case_group_allgather_transport(rank, world):
    """A communicator over the group's allgather only (p2p=False: no exact gather-v, as on
    NCCL): the strategy layer pads (direct runs as "padded"), copies out, and every operation
    stays bit-exact."""
    comm = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", False, True)
    params = _gather_params(rank)
    hint = [[tuple(t.shape) for t in _gather_params(r)] for r in range(world)]
    _check_gather(shardgather.foreach_all_gather(params, comm, hint, timeout=T), world, 0)
    _check_gather(shardgather.foreach_all_gather(params, comm, timeout=T), world, 0)
    for strategy in ("direct", "packed", "per_tensor", "padded"):
        plan = shardgather.AllGatherPlan.create(params, comm, hint, strategy=strategy, timeout=T)
        for _ in range(2):
            _check_gather(plan.execute(params, comm), world, 0)
        if world > 1:
            want = "padded" if strategy == "direct" else strategy
            assert plan.last_stats["strategy"] == want, (strategy, plan.last_stats)
    plan = shardgather.AllGatherPlan.create(params, comm, timeout=T)  # records gathered padded
    _check_gather(plan.execute(params, comm, async_op=True).wait(), world, 0)
    specs = _param_specs(world)
    shards = [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]
    for strategy in ("direct", "packed", "per_tensor"):
        full = shardgather.UnshardPlan(specs, world, rank, strategy=strategy,
                                       timeout=T).execute(shards, comm)
        for i, s in enumerate(specs):
            same(full[i], _expected_full(s, world, i), "%s param %d" % (strategy, i))


CASES = sorted(name for name in dir() if name.startswith("case_"))
