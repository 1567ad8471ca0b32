"""Streaming unshard: a whole model's full parameters, bucket by bucket, in bounded memory.

    with shardgather.unshard_stream(state_dict, specs, group, bucket_bytes=1 << 30) as stream:
        for bucket in stream:               # {name: full tensor}, in the state dict's order
            for name, tensor in bucket.items():
                engine.load(name, tensor)   # bucket k + 1 gathers meanwhile

Each bucket holds at most ``bucket_bytes`` of full tensors (a larger parameter is a bucket of its
own). While the caller holds bucket k, buckets k + 1 .. k + prefetch are gathering. The buckets
reuse prefetch + 1 buffers, allocated once: peak extra memory is about
``(prefetch + 1) x bucket_bytes`` on a rank that receives and nothing on the others.

The tensors of a bucket are views of its buffer: valid until the iteration moves past it, when
the buffer takes a later bucket (``copy=True`` yields clones instead). A stream that ran to its
end can be iterated again (``with stream:`` once more): it gathers the same shards' current
values over the same buffers, so a weight sync every step allocates nothing after its first.

``dst=None``: every rank receives every bucket (weight sync). ``dst=r``: only rank r does (the
others only send, and iterate over empty buckets, so every rank runs the same loop): a
checkpoint export. The gather to one rank moves each byte once, to r.

Errors are raised on every rank alike: specs, bucket sizes, prefetch or dst that differ across
ranks, or a wrong shard, before anything moves; a failure in the middle (a timeout, or the
consumer raising on one rank inside the ``with`` block) ends the stream on every rank with the
same error. Leaving the ``with`` block before the end is reported to the peers the same way.
Without ``with``, a consumer that raises on one rank leaves its peers waiting for their deadline.
"""

import math

import torch

from . import _shardgather as _C
from ._groups import _setup_timeout, communicator
from ._shardgather import InvalidArgumentError, InvalidTypeError, ShardSpec
from ._agree import Agreement, check_int, check_str

__all__ = ["UnshardStream", "unshard_stream"]


def unshard_stream(shards, specs=None, group=None, *, bucket_bytes=1 << 30, prefetch=1,
                   dst=None, copy=False, strategy="auto", timeout=None, quantize=None):
    """A stream of the full parameters of ``shards``, bucket by bucket; see the module.

    ``shards``: a list of this rank's shard tensors with ``specs`` (a list of ShardSpec), or a
    state dict of shards with ``specs`` (a dict with the same keys, or a list in its order), or a
    list or dict of DTensors (``specs=None``: each DTensor's layout is its spec, as for
    :func:`shardgather.full_tensors`). Collective over ``group`` (for DTensors: their mesh).
    Each bucket is a dict from name (the dict's keys, or list indices) to full tensor.

    ``quantize`` (:mod:`shardgather.quantized`): a format name or ``Quantize`` for every tensor
    of 2 or more dims it can quantize, or a dict from name to one. A quantized tensor ``w``
    arrives as ``w`` (float8_e4m3fn) and ``w_scale_inv`` (float32; ``w_scale``, float8_e8m0fnu,
    for mxfp8), bit-identical to quantizing the full tensor; each iteration quantizes the
    shards' current values. Streams yield the raw data and scales (no ``dequantize``). Each
    bucket is then one call of a quantized plan (a personal exchange: ``strategy`` "auto" or
    "direct"), on CPU or CUDA shards; besides its bucket buffers the stream keeps one FP8
    staging, as large as the largest bucket's share of this rank's shards.
    """
    return UnshardStream(shards, specs, group, bucket_bytes=bucket_bytes, prefetch=prefetch,
                         dst=dst, copy=copy, strategy=strategy, timeout=timeout,
                         quantize=quantize)


