"""Groups: the shardgather Communicator of a torch ProcessGroup (one per group, built on its
first call), the threads backend's in-process group, and the MPI helpers.

The bottom of the package above the binding: the operations (``_ops``) and the whole-model
modules call ``communicator`` to turn whatever ``group`` they were given into a Communicator.
"""

import atexit
import threading
import weakref

import torch
import torch.distributed as dist

from . import _shardgather as _C
from ._shardgather import Communicator


# One communicator per group object: its op sequence numbers and poisoned state must persist
# across calls, and it must go away with the group (torch keeps groups alive while they exist).
# Building one is collective, so it happens under a lock of its own group only: two threads whose
# first calls on two groups come in opposite orders on two ranks must not wait for each other.
_comms = weakref.WeakKeyDictionary()
_building = weakref.WeakKeyDictionary()  # group -> the lock its first call builds under
_comms_lock = threading.Lock()


def communicator(group=None, timeout=None):
    """The shardgather Communicator for ``group``.

    ``group`` may be a Communicator (returned as is), a torch.distributed ProcessGroup, or None
    for torch.distributed's default group. The first call for a group builds its communicator,
    which is collective over the group (every rank's first call does it) and bounded by
    ``timeout`` seconds (None: the default timeout); it runs without the GIL.
    """
    if isinstance(group, Communicator):
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "group=None means torch.distributed's default group, which is not "
                "initialised: call torch.distributed.init_process_group() first, or pass "
                "a group or a shardgather.Communicator"
            )
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup, a shardgather.Communicator or "
            "None, got %s" % type(group).__name__
        )
    with _comms_lock:
        comm = _comms.get(group)
        if comm is not None:
            return comm
        building = _building.setdefault(group, threading.Lock())
    with building:
        with _comms_lock:
            comm = _comms.get(group)
        if comm is None:
            # Host tensors go to the group's CPU backend (torch 2.x: "cpu:gloo,cuda:nccl"
            # holds one per device type); a group without one (NCCL only) stages them on the
            # current CUDA device.
            device = "cpu"
            if "cpu:" not in dist.get_backend_config(group):
                device = "cuda:%d" % torch.cuda.current_device()
            comm = _C._process_group_communicator(group, device, timeout=timeout)
            with _comms_lock:
                _comms[group] = comm
    return comm


def _setup_timeout(timeout):
    """The call's timeout, for building the group's communicator on a first call; a bad value
    is left to the call itself, which reports it on every rank."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        return None
    return seconds if seconds >= 0 and seconds == seconds and seconds != float("inf") else None



class ThreadGroup:
    """N ranks inside this process (the threads backend): ``group[r]`` is rank r's Communicator,
    to be driven by one Python thread per rank (calls release the GIL)."""

    def __init__(self, world_size):
        self.communicators = _C._make_thread_group(int(world_size))

    def __len__(self):
        return len(self.communicators)

    def __getitem__(self, rank):
        return self.communicators[rank]

    def __iter__(self):
        return iter(self.communicators)


def has_mpi():
    """Whether this build has the MPI backend."""
    return bool(_C._has_mpi)


_we_initialised_mpi = False


def mpi_init():
    """Initialises MPI (MPI_THREAD_SERIALIZED) unless it already is, and finalises it at exit if
    this call initialised it. Not needed when mpi4py is imported (it initialises MPI)."""
    global _we_initialised_mpi
    if not has_mpi():
        raise RuntimeError("this shardgather build has no MPI backend")
    if _C._mpi_init():
        _we_initialised_mpi = True
        atexit.register(_C._mpi_finalize)


def mpi_communicator(comm=None):
    """A Communicator over an MPI communicator: an mpi4py ``MPI.Comm`` or None for
    MPI_COMM_WORLD. MPI must be initialised (import mpi4py.MPI, or call mpi_init()). Collective
    over ``comm`` (it duplicates it)."""
    if not has_mpi():
        raise RuntimeError("this shardgather build has no MPI backend")
    handle = None
    if comm is not None:
        from mpi4py import MPI

        handle = MPI._handleof(comm)
    return _C._mpi_communicator(handle)
