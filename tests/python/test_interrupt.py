"""F11: Ctrl-C while a call blocks raises KeyboardInterrupt within about a second.

The main thread (the only one Python runs signal handlers on) blocks in a gather whose peer
never comes; SIGINT arrives half a second in. The call must end with KeyboardInterrupt well
before its 30 s deadline, and the communicator is poisoned afterwards (as after abort()).
"""
import os
import signal
import threading
import time

import pytest
import torch

import shardgather


def _interrupt_after(seconds):
    sent = {}

    def fire():
        sent["t"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(seconds, fire)
    timer.start()
    return timer, sent


@pytest.mark.parametrize("api", ["foreach", "plan"])
def test_ctrl_c_interrupts_a_blocked_call(api):
    group = shardgather.ThreadGroup(2)
    comm = group[0]  # rank 1 never calls
    params = [torch.arange(6, dtype=torch.float32)]
    timer, sent = _interrupt_after(0.5)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        if api == "foreach":
            shardgather.foreach_all_gather(params, comm, timeout=30.0)
        else:
            plan = shardgather.AllGatherPlan.create(params, comm, [[(6,)], [(6,)]], timeout=30.0)
            plan.execute(params, comm)
    raised = time.monotonic()
    timer.join()
    assert raised - start < 5.0, "the call waited far past the signal"
    assert raised - sent["t"] < 1.0, f"KeyboardInterrupt {raised - sent['t']:.2f} s after SIGINT"
    # Poisoned, as after abort(): fails fast instead of blocking again.
    with pytest.raises(shardgather.ShardgatherError):
        t0 = time.monotonic()
        shardgather.foreach_all_gather(params, comm, timeout=30.0)
    assert time.monotonic() - t0 < 0.5


def test_ctrl_c_while_waiting_on_a_started_call():
    """The operation runs on the progress thread; the handle's wait() on the main thread sees
    the signal, aborts the communicator, and raises KeyboardInterrupt."""
    group = shardgather.ThreadGroup(2)
    comm = group[0]  # rank 1 never calls
    params = [torch.arange(6, dtype=torch.float32)]
    work = shardgather.foreach_all_gather(params, comm, timeout=30.0, async_op=True)
    assert not work.is_completed()
    timer, sent = _interrupt_after(0.5)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        work.wait()
    raised = time.monotonic()
    timer.join()
    assert raised - start < 5.0, "the wait lasted far past the signal"
    assert raised - sent["t"] < 1.0, f"KeyboardInterrupt {raised - sent['t']:.2f} s after SIGINT"
    assert work.is_completed()  # aborted, not abandoned
    assert comm.is_poisoned