class UnshardStream:
    """Iterable and context manager over the buckets; see :mod:`shardgather.stream`.

    Building one is collective over the group (one small agreement): every argument error,
    found on any rank, raises the same class on every rank from the constructor, and specs,
    names (a dict's keys, in order) and options that differ raise MismatchError naming the first
    difference; the group stays usable after either.
    """

    def __init__(self, shards, specs=None, group=None, *, bucket_bytes=1 << 30, prefetch=1,
                 dst=None, copy=False, strategy="auto", timeout=None, quantize=None, _checks=(),
                 _options=(), _op="unshard_stream"):
        # _op: the entry point whose steps this stream's own calls are (the export's).
        agreement = Agreement("unshard_stream", _op + ": agreement")
        group = _stream_group(shards, specs, group)
        self._comm = communicator(group, _setup_timeout(timeout))
        names, tensors, specs = agreement.capture(lambda: _inputs(shards, specs, group)) or (
            None, None, None)
        # Per parameter its Quantize spec or None; what each one arrives as (name, dtype view).
        self._specs_q, self._payload = None, None
        if specs is not None:
            self._specs_q, self._payload = agreement.capture(
                lambda: _payload(agreement, quantize, names, tensors, specs)) or (None, None)
        for check in _checks:  # the export's own arguments (its dst domain is narrower)
            agreement.capture(lambda: check(names, self._specs_q))
        agreement.capture(lambda: _check_options(bucket_bytes, prefetch, dst, copy, strategy,
                                                 self._comm.size))
        self._stream = agreement.capture(lambda: _C.UnshardStream(
            list(specs), self._comm.size, self._comm.rank, bucket_bytes, prefetch, dst,
            strategy, timeout, [q and q.format for q in self._specs_q or ()]
            if any(self._specs_q or ()) else []))
        agreement.names = names if isinstance(shards, dict) else None
        agreement.specs = specs
        # _options: a caller's own (the export's writers), agreed on with the stream's.
        agreement.options = [("bucket_bytes", bucket_bytes), ("prefetch", prefetch),
                             ("dst", dst), ("strategy", strategy)] + list(_options)
        if agreement.error is not None:
            agreement.options = [(k, None) for k, _ in agreement.options]
        agreement.run(self._comm, _setup_timeout(timeout))
        self._names = names
        self._tensors = tensors
        self._specs = specs
        self._copy = copy
        self._begun = False
        self._ended = False
        self._at = 0  # buckets yielded
        self.rank = self._comm.rank
        self.dst = dst
        self.total_bytes = sum(_arrives_bytes(sp, q) for sp, q in zip(specs, self._specs_q))

    @property
    def num_buckets(self):
        return self._stream.num_buckets

    @property
    def buffer_bytes(self):
        """Bytes of each of the prefetch + 1 bucket buffers (0 where nothing arrives)."""
        return self._stream.buffer_bytes

    def bucket_names(self, b):
        """The names of bucket ``b``'s tensors (on every rank, also where nothing arrives): a
        quantized parameter ``w``'s data and scales, ``w`` and ``w_scale_inv`` (``w_scale``
        for mxfp8)."""
        first, end = self._stream.bucket_params(b)
        return [name for i in range(first, end) for name, _ in self._payload[i]]

    def __enter__(self):
        self._begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._begun or not self._stream.running:
            return False  # ran to its end, or raised its own error (which every rank has)
        self._ended = True
        if exc_type is None:
            reason = "left the stream after %d of %d buckets" % (self._at, self.num_buckets)
        else:
            reason = "the consumer raised %s: %s" % (exc_type.__name__, exc)
        self._stream.fail(reason, False)  # raises the same error on every rank

    def __iter__(self):
        self._begin()
        return self

    def __next__(self):
        if self._ended:
            raise StopIteration
        try:
            got = self._stream.next()
        except BaseException:
            self._ended = True  # the stream's own error ends it on every rank (or it is still
            raise               # running, after a failure here, and __exit__ tells the peers)
        if got is None:
            self._ended = True
            raise StopIteration
        index, _, full = got
        self._at = index + 1
        if self._copy:
            full = [t.clone() for t in full]
        first, end = self._stream.bucket_params(index)
        entries = [e for i in range(first, end) for e in self._payload[i]]
        return {name: t if dtype is None else t.view(dtype)
                for (name, dtype), t in zip(entries, full)}

    def _begin(self):
        """Begins the stream, or begins it again once it ran to its end (a weight sync every
        step): the buckets reuse the buffers of the first run. A stream that failed raises
        InvalidArgumentError here, on every rank."""
        if self._begun and self._stream.running:
            return
        self._begun, self._ended, self._at = True, False, 0
        try:
            self._stream.begin(self._tensors, self._comm)
        except BaseException:
            self._ended = True
            raise


def _check_options(bucket_bytes, prefetch, dst, copy, strategy, world):
    """The domain of each option, checked on every rank before anything is built."""
    check_int("bucket_bytes", bucket_bytes, 1, (1 << 63) - 1)
    check_int("prefetch", prefetch, 0, (1 << 31) - 2)
    if dst is not None:
        check_int("dst", dst, 0, world - 1, "a rank of the group's %d, or None" % world)
    if not isinstance(copy, bool):
        raise InvalidTypeError("copy must be a bool, got %s" % type(copy).__name__)
    check_str("strategy", strategy)


def _payload(agreement, quantize, names, tensors, specs):
    """(per parameter its Quantize spec or None, per parameter what arrives: [(name, the dtype
    its bytes are viewed as, or None)]): a quantized ``w`` arrives as its FP8 data ``w``
    (float8_e4m3fn) and its scales ``w_scale_inv`` (float32; ``w_scale``, float8_e8m0fnu, for
    mxfp8). The quantize specs are told to ``agreement`` (they must agree across ranks)."""
    from .quantized import resolve, scale_name

    specs_q = resolve(quantize, specs, names)
    if quantize is not None:  # None on one rank only is named as such by the agreement
        agreement.quantize = [None if q is None else [q.format, str(q.dequantize)]
                              for q in specs_q]
    if any(q is not None and q.dequantize for q in specs_q):
        raise InvalidArgumentError("quantize: %s yields the FP8 data and scales as they "
                                   "arrive; dequantize is for unshard" % agreement.what)
    if quantize is not None and any(isinstance(t, tuple) for t in tensors):
        raise InvalidArgumentError("quantize: FP8 data passed through (a (data, scales) shard) "
                                   "is for unshard, not %s" % agreement.what)
    taken = {str(n) for n in names}
    payload = []
    for name, q in zip(names, specs_q):
        if q is None:
            payload.append([(name, None)])
            continue
        scale = scale_name(name, q.format)
        if scale in taken:
            raise InvalidArgumentError("quantize: the scales of %r would be named %r, which is "
                                       "a tensor of its own" % (name, scale))
        payload.append([(name, torch.float8_e4m3fn),
                        (scale, torch.float8_e8m0fnu if q.format == "mxfp8" else None)])
    return specs_q, payload


