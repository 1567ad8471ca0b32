"""Cases run on every rank of a spawned Gloo group (see conftest.run_cases). Each takes
(rank, world) and raises on failure. Every output is compared bit for bit with a pure-PyTorch
reference built from per-tensor dist.all_gather calls."""

import gc
import math
import sys
import threading
import time
import tracemalloc

import torch
import torch.distributed as dist

import shardgather

T = 30.0  # per-call deadline: a broken case fails instead of hanging the harness

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
DTYPES = FLOATS + INTS


def make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def raw(t):
    return t.reshape(-1).view(torch.uint8)


def shapes_of(params, world):
    shapes = [None] * world
    dist.all_gather_object(shapes, [tuple(p.shape) for p in params])
    return shapes


def reference(params, world):
    """out[i][r] from one dist.all_gather per tensor (padded to the largest rank, as Gloo needs
    equal sizes), moving raw bytes so every dtype takes the same path."""
    shapes = shapes_of(params, world)
    out = []
    for i, p in enumerate(params):
        numels = [math.prod(shapes[r][i]) for r in range(world)]
        width = max(numels) * p.element_size()
        flat = torch.zeros(width, dtype=torch.uint8)
        flat[: p.numel() * p.element_size()] = raw(p.contiguous())
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
        if width:
            dist.all_gather(bufs, flat)
        out.append(
            [
                bufs[r][: numels[r] * p.element_size()].view(p.dtype).reshape(shapes[r][i])
                for r in range(world)
            ]
        )
    return out, shapes


def assert_same(out, ref, world):
    assert type(out) is list, type(out)
    assert len(out) == len(ref), (len(out), len(ref))
    for i, (a, b) in enumerate(zip(out, ref)):
        assert type(a) is list, (i, type(a))
        assert len(a) == world
        for r, (x, y) in enumerate(zip(a, b)):
            where = "tensor %d rank %d" % (i, r)
            assert isinstance(x, torch.Tensor), where
            assert x.dtype == y.dtype, (where, x.dtype, y.dtype)
            assert tuple(x.shape) == tuple(y.shape), (where, x.shape, y.shape)
            assert torch.equal(raw(x), raw(y)), where
            assert not x.requires_grad and x.grad_fn is None, where


def check(params, world, hint_too=True):
    """shardgather vs the reference, without and with the shapes hint."""
    ref, shapes = reference(params, world)
    out = shardgather.foreach_all_gather(params, timeout=T)
    assert_same(out, ref, world)
    if hint_too:
        hint = [[tuple(s) for s in row] for row in shapes]
        out = shardgather.foreach_all_gather(params, None, hint, timeout=T)
        assert_same(out, ref, world)
        out = shardgather.foreach_all_gather(params, dist.group.WORLD, hint, timeout=T)
        assert_same(out, ref, world)


# ---- edge cases of the semantics (docs/python.md, "Semantics") -----------------------------


def case_uneven_dim0(rank, world):
    rows = [2, 3, 1, 2][rank % 4]
    params = [make((rows, 5), dt, 100 * rank + k) for k, dt in enumerate(DTYPES)]
    check(params, world)


def case_shapes_gathered_for_a_device_call(rank, world):
    # What a CUDA call without a hint gathers first (one host call): every rank's shapes,
    # 0-d and empty ones included, as the hint the device call then takes.
    params = [make((rank + 1, 2), torch.float32, rank), make((), torch.int8, 7),
              make((0, rank), torch.bfloat16, 9)]
    got = shardgather._gather_shapes(params, shardgather.communicator(None), T)
    assert got == shapes_of(params, world), got


def case_device_gather_request_is_a_device_calls_business(rank, world):
    # Reliability 2.8b: the device-gather request (SHARDGATHER_DEVICE_GATHER, read once per
    # process, or the hook) picks how an uneven device gather moves, and a device call's header
    # carries it, so ranks asking differently raise Mismatch on every rank
    # (tests/unit/device_test.cc, device_path_test.cc). Host calls carry none: ranks asking
    # differently, or a value no device call would accept, leave them alone.
    import os
    params = [make((rank + 1, 3), torch.float32, rank), make((5,), torch.bfloat16, 2)]
    try:
        shardgather._C._set_device_gather("broadcast" if rank == 0 else "padded")
        check(params, world)
        os.environ["SHARDGATHER_DEVICE_GATHER"] = "pipelined"
        check(params, world)
        try:
            shardgather._C._set_device_gather("pipelined")
            raise AssertionError("an unknown request was taken")
        except shardgather.InvalidArgumentError as e:
            assert "pipelined" in str(e), e
    finally:
        os.environ.pop("SHARDGATHER_DEVICE_GATHER", None)
        shardgather._C._set_device_gather("auto")


