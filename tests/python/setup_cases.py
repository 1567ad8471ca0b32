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


def timeout_case_ctrl_c_in_gloo_waits(rank, world):
    """Ctrl-C while rank 0 waits over Gloo point to point (the header over Gloo: a
    communicator without the host mailbox; its peer never comes), in a started call and in a
    blocking one: KeyboardInterrupt within about a second, not at the 30 s deadline. (Gloo's
    send/recv works can neither be waited on in slices nor polled: the blocking call waits on a
    helper thread; see python/src/process_group.h.)"""
    group = dist.new_group(list(range(world)))
    comms = [shardgather._C._process_group_communicator(group, "cpu", True, False)
             for _ in range(2)]
    if rank != 0:
        time.sleep(8.0)  # alive, never calling
        return
    for started, comm in zip((True, False), comms):
        timer = _interrupt_after(0.5)
        start = time.monotonic()
        try:
            if started:
                shardgather.foreach_all_gather([torch.ones(4)], comm, timeout=30.0,
                                               async_op=True).wait()
            else:
                shardgather.foreach_all_gather([torch.ones(4)], comm, timeout=30.0)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("no KeyboardInterrupt (started=%s)" % started)
        finally:
            timer.join()
        waited = time.monotonic() - start
        assert waited < 2.0, "KeyboardInterrupt after %.1f s (started=%s)" % (waited, started)
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


CASES = [
    "case_env_differs_between_ranks",
    "case_bad_group_argument",
    "case_two_groups_first_calls_in_opposite_orders",
]