def _arrives_bytes(spec, q):
    """The bytes a parameter arrives as: its full tensor, or its FP8 data and scales."""
    numel = math.prod(spec.full_shape)
    if q is None:
        return numel * spec.dtype.itemsize
    from .quantized import _scale_shape

    return numel + math.prod(_scale_shape(q.format, spec.full_shape)) * (
        1 if q.format == "mxfp8" else 4)


def _stream_group(shards, specs, group):
    """The group a stream runs over: ``group``, or for DTensors (specs=None) their mesh's. A
    mesh no group can be found for raises here, before any exchange: that is the same on every
    rank of the mesh, and agreeing over another group would wait for ranks outside the mesh.
    Inputs that are no DTensors are found (and agreed on) later, over ``group``."""
    if specs is not None or not isinstance(shards, (dict, list, tuple)):
        return group
    from torch.distributed.tensor import DTensor

    from .dtensor import _mesh_group, _Unsupported

    values = shards.values() if isinstance(shards, dict) else shards
    first = next((t for t in values if isinstance(t, DTensor)), None)
    if first is None:
        return group
    try:
        return _mesh_group(first.device_mesh, group)
    except _Unsupported as e:
        raise InvalidArgumentError("unshard_stream: " + str(e)) from None


def _inputs(shards, specs, group):
    """(names, shard tensors, specs) from any accepted form of the inputs."""
    if not isinstance(shards, (dict, list, tuple)):
        raise InvalidTypeError("shards must be a dict or a list of tensors, got %s"
                               % type(shards).__name__)
    is_dict = isinstance(shards, dict)
    names = list(shards.keys()) if is_dict else list(range(len(shards)))
    tensors = list(shards.values()) if is_dict else list(shards)
    if specs is None:
        return _from_dtensors(names, tensors, group)
    if isinstance(specs, dict):
        missing = [k for k in names if k not in specs]
        have = set(names)
        extra = [k for k in specs if k not in have]
        if missing or extra or len(specs) != len(names):
            raise InvalidArgumentError(
                "specs and shards have other keys: %s"
                % "; ".join(filter(None, [
                    missing and "no spec for %s" % ", ".join(map(repr, missing[:3])),
                    extra and "a spec for %s, which is no shard" % ", ".join(map(repr, extra[:3])),
                ])))
        specs = [specs[k] for k in names]
    specs = list(specs)
    if len(specs) != len(names):
        raise InvalidArgumentError("%d specs for %d shards" % (len(specs), len(names)))
    for i, sp in enumerate(specs):
        if not isinstance(sp, ShardSpec):
            raise InvalidTypeError("the spec of %r is a %s, not a shardgather.ShardSpec"
                                   % (names[i], type(sp).__name__))
    return names, tensors, specs


def _from_dtensors(names, tensors, group):
    """Specs from DTensor layouts. A DTensor replicated on every mesh dim travels from the
    mesh's first rank only (sizes [full, 0, ...]), so every rank gets it in its bucket."""
    from torch.distributed.tensor import DTensor

    from .dtensor import _Unsupported, _layouts, _mesh_group

    if not tensors or not all(isinstance(t, DTensor) for t in tensors):
        raise InvalidArgumentError(
            "specs=None needs a non-empty list or dict of DTensors")
    mesh = tensors[0].device_mesh
    try:
        mesh_group = _mesh_group(mesh, group)
        sharded = {i: (s, spec) for i, s, spec in _layouts(tensors, mesh, mesh_group)}
    except _Unsupported as e:  # the same on every rank of the mesh
        raise InvalidArgumentError(str(e)) from None
    world = torch.distributed.get_world_size(mesh_group)
    me = torch.distributed.get_rank(mesh_group)
    shards, specs = [], []
    for i, t in enumerate(tensors):
        if i in sharded:
            shard, spec = sharded[i]
        else:
            local = t.to_local()
            if local.dim() == 0:
                raise InvalidArgumentError(
                    "%r is a 0-d replicated DTensor, which has no dim to "
                    "stream along" % (names[i],))
            sizes = [local.shape[0]] + [0] * (world - 1)
            shard = local if me == 0 else local.narrow(0, 0, 0)
            spec = ShardSpec(t.dtype, tuple(t.shape), 0, sizes)
        shards.append(shard)
        specs.append(spec)
    return names, shards, specs