def case_device_wait_is_each_ranks_own(rank, world):
    # Reliability 2.8b: when device calls return (set_device_wait, SHARDGATHER_DEVICE_WAIT) is
    # local to a rank, so ranks may differ, and host calls ignore it; an unknown mode is refused
    # where it is set, naming it, and leaves the mode as it was.
    params = [make((rank + 1, 3), torch.float32, rank), make((5,), torch.bfloat16, 2)]
    assert shardgather.device_wait() == "stream"
    try:
        shardgather.set_device_wait("host" if rank == 0 else "stream")
        check(params, world)
        try:
            shardgather.set_device_wait("spin")
            raise AssertionError("an unknown mode was taken")
        except shardgather.InvalidArgumentError as e:
            assert "spin" in str(e), e
        assert shardgather.device_wait() == ("host" if rank == 0 else "stream")
    finally:
        shardgather.set_device_wait("stream")


def case_zero_dim(rank, world):
    params = [make((), dt, 7 * rank + k) for k, dt in enumerate(DTYPES)]
    check(params, world)


def case_empty_shards(rank, world):
    # rank 0 (and every third rank) holds empty shards, the others data; then all empty
    rows = 0 if rank % 3 == 0 else rank + 1
    params = [make((rows, 3), torch.float32, rank), make((rows,), torch.int64, rank + 50)]
    check(params, world)
    check([torch.empty(0), torch.empty(0, 4, dtype=torch.bfloat16)], world)


def case_n_by_zero(rank, world):
    params = [torch.empty(rank + 1, 0), make((2,), torch.float16, rank), torch.empty(0, 0, 3)]
    check(params, world)


def case_empty_list(rank, world):
    assert shardgather.foreach_all_gather([], timeout=T) == []
    out = shardgather.foreach_all_gather([], None, [[] for _ in range(world)], timeout=T)
    assert type(out) is list and out == []


def case_mixed_dtypes(rank, world):
    params = [make((rank + 1, 3), dt, 31 * rank + k) for k, dt in enumerate(DTYPES)]
    params += [make((7,), dt, 77 * rank + k) for k, dt in enumerate(reversed(DTYPES))]
    check(params, world)


def case_non_contiguous(rank, world):
    base = make((6, 8), torch.float32, rank)
    params = [
        base.t(),  # transposed
        base[:, ::2],  # every second column
        base[:, 3],  # one column of a 2-D tensor
        make((5,), torch.bfloat16, rank).expand(4, 5),  # stride 0
        make((4, 6), torch.int16, rank)[1:3, 1:5],  # offset window
        base,  # and a contiguous one between them
    ]
    assert not all(p.is_contiguous() for p in params)
    before = [p.clone() for p in params]
    check(params, world)
    for p, b in zip(params, before):
        assert torch.equal(p, b), "inputs must be left untouched"


def case_single_tensor(rank, world):
    check([make((4, 16), torch.bfloat16, rank)], world)  # even shards: sent from its own memory
    check([make(([2, 3, 1, 2][rank % 4], 16), torch.float32, rank)], world)  # uneven


def case_many_tensors(rank, world):
    g = torch.Generator().manual_seed(1234)
    sizes = torch.randint(1, 256, (300,), generator=g).tolist()
    params = [make((n,), FLOATS[k % 4], rank * 1000 + k) for k, n in enumerate(sizes)]
    check(params, world, hint_too=(rank >= 0))


def case_requires_grad(rank, world):
    w = make((rank + 2, 4), torch.float32, rank).requires_grad_(True)
    h = (w * 2)  # a non-leaf with a graph behind it
    out = shardgather.foreach_all_gather([w, h], timeout=T)
    ref, _ = reference([w.detach(), h.detach()], world)
    assert_same(out, ref, world)
    assert w.grad is None
    assert all(t.grad_fn is None and not t.requires_grad for row in out for t in row)


