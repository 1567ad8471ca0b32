"""shardgather: gather a list of tensors from every rank in one coalesced collective.

    import shardgather
    out = shardgather.foreach_all_gather(params, group)   # out[i][r]: rank r's params[i]

The whole call runs in C++ with the GIL released. ``group`` is a ``torch.distributed``
ProcessGroup (None: the default group) or a :class:`Communicator` from :class:`ThreadGroup` or
:func:`mpi_communicator`. Results are views into one buffer that they keep alive together.
"""

import atexit
import threading
import weakref

import torch
import torch.distributed as dist

from . import _shardgather as _C
from ._shardgather import (  # noqa: F401  (re-exported)
    AbortedError,
    CollectiveTimeout,
    CommAbortedError,
    CommunicationError,
    Communicator,
    CountOverflowError,
    InvalidArgumentError,
    MismatchError,
    OutOfMemoryError,
    RemoteError,
    ShardgatherError,
    __version__,
)

__all__ = [
    "AbortedError",
    "CollectiveTimeout",
    "CommAbortedError",
    "CommunicationError",
    "Communicator",
    "CountOverflowError",
    "InvalidArgumentError",
    "MismatchError",
    "OutOfMemoryError",
    "RemoteError",
    "ShardgatherError",
    "ThreadGroup",
    "communicator",
    "foreach_all_gather",
    "has_mpi",
    "mpi_communicator",
    "mpi_init",
]

# One communicator per group object: its op sequence numbers and poisoned state must persist
# across calls, and it must go away with the group (torch keeps groups alive while they exist).
_comms = weakref.WeakKeyDictionary()
_comms_lock = threading.Lock()


def communicator(group=None):
    """The shardgather Communicator for ``group``.

    ``group`` may be a Communicator (returned as is), a torch.distributed ProcessGroup, or None
    for torch.distributed's default group.
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
    with _comms_lock:
        comm = _comms.get(group)
        if comm is None:
            device = "cpu"
            if dist.get_backend(group) == "nccl":
                device = "cuda:%d" % torch.cuda.current_device()
            comm = _C._process_group_communicator(group, device)
            _comms[group] = comm
    return comm


def foreach_all_gather(
    params,
    group=None,
    params_shapes_across_group=None,
    *,
    timeout=None,
    preflight=True,
):
    """Gathers ``params`` from every rank of ``group`` in one collective.

    Returns a list (one entry per tensor index) of lists (one tensor per rank):
    ``out[i][r]`` is rank r's ``params[i]`` with rank r's shape and dtype. Every rank passes the
    same number of tensors with the same dtype per index; shapes may differ across ranks.

    ``params_shapes_across_group[r][i]``, when given, is the shape of tensor i on rank r: then
    no metadata moves (this rank's row is checked against its tensors). Without it, one
    fixed-size header is exchanged and the shapes travel inside the payload.

    ``timeout`` (seconds) bounds the call: past it, CollectiveTimeout on every rank and the
    communicator is poisoned. ``preflight=False`` (with a hint only) skips the header that makes
    mismatches raise on every rank.

    Errors: TypeError for a non-tensor, ValueError (InvalidArgumentError) for bad arguments,
    MismatchError when ranks disagree, CollectiveTimeout (a TimeoutError) past the deadline.
    The results share one buffer and never require grad.
    """
    comm = communicator(group)
    return _C.foreach_all_gather(params, comm, params_shapes_across_group, timeout, preflight)


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


# The classes are created by the extension; show them under the package users import.
for _cls in (
    AbortedError,
    CollectiveTimeout,
    CommAbortedError,
    CommunicationError,
    Communicator,
    CountOverflowError,
    InvalidArgumentError,
    MismatchError,
    OutOfMemoryError,
    RemoteError,
    ShardgatherError,
):
    _cls.__module__ = __name__
del _cls
