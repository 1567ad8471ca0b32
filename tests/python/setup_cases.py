"""The first call on a group builds its communicator (collective: the host count and the host
mailbox). These cases check that it keeps the call's contract: the call's timeout, no GIL held,
no deadlock between groups, the same decision on every rank when the environment differs, and
a clear error for a bad group argument. Run by conftest.run_cases."""

import glob
import os
import threading
import time

import torch
import torch.distributed as dist

import shardgather
from gloo_cases import T


def case_env_differs_between_ranks(rank, world):
    """LOCAL_WORLD_SIZE set on one rank only: every rank still decides alike (the host count
    comes from the exchanged host names), the calls succeed, and no /dev/shm object is left."""
    before = set(glob.glob("/dev/shm/shardgather-*"))
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    if rank == 0:
        os.environ["LOCAL_WORLD_SIZE"] = "8"
    try:
        group = dist.new_group(list(range(world)))
        params = [torch.full((rank + 1,), float(rank))]
        out = shardgather.foreach_all_gather(params, group, timeout=T)
        for r in range(world):
            assert torch.equal(out[0][r], torch.full((r + 1,), float(r))), r
        assert shardgather.communicator(group).uses_host_mailbox == (world > 1)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    dist.barrier()
    leftover = set(glob.glob("/dev/shm/shardgather-*")) - before
    assert not leftover, leftover


def case_bad_group_argument(rank, world):
    for bad in (3, "world", object()):
        try:
            shardgather.foreach_all_gather([torch.ones(2)], bad, timeout=T)
        except TypeError as e:
            assert "group must be" in str(e) and type(bad).__name__ in str(e), str(e)
        else:
            raise AssertionError("a bad group argument must raise TypeError")


def case_two_groups_first_calls_in_opposite_orders(rank, world):
    """Two threads, each with its own group; rank 0's threads make their first calls in one
    order, the others' in the opposite one. Building a group's communicator must not hold a lock
    the other group's first call needs, nor the GIL."""
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    order = [0, 1] if rank == 0 else [1, 0]
    results, errors = {}, []
    started = threading.Barrier(2)

    def call(k):
        try:
            started.wait()
            if k != order[0]:
                time.sleep(0.2)
            out = shardgather.foreach_all_gather([torch.full((2,), float(rank + 10 * k))],
                                                 groups[k], timeout=T)
            results[k] = out
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(T + 5)
    assert not errors, errors
    assert time.monotonic() - start < T / 3, time.monotonic() - start
    for k in (0, 1):
        for r in range(world):
            assert torch.equal(results[k][0][r], torch.full((2,), float(r + 10 * k)))


def timeout_case_first_call_honours_timeout(rank, world):
    """The last rank never calls on a new group: the others' first call (which builds the
    communicator) raises CollectiveTimeout after the call's timeout, not the default one."""
    group = dist.new_group(list(range(world)))
    if rank == world - 1:
        time.sleep(6.0)  # alive but absent: its peers must give up at their own deadline
        return
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather([torch.ones(2)], group, timeout=2.0)
    except shardgather.CollectiveTimeout:
        pass
    else:
        raise AssertionError("a first call with an absent peer must time out")
    waited = time.monotonic() - start
    assert waited < 6.0, "the first call waited %.1f s for a 2 s timeout" % waited


def timeout_case_late_rank_zero_bytes(rank, world):
    """A zero-byte call (an empty list) whose last rank arrives 1.6 s after its peers' 1 s
    deadline: the peers raise CollectiveTimeout, and so does the late rank, at once, instead of
    reading the peers' abandoned header from the host mailbox as a completed call."""
    shardgather.foreach_all_gather([torch.ones(1)], timeout=T)  # the communicator exists
    late = rank == world - 1
    if late:
        time.sleep(1.6)
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather([], timeout=10.0 if late else 1.0)
    except shardgather.CollectiveTimeout as e:
        if late:
            assert "gave up" in str(e), str(e)
            assert time.monotonic() - start < 1.0, time.monotonic() - start
    else:
        raise AssertionError("rank %d returned success from a call its peers gave up" % rank)


def _interrupt_after(seconds):
    import signal

    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _two_gloo_p2p_comms(rank, world):
    """Two communicators over Gloo point to point (no host mailbox: the header goes over Gloo),
    a group each, since an interrupted call closes its group's Gloo context. Rank 0 gets them;
    every other rank stays alive, never calling, and gets None."""
    comms = [shardgather._C._process_group_communicator(dist.new_group(list(range(world))), "cpu",
                                                        True, False)
             for _ in range(2)]
    if rank != 0:
        time.sleep(8.0)
        return None
    return comms