def case_results_own_their_memory(rank, world):
    params = [make((rank + 1, 64), torch.float32, rank) for _ in range(3)]
    ref, _ = reference(params, world)
    out = shardgather.foreach_all_gather(params, timeout=T)
    keep = out[2][world - 1]
    expected = ref[2][world - 1].clone()
    del out, params
    gc.collect()
    junk = [torch.full((rank + 1, 64), 7.0) for _ in range(50)]  # reuse any freed memory
    assert torch.equal(keep, expected)
    del junk


# ---- errors: every rank raises, then the group is usable -----------------------------------


def _follow_up(rank, world):
    check([make((rank + 1, 2), torch.float32, rank)], world, hint_too=False)


def case_wrong_hint_local_row(rank, world):
    params = [make((rank + 1, 2), torch.float32, rank)]
    hint = [[(r + 1, 2)] for r in range(world)]
    if rank == world - 1:
        hint[rank][0] = (rank + 5, 2)  # this rank's own row disagrees with its tensor
    try:
        shardgather.foreach_all_gather(params, None, hint, timeout=T)
    except shardgather.InvalidArgumentError as e:
        assert isinstance(e, ValueError)
        assert "tensor 0" in str(e) and "hint" in str(e), str(e)
        assert ("rank %d" % rank) in str(e), str(e)
    else:
        raise AssertionError("a wrong hint must raise on every rank")
    _follow_up(rank, world)


def case_hint_forms(rank, world):
    """A hint's shapes may be torch.Size, tuples or lists, its dims ints or numpy integers."""
    import numpy as np

    params = [make((rank + 1, 2), torch.float32, rank), make((), torch.int64, rank)]
    ref, _ = reference(params, world)
    for hint in (
        [[torch.Size((r + 1, 2)), torch.Size(())] for r in range(world)],
        [[[np.int64(r + 1), np.int32(2)], []] for r in range(world)],
        tuple(((r + 1, 2), ()) for r in range(world)),
    ):
        assert_same(shardgather.foreach_all_gather(params, None, hint, timeout=T), ref, world)
        plan = shardgather.AllGatherPlan.create(params, None, hint, timeout=T)
        assert_same(plan.execute(params), ref, world)


def case_malformed_hint(rank, world):
    """A hint one rank cannot read raises the same error on every rank (InvalidTypeError, a
    TypeError, or InvalidArgumentError for an out-of-range int), naming that rank and the
    position, at once rather than at the peers' deadline; through foreach_all_gather and
    AllGatherPlan.create alike."""
    bad_rank = world - 1
    params = [make((rank + 1, 2), torch.float32, rank)]
    good = [[(r + 1, 2)] for r in range(world)]
    malformed = (
        ([[(r + 1, 2.0)] for r in range(world)], "params_shapes_across_group[0][0][1] is a float"),
        ([["ab"] for r in range(world)], "params_shapes_across_group[0][0] is a str"),
        ([[(r + 1, 2)] for r in range(world - 1)] + [5], "[%d] is a int" % bad_rank),
        (7, "params_shapes_across_group must be a list"),
    )
    for bad, where in malformed:
        for call in (
            lambda h: shardgather.foreach_all_gather(params, None, h, timeout=T),
            lambda h: shardgather.AllGatherPlan.create(params, None, h, timeout=T),
        ):
            start = time.monotonic()
            try:
                call(bad if rank == bad_rank else good)
            except shardgather.InvalidTypeError as e:
                assert isinstance(e, TypeError) and where in str(e), (where, str(e))
                assert ("rank %d" % bad_rank) in str(e), str(e)
            else:
                raise AssertionError("a malformed hint must raise on every rank: " + where)
            assert time.monotonic() - start < T / 3, (where, time.monotonic() - start)
    _follow_up(rank, world)


