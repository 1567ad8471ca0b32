"""shardgather: gather a list of tensors from every rank in one coalesced collective.

    import shardgather
    out = shardgather.foreach_all_gather(params, group)   # out[i][r]: rank r's params[i]

The whole call runs in C++ with the GIL released. ``group`` is a ``torch.distributed``
ProcessGroup (None: the default group) or a :class:`Communicator` from :class:`ThreadGroup` or
:func:`mpi_communicator`. Results are views into one buffer that they keep alive together.
"""

import torch

from ._build_info import TORCH_VERSION as _BUILT_FOR

# Checked before the extension loads: built against another torch, it would fail to load with
# an undefined C++ symbol, or load and misbehave.
if torch.__version__.split("+")[0] != _BUILT_FOR:
    raise ImportError(
        "shardgather was built against torch %s but this interpreter has torch %s: rebuild it "
        "against this torch (pip install . --no-build-isolation)" % (_BUILT_FOR, torch.__version__)
    )

from . import _shardgather as _C  # noqa: E402, F401  (shardgather._C: the binding, for tools)
from ._shardgather import (  # noqa: F401  (re-exported)
    AUTO_TRIAL_RUNS,
    AbortedError,
    CollectiveTimeout,
    CommAbortedError,
    CommunicationError,
    Communicator,
    CountOverflowError,
    InvalidArgumentError,
    InvalidTypeError,
    MismatchError,
    OutOfMemoryError,
    RemoteError,
    ShardgatherError,
    ShardSpec,
    Work,
    __version__,
    chunk_sizes,
    device_wait,
    set_device_wait,
)

__all__ = [
    "__version__",
    "AbortedError",
    "AllGatherPlan",
    "CollectiveTimeout",
    "CommAbortedError",
    "CommunicationError",
    "Communicator",
    "CountOverflowError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MismatchError",
    "OutOfMemoryError",
    "Quantize",
    "RemoteError",
    "ReshardPlan",
    "ShardSpec",
    "ShardgatherError",
    "ThreadGroup",
    "UnshardPlan",
    "WeightSync",
    "Work",
    "chunk_sizes",
    "communicator",
    "device_wait",
    "foreach_all_gather",
    "full_tensors",
    "reshard",
    "has_mpi",
    "mpi_communicator",
    "mpi_init",
    "set_device_wait",
    "unshard",
    "unshard_stream",
]

from ._groups import (  # noqa: E402  (re-exported)
    ThreadGroup,
    communicator,
    has_mpi,
    mpi_communicator,
    mpi_init,
)
from ._ops import (  # noqa: E402  (re-exported)
    AllGatherPlan,
    ReshardPlan,
    UnshardPlan,
    _gather_shapes,  # noqa: F401  (the Gloo suite checks it)
    foreach_all_gather,
    reshard,
    unshard,
)
from .quantized import Quantize  # noqa: E402
from .weight_sync import WeightSync  # noqa: E402


def full_tensors(tensors, group=None, *, strategy="auto", timeout=None, quantize=None):
    """The full tensors of a list (or dict) of DTensors in one collective; see
    :func:`shardgather.dtensor.full_tensors` (``quantize``: FP8 on the wire,
    :mod:`shardgather.quantized`). (torch.distributed.tensor is imported on first use, not
    with shardgather.)"""
    from .dtensor import full_tensors as gather_full

    return gather_full(tensors, group, strategy=strategy, timeout=timeout, quantize=quantize)


def unshard_stream(shards, specs=None, group=None, *, bucket_bytes=1 << 30, prefetch=1,
                   dst=None, copy=False, strategy="auto", timeout=None, quantize=None):
    """The full parameters of a whole model, bucket by bucket, in bounded memory: see
    :mod:`shardgather.stream` (``quantize``: FP8 on the wire, :mod:`shardgather.quantized`)."""
    from .stream import unshard_stream as stream

    return stream(shards, specs, group, bucket_bytes=bucket_bytes, prefetch=prefetch, dst=dst,
                  copy=copy, strategy=strategy, timeout=timeout, quantize=quantize)


# The classes are created by the extension: show them under the package users import. (The
# Python-defined ones keep their modules, where inspect.getsource finds them.)
for _cls in (
    AbortedError,
    CollectiveTimeout,
    CommAbortedError,
    CommunicationError,
    Communicator,
    CountOverflowError,
    InvalidArgumentError,
    InvalidTypeError,
    MismatchError,
    OutOfMemoryError,
    RemoteError,
    ShardSpec,
    ShardgatherError,
    Work,
):
    _cls.__module__ = __name__
del _cls