def timeout_case_ctrl_c_in_gloo_waits(rank, world):
    """Ctrl-C while rank 0 waits over Gloo point to point (the header over Gloo: a
    communicator without the host mailbox; its peer never comes), in a started call and in a
    blocking one: KeyboardInterrupt within about a second, not at the 30 s deadline. (Gloo's
    send/recv works can neither be waited on in slices nor polled: the blocking call waits on a
    helper thread; see src/transport/backends/torch/process_group.h.) A group each: an interrupted call closes
    its group's Gloo context."""
    comms = _two_gloo_p2p_comms(rank, world)
    if comms is None:
        return
    for started, comm in zip((True, False), comms):
        if started:
            call = lambda: shardgather.foreach_all_gather(  # noqa: E731
                [torch.ones(4)], comm, timeout=30.0, async_op=True).wait()
        else:
            call = lambda: shardgather.foreach_all_gather(  # noqa: E731
                [torch.ones(4)], comm, timeout=30.0)
        _interrupted(call, "started=%s" % started)
        assert comm.is_poisoned


def timeout_case_ctrl_c_during_setup(rank, world):
    """Ctrl-C during a group's first call, while building its communicator waits for a peer
    that never comes (the setup exchange over Gloo): KeyboardInterrupt within about a second,
    not at the 30 s timeout."""
    group = dist.new_group(list(range(world)))
    if rank != 0:
        time.sleep(8.0)  # alive, never calling
        return
    timer = _interrupt_after(0.5)
    start = time.monotonic()
    try:
        shardgather.foreach_all_gather([torch.ones(4)], group, timeout=30.0)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("no KeyboardInterrupt")
    finally:
        timer.join()
    waited = time.monotonic() - start
    assert waited < 2.0, "KeyboardInterrupt after %.1f s" % waited


class _Wedged(Exception):
    """Ends the call of a peer wedged by _wedge_in_header."""


def _wedge_in_header(seconds, then_raise=True):
    """Makes this rank hang for `seconds` in its next call's header wait, after it has posted
    its own header: a SIGUSR1 handler, which the call's interrupt check runs on this thread about
    every 100 ms, sleeps. Then it raises _Wedged (ending the call), or returns and the call goes
    on to its payload, late. Its peers pass the header (they see this rank's) and wait in the
    payload meanwhile."""
    import signal

    def wedge(signum, frame):
        time.sleep(seconds)
        if then_raise:
            raise _Wedged()

    signal.signal(signal.SIGUSR1, wedge)
    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    timer.start()
    return timer


def _interrupted(call, what):
    """`call()` with SIGINT 0.5 s in: KeyboardInterrupt within about a second of it, not at the
    call's deadline."""
    timer = _interrupt_after(0.5)
    start = time.monotonic()
    try:
        call()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("no KeyboardInterrupt (%s)" % what)
    finally:
        timer.join()
    waited = time.monotonic() - start
    assert waited < 2.0, "KeyboardInterrupt after %.1f s (%s)" % (waited, what)


def _interrupted_in_payload(call, what):
    """Rank 0's side: `call()` once the wedged peer's header is there, interrupted."""
    time.sleep(0.6)  # the peer has posted its header and hangs in its check
    _interrupted(call, what)


def _ctrl_c_in_payload(rank, world, call, what, peer_call=None):
    """Rank 0 makes `call(comm)` while its peer hangs after the header of its `peer_call`
    (blocking; default `call`): KeyboardInterrupt, and a poisoned communicator. A fresh group
    each time: an interrupted call closes the group's Gloo context."""
    group = dist.new_group(list(range(world)))
    comm = shardgather._C._process_group_communicator(group, "cpu", True, True)
    if rank != 0:
        timer = _wedge_in_header(1.6)
        try:
            (peer_call or call)(comm)
        except _Wedged:
            pass
        else:
            raise AssertionError("the peer was not wedged in its header (%s)" % what)
        finally:
            timer.join()
        return
    _interrupted_in_payload(lambda: call(comm), what)
    assert comm.is_poisoned, what


def timeout_case_ctrl_c_in_gloo_payload_gather(rank, world):
    """Ctrl-C while rank 0 waits in the payload of a gather over Gloo point to point (the
    header went through the host mailbox; the peer hangs right after it), blocking and started:
    KeyboardInterrupt within about a second, not at the 30 s deadline."""
    params = [torch.full((1024,), float(rank))]
    hint = [[(1024,)] for _ in range(world)]

    def blocking(comm):
        shardgather.foreach_all_gather(params, comm, hint, timeout=30.0)

    def started(comm):
        shardgather.foreach_all_gather(params, comm, hint, timeout=30.0, async_op=True).wait()

    _ctrl_c_in_payload(rank, world, blocking, "foreach, blocking")
    _ctrl_c_in_payload(rank, world, started, "foreach, started", blocking)