def case_wrong_hint_peer_row(rank, world):
    if world == 1:
        return
    params = [make((rank + 1, 2), torch.float32, rank)]
    hint = [[(r + 1, 2)] for r in range(world)]
    if rank == 0:
        hint[world - 1][0] = (world + 3, 2)  # rank 0 believes something else about a peer
    try:
        shardgather.foreach_all_gather(params, None, hint, timeout=T)
    except shardgather.MismatchError as e:
        assert isinstance(e, RuntimeError)
        assert "hint" in str(e), str(e)
    else:
        raise AssertionError("disagreeing hints must raise on every rank")
    _follow_up(rank, world)


def case_strategies(rank, world):
    """Every strategy name, one shot, with and without the hint: bit-exact (on one host
    "hierarchical" moves direct; across hosts, from hosts_cases.py, it runs over Gloo point to
    point). A bad name, or ranks asking for different strategies, raise on every rank."""
    params = [make((rank + 2, 3), torch.float32, rank), make((0 if rank == 1 else 4,),
                                                             torch.int64, 10 + rank),
              make((), torch.bfloat16, 20 + rank)]
    ref, shapes = reference(params, world)
    hint = [[tuple(s) for s in row] for row in shapes]
    for name in ("auto", "direct", "packed", "per_tensor", "shared", "padded", "hierarchical"):
        for h in (None, hint):
            out = shardgather.foreach_all_gather(params, None, h, timeout=T, strategy=name)
            assert_same(out, ref, world)
    # Only the last rank names an unknown strategy, or (packed and direct move the same bytes
    # alike: only the header tells them apart) another one: every rank raises.
    odd_ones = [("ring", shardgather.InvalidArgumentError, "ring")]
    if world > 1:
        odd_ones.append(("packed", shardgather.MismatchError, "strategy"))
    for odd, error, needle in odd_ones:
        mine = odd if rank == world - 1 else "direct"
        for h in (None, hint):
            try:
                shardgather.foreach_all_gather(params, None, h, timeout=T, strategy=mine)
            except error as e:
                assert needle in str(e), str(e)
            else:
                raise AssertionError("%s on one rank must raise on every rank" % odd)
    _follow_up(rank, world)


def case_dtype_mismatch(rank, world):
    if world == 1:
        return
    params = [torch.ones(2), torch.ones(2, dtype=torch.int32 if rank == 1 else torch.float32)]
    try:
        shardgather.foreach_all_gather(params, timeout=T)
    except shardgather.MismatchError as e:
        assert "tensor 1" in str(e) and ("rank %d" % rank) in str(e), str(e)
    else:
        raise AssertionError("a dtype mismatch must raise on every rank")
    _follow_up(rank, world)


def case_host_mailbox(rank, world):
    """On one host the group's communicator exchanges the pre-flight header through shared
    memory; one built with host_mailbox=False sends it over Gloo like the payload. Both are
    bit-exact and both turn a cross-rank mismatch into MismatchError on every rank. Across
    hosts (across_hosts.py) there is no mailbox: it would need every rank on one host."""
    comm = shardgather.communicator()
    on_one_host = comm.ranks_on_host == world
    assert comm.uses_host_mailbox == (world > 1 and on_one_host)
    over_gloo = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", True, False)
    assert not over_gloo.uses_host_mailbox
    params = [make((rank + 1, 3), torch.float32, rank), make((2,), torch.int64, rank + 7)]
    ref, _ = reference(params, world)
    for comm in (shardgather.communicator(), over_gloo):
        assert_same(shardgather.foreach_all_gather(params, comm, timeout=T), ref, world)
        if world > 1:
            try:
                shardgather.foreach_all_gather(params[:1] if rank == 0 else params, comm, timeout=T)
            except shardgather.MismatchError as e:
                assert "count" in str(e) and ("rank %d" % rank) in str(e), str(e)
            else:
                raise AssertionError("a count mismatch must raise on every rank")
        assert_same(shardgather.foreach_all_gather(params, comm, timeout=T), ref, world)


def case_backend_per_device(rank, world):
    """A torch 2.x group with one backend per device type ("cpu:gloo,cuda:gloo", the shape of
    the default "cpu:gloo,cuda:nccl" on a machine without CUDA): host tensors go to its CPU
    backend, Gloo, with point to point (direct stays a true gather-v, not padded)."""
    group = dist.new_group(list(range(world)), backend="cpu:gloo,cuda:gloo")
    assert "cpu:gloo" in dist.get_backend_config(group), dist.get_backend_config(group)
    comm = shardgather.communicator(group)
    assert comm.backend_name == "torch.gloo", comm.backend_name
    params = [make((rank + 2, 3), torch.bfloat16, rank), make((rank,), torch.int32, rank + 3)]
    ref, shapes = reference(params, world)
    assert_same(shardgather.foreach_all_gather(params, group, timeout=T), ref, world)
    plan = shardgather.AllGatherPlan.create(params, group, shapes, strategy="direct", timeout=T)
    assert_same(plan.execute(params, group), ref, world)
    assert plan.last_stats["strategy"] == "direct", plan.last_stats


def case_count_mismatch(rank, world):
    if world == 1:
        return
    params = [torch.ones(2)] * (3 if rank == 0 else 2)
    try:
        shardgather.foreach_all_gather(params, timeout=T)
    except shardgather.MismatchError as e:
        assert "count" in str(e), str(e)
    else:
        raise AssertionError("a count mismatch must raise on every rank")
    _follow_up(rank, world)


def case_type_and_device_errors(rank, world):
    bad_rank = world - 1
    params = [torch.ones(2), "not a tensor" if rank == bad_rank else torch.ones(2)]
    try:
        shardgather.foreach_all_gather(params, timeout=T)
    except shardgather.InvalidTypeError as e:  # the same class and cause on every rank
        assert isinstance(e, TypeError) and "params[1]" in str(e), str(e)
        assert ("rank %d" % bad_rank) in str(e) and "not a torch.Tensor" in str(e), str(e)
    else:
        raise AssertionError("a non-tensor must raise on every rank")
    params = [torch.ones(2), torch.ones(2, device="meta") if rank == bad_rank else torch.ones(2)]
    try:
        shardgather.foreach_all_gather(params, timeout=T)
    except ValueError as e:
        assert "params[1]" in str(e) or ("rank %d" % bad_rank) in str(e), str(e)
    else:
        raise AssertionError("mixed devices must raise on every rank")
    try:
        shardgather.foreach_all_gather([torch.ones(2, dtype=torch.complex64)], timeout=T)
    except ValueError as e:
        assert "complex" in str(e).lower() or "dtype" in str(e), str(e)
    else:
        raise AssertionError("an unsupported dtype must raise")
    try:
        shardgather.foreach_all_gather(torch.ones(2), timeout=T)
    except TypeError:
        pass
    else:
        raise AssertionError("a tensor instead of a list must raise TypeError")
    _follow_up(rank, world)


# ---- resources and the GIL -----------------------------------------------------------------


def case_no_leak(rank, world):
    params = [make((rank + 1, 33), dt, rank) for dt in (torch.float32, torch.bfloat16)]
    params.append(make((17,), torch.int64, rank))
    hint = [[(r + 1, 33), (r + 1, 33), (17,)] for r in range(world)]

    def burst(n):
        for k in range(n):
            out = shardgather.foreach_all_gather(params, None, hint if k % 2 else None, timeout=T)
            del out

    burst(50)  # warm: caches, allocator pools
    gc.collect()
    refs = [sys.getrefcount(p) for p in params]
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    rss0 = _rss_kib()
    burst(1000)
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    rss1 = _rss_kib()
    tracemalloc.stop()
    assert [sys.getrefcount(p) for p in params] == refs, "input refcounts changed"
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    assert grown < 64 * 1024, "Python heap grew by %d bytes over 1000 calls" % grown
    assert rss1 - rss0 < 8 * 1024, "RSS grew by %d KiB over 1000 calls" % (rss1 - rss0)


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def case_gil_released(rank, world):
    """P4: while rank 0 blocks in a call (the last rank arrives 1 s late), a second Python
    thread keeps running."""
    if world == 1:
        return
    ticks = [0]
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    params = [make((4,), torch.float32, rank)]
    if rank == world - 1:
        time.sleep(1.0)
        shardgather.foreach_all_gather(params, timeout=T)
        return
    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.05)
    before = ticks[0]
    start = time.monotonic()
    shardgather.foreach_all_gather(params, timeout=T)
    blocked = time.monotonic() - start
    during = ticks[0] - before
    stop.set()
    t.join()
    assert blocked > 0.5, blocked
    assert during > 100, "the ticker ran %d times during a %.2f s call" % (during, blocked)