def timeout_case_ctrl_c_in_gloo_payload_scatter(rank, world):
    """The same in the chunked scatter paths: an unshard along dim 1 (every rank receives into
    strided pieces), and a gather to one rank (dst=), on the receiving and on the sending
    rank."""
    spec = shardgather.ShardSpec(torch.float32, (64, 64 * world), 1)

    def unshard(dst):
        def call(comm):
            plan = shardgather.UnshardPlan([spec], world, rank, timeout=30.0, dst=dst)
            plan.execute([torch.ones(plan.shard_shape(rank, 0))], comm)
        return call

    _ctrl_c_in_payload(rank, world, unshard(None), "unshard along dim 1")
    _ctrl_c_in_payload(rank, world, unshard(0), "unshard to dst=0, receiving")
    _ctrl_c_in_payload(rank, world, unshard(1), "unshard to dst=1, sending")


def _ctrl_c_then_late_peer(rank, world, shard_dim, what):
    """Rank 0 is interrupted in the payload of an unshard (strategy direct: it receives into
    the caller's `full` and sends from the caller's shard) while its peer hangs after the
    header; then the peer goes on to its payload, late. The interrupted call must have let go
    of the caller's memory: rank 0 overwrites both tensors after KeyboardInterrupt and finds
    them untouched once the peer has come, and the late peer's call raises RemoteError (rank 0
    closed the group's Gloo context) instead of completing with bytes of a call that raised."""
    group = dist.new_group(list(range(world)))
    # Without the host mailbox the peer's header completes over Gloo while the peer hangs, so it
    # goes on to the payload (the mailbox would tell it that rank 0 gave up).
    comm = shardgather._C._process_group_communicator(group, "cpu", True, False)
    sizes = [64 + 8 * r for r in range(world)]
    full_shape = [64, 64]
    full_shape[shard_dim] = sum(sizes)
    spec = shardgather.ShardSpec(torch.float32, tuple(full_shape), shard_dim, sizes)
    plan = shardgather.UnshardPlan([spec], world, rank, strategy="direct",
                                   timeout=30.0 if rank == 0 else 3.0)
    shard = torch.full(plan.shard_shape(rank, 0), float(rank + 1))
    full = torch.zeros(full_shape)
    if rank != 0:
        timer = _wedge_in_header(1.6, then_raise=False)
        outcome = "completed"
        try:
            plan.execute([shard], comm, [full])
        except shardgather.ShardgatherError as e:
            outcome = type(e).__name__
        finally:
            timer.join()
        dist.barrier()  # rank 0 checks its memory now
        assert outcome == "RemoteError", "the late peer's call: %s (%s)" % (outcome, what)
        return
    _interrupted_in_payload(lambda: plan.execute([shard], comm, [full]), what)
    full.fill_(7.0)
    shard.fill_(7.0)
    dist.barrier()  # the late peer has made its payload by now
    written = int((full != 7.0).sum())
    assert written == 0, "%d elements written after the call raised (%s)" % (written, what)


def timeout_case_ctrl_c_then_late_peer(rank, world):
    """After Ctrl-C in the payload nothing touches the caller's memory, on the gather into
    contiguous pieces (dim 0: received straight into `full`) and the chunked scatter (dim 1:
    sent straight from the shard)."""
    _ctrl_c_then_late_peer(rank, world, 0, "unshard along dim 0")
    _ctrl_c_then_late_peer(rank, world, 1, "unshard along dim 1")


def timeout_case_ctrl_c_in_weight_sync(rank, world):
    """Ctrl-C while rank 0 waits on a started weight sync (its Work) whose peer never comes:
    KeyboardInterrupt within about a second, not at the 30 s deadline, and the group poisoned
    (the sync's thread, blocked in its opening round, ends with it). The blocking sync alike."""
    from shardgather.layouts import Box, TensorLayout

    layouts = [TensorLayout((8, 4), torch.float32, [(0, Box((0, 0), (8, 4)))],
                            [(1, Box((0, 0), (8, 4)))])]
    comms = _two_gloo_p2p_comms(rank, world)
    if comms is None:
        return
    for started, comm in zip((True, False), comms):
        ws = shardgather.WeightSync(layouts, comm, timeout=30.0)
        if started:
            work = ws.start(1, [torch.ones(8, 4)])
            assert isinstance(work, shardgather.Work)
            call = work.wait
        else:
            call = lambda: ws.sync(1, [torch.ones(8, 4)])  # noqa: E731
        _interrupted(call, "started=%s" % started)
        assert comm.is_poisoned


CASES = [
    "case_env_differs_between_ranks",
    "case_bad_group_argument",
    "case_two_groups_first_calls_in_opposite_orders",
]