CASES = [name for name in dir(sys.modules[__name__]) if name.startswith("case_")]

# Cases that spoil the group (timeouts, aborts, a rank that exits) run in their own spawn; see
# test_foreach_gloo.py.


def timeout_case_abort_wakes_a_waiting_rank(rank, world):
    """Rank 0 waits for a peer that does not come (in the pre-flight, through the host mailbox)
    and another of its threads calls abort(): the call raises AbortedError at once, long before
    its deadline."""
    params = [torch.ones(3)]
    shardgather.foreach_all_gather(params, timeout=T)  # builds the communicator (collective)
    comm = shardgather.communicator()
    assert comm.uses_host_mailbox
    if rank != 0:
        time.sleep(4.0)
        return
    timer = threading.Timer(1.0, comm.abort)  # rank 0 is asleep in the mailbox by then
    timer.start()
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather(params, timeout=T)
    except shardgather.AbortedError as e:
        assert "rank 0" in str(e) and "while in" in str(e), str(e)
        assert time.monotonic() - start < 3.0, time.monotonic() - start
    else:
        raise AssertionError("expected AbortedError")
    finally:
        timer.join()
    assert comm.is_poisoned


def exit_case_peer_exits(rank, world):
    """The last rank's process ends while the others wait for it: in the pre-flight through the
    host mailbox, and over Gloo itself (a communicator without the mailbox). Both raise
    RemoteError within seconds, not at their deadline; the mailbox's names the rank."""
    params = [torch.ones(3)]
    shardgather.foreach_all_gather(params, timeout=T)  # builds the communicator (collective)
    over_gloo = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", True, False)
    if rank == world - 1:
        return "exit"
    for comm, named in ((shardgather.communicator(), True), (over_gloo, False)):
        start = time.monotonic()
        try:
            shardgather.foreach_all_gather(params, comm, timeout=T)
        except shardgather.RemoteError as e:
            if named:
                assert ("rank %d" % (world - 1)) in str(e) and "exited" in str(e), str(e)
            assert time.monotonic() - start < 5.0, (named, time.monotonic() - start)
        else:
            raise AssertionError("expected RemoteError")


def timeout_case_stalled_peer(rank, world):
    """Rank 0 never calls: the others raise CollectiveTimeout (a TimeoutError) within about the
    deadline, and the poisoned communicator then fails fast."""
    params = [torch.ones(3)]
    shardgather.foreach_all_gather(params, timeout=T)  # builds the communicator (collective)
    if rank == 0:
        time.sleep(4.0)
        return
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather(params, timeout=1.0)
    except shardgather.CollectiveTimeout as e:
        elapsed = time.monotonic() - start
        assert isinstance(e, TimeoutError) and isinstance(e, shardgather.ShardgatherError)
        assert ("rank %d" % rank) in str(e), str(e)
        assert 0.9 < elapsed < 3.0, elapsed
    else:
        raise AssertionError("expected CollectiveTimeout")
    assert shardgather.communicator().is_poisoned
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather(params, timeout=1.0)
    except shardgather.CommAbortedError:
        assert time.monotonic() - start < 0.05
    else:
        raise AssertionError("a poisoned communicator must fail fast")


def release_case_group_destroyed_then_dropped(rank, world):
    """A group used through shardgather, destroyed, then dropped: the cached communicator goes
    with the group object and holds the last reference to the c10d group, whose destructor joins
    Gloo's worker threads. One of them may still be releasing a Python-owned tensor of the last
    collective, which takes the GIL: destroying the communicator with the GIL held deadlocked
    (every run, within a few groups, before the fix). 30 groups must come and go."""
    for k in range(30):
        group = dist.new_group(list(range(world)))
        params = [torch.full((5,), float(rank))]
        out = shardgather.foreach_all_gather(params, group, timeout=T)
        assert [float(t[0]) for t in out[0]] == [float(r) for r in range(world)], k
        for _ in range(5):
            dist.all_reduce(torch.ones(1000), group=group)
        dist.barrier(group=group)
        dist.destroy_process_group(group)
        del group, out  # the communicator goes with the group, at once (refcount)
