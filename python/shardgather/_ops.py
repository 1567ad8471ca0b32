"""The faces of the C++ operations: ``foreach_all_gather``, ``unshard``, ``reshard`` and their
plans (``AllGatherPlan``, ``UnshardPlan``, ``ReshardPlan``). Each converts its arguments
(tensors to views, a group to a Communicator, keywords to options) and makes the C++ call;
``quantize=`` goes to :mod:`shardgather.quantized`, which builds on these plans (the two are one
layer until issue 39's quantize stage replaces that module's compositions).

Users import these names from ``shardgather``.
"""

from numbers import Real

import torch

from . import _shardgather as _C
from ._agree import check_int, classify
from ._agree import fail_call as _fail_as
from ._groups import _setup_timeout, communicator
from ._shardgather import CountOverflowError, InvalidTypeError
from .quantized import check_keywords


def foreach_all_gather(
    params,
    group=None,
    params_shapes_across_group=None,
    *,
    timeout=None,
    preflight=True,
    strategy="auto",
    async_op=False,
    shapes_across_group=None,
    quantize=None,
):
    """Gathers ``params`` from every rank of ``group`` in one collective.

    Returns a list (one entry per tensor index) of lists (one tensor per rank):
    ``out[i][r]`` is rank r's ``params[i]`` with rank r's shape and dtype. Every rank passes the
    same number of tensors with the same dtype per index; shapes may differ across ranks.

    ``shapes_across_group[r][i]`` (the shapes hint, named as in :class:`AllGatherPlan` and the
    C++ API; ``params_shapes_across_group``, the third positional argument, is the same hint
    under the seed's name: give one), when given, is the shape of tensor i on rank r: then no
    metadata moves (this rank's row is checked against its tensors). Without it, one fixed-size
    header is exchanged and the shapes travel inside the payload.

    ``timeout`` (seconds) bounds the call: past it, CollectiveTimeout on every rank and the
    communicator is poisoned. ``preflight=False`` (with a hint only) skips the header that makes
    mismatches raise on every rank.

    ``strategy`` names how the payload moves (see :class:`AllGatherPlan`); ``"auto"`` means
    ``"direct"`` for a one-shot call, which would otherwise create a node-shared window it uses
    once. ``"hierarchical"`` (ranks on several hosts, more than one on a host) or ``"shared"``
    (one host) create that window for this call; where it cannot apply they move direct. Every
    rank passes the same strategy: with the pre-flight header, a difference raises
    MismatchError and an unknown name InvalidArgumentError on every rank.

    Errors: InvalidTypeError (a TypeError) for a non-tensor, InvalidArgumentError (a ValueError)
    for bad arguments, MismatchError when ranks disagree, CollectiveTimeout (a TimeoutError)
    past the deadline; each is raised on every rank. The results share one buffer and never
    require grad.

    ``async_op=True`` returns a :class:`Work` at once: the gather runs on the communicator's
    progress thread without the GIL, and ``work.wait()`` returns the lists above (or raises the
    call's error, on every rank). Started calls on one group complete in the order they were
    started. The tensors in ``params`` must not be modified until then (the handle keeps them
    alive).

    CUDA tensors (all on one device) are gathered on the device, on the current CUDA stream
    (docs/gpu.md); the results are on that device. Without the shapes hint, the shapes are first
    gathered on the host in one small call of their own.

    ``quantize`` (:mod:`shardgather.quantized`; CUDA tensors or started: an agreement, then
    one call of a quantized :class:`AllGatherPlan` made for it, ``strategy`` "auto" or
    "direct"; blocking on CPU tensors: composed, faster on a host): FP8 on the wire. Tensor i
    of every rank is read as rank r's rows of one tensor (their concatenation
    along dim 0, FSDP's reading), quantized bit-identically to quantizing that tensor whole;
    ``out[i][r]`` is ``(data, scales)``: rank r's FP8 rows and the scales of the blocks they
    touch (a block two ranks' rows share is in both entries), or with a dequantizing spec those
    rows dequantized. A format name or ``Quantize`` applies to every index whose tensors form
    a tensor of 2 or more dims it can quantize; a list or a dict by index names them.
    """
    comm = communicator(group, _setup_timeout(timeout))
    if quantize is not None:  # its agreement checks every argument, on every rank
        from . import quantized

        given = [h for h in (params_shapes_across_group, shapes_across_group) if h is not None]
        return quantized.foreach_all_gather(
            params, comm, given[0] if given else None, quantize, timeout=timeout,
            preflight=preflight, strategy=strategy, async_op=async_op, twice=len(given) > 1)
    params_shapes_across_group = _one_hint(comm, "foreach_all_gather", params_shapes_across_group,
                                           shapes_across_group, preflight, timeout)
    _check_call(comm, "foreach_all_gather", strategy=strategy, preflight=preflight,
                async_op=async_op, timeout=timeout,
                hinted=params_shapes_across_group is not None)
    if params_shapes_across_group is None and _first_is_cuda(params):
        params_shapes_across_group = _gather_shapes(params, comm, timeout,
                                                    "foreach_all_gather: shapes")
    return _C.foreach_all_gather(params, comm, params_shapes_across_group, timeout, preflight,
                                 strategy, async_op)


def _check_call(comm, op, *, strategy="auto", preflight=True, async_op=False, timeout=None,
                hinted=False, stage=""):
    """Fails the call ``op`` on every rank when a keyword has the wrong type, which the
    extension would otherwise refuse on this rank alone (a TypeError before any exchange).
    Values of the right type (a strategy name, a timeout's sign) the call itself checks."""
    problems = ["%s must be a bool, got %s" % (name, type(value).__name__)
                for name, value in (("preflight", preflight), ("async_op", async_op))
                if not isinstance(value, bool)]
    if not isinstance(strategy, str):
        problems.append("strategy must be a str, got %s" % type(strategy).__name__)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, Real)):
        problems.append("timeout must be a number of seconds or None, got %s"
                        % type(timeout).__name__)
    if problems:
        problem = problems[0]
        exchanged = not hinted or preflight is not False
        _C._fail_call(comm, op, problem, True, exchanged, _setup_timeout(timeout), stage)


def _one_hint(comm, op, positional, keyword, preflight, timeout):
    """The shapes hint, given under either name; both at once fails the call on every rank."""
    if positional is not None and keyword is not None:
        _C._fail_call(comm, op, "the shapes hint was given twice (shapes_across_group and "
                      "params_shapes_across_group name the same argument)", False,
                      preflight is not False, _setup_timeout(timeout))
    return keyword if keyword is not None else positional


def _dtypes(params):
    """Each param's dtype, read by a plan's constructor, so that a param that is no tensor is
    its (deferred) error, which the plan's first call raises on every rank."""
    for i, t in enumerate(params):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("params[%d] must be a tensor, got %s" % (i, type(t).__name__))
        yield t.dtype


def _first_is_cuda(params):
    try:
        return len(params) > 0 and isinstance(params[0], torch.Tensor) and params[0].is_cuda
    except TypeError:
        return False


def _gather_shapes(params, comm, timeout, stage="foreach_all_gather: shapes"):
    """Every rank's shapes of ``params``, by a host gather of one int64 tensor per rank
    (``[n, ndim_0, dims_0..., ndim_1, ...]``): the device call then needs no records. ``stage``
    names the step of the operation it is (no other call can pair with it)."""
    row = [len(params)]
    for t in params:
        # A DTensor stands for its local shard (the binding gathers that), not its global shape.
        local = t.to_local() if hasattr(t, "to_local") else t
        shape = list(getattr(local, "shape", ()))
        row += [len(shape)] + shape
    gathered = _C.foreach_all_gather([torch.tensor(row, dtype=torch.int64)], comm, None, timeout,
                                     True, "auto", False, stage)[0]
    shapes = []
    for r, flat in enumerate(gathered):
        values = flat.tolist()
        at, ranks = 1, []
        for _ in range(values[0]):
            ndim = values[at]
            ranks.append(tuple(values[at + 1:at + 1 + ndim]))
            at += 1 + ndim
        shapes.append(ranks)
    return shapes


def _from_plan(name, doc=None):
    """A read-only property reading ``self._plan.<name>`` (the C++ plan); on a plan whose
    construction failed, it raises that error (on this rank: an accessor exchanges nothing)."""
    return property(lambda self: getattr(self._built(), name), doc=doc)


class _Deferred:
    """The argument error a pure constructor (one without a group) found: raised by the plan's
    first collective call on every rank, through the header the peers exchange in that call,
    so one rank's bad argument never leaves its peers waiting for their deadline."""

    def __init__(self, error):
        self.cls, self.message = classify(error)

    def raise_here(self):
        raise self.cls(self.message)

    def fail_call(self, comm, op, preflight, timeout, stage=""):
        """Fails the call the peers are making (``op`` at ``stage``) on every rank, with this
        error's class."""
        _fail_as(comm, op, self.cls, self.message,
                 preflight=preflight if isinstance(preflight, bool) else True,
                 timeout=_setup_timeout(timeout), stage=stage)


def _deferred(build):
    """(build(), None), or (None, the argument error it raised, deferred)."""
    try:
        return build(), None
    except Exception as e:  # noqa: BLE001  (whatever it is, the first execute tells the peers)
        return None, _Deferred(e)


class _PlanState:
    """What both plan classes expose (``self._plan`` is the C++ plan)."""

    strategy = _from_plan(
        "strategy",
        """The requested strategy's name; ``last_stats["strategy"]`` is the one that ran.""",
    )
    @property
    def last_stats(self):
        """Collectives and staged bytes of the last execution, and its strategy (a quantized
        AllGatherPlan's: its reshard's)."""
        return self._built().last_stats
    buffer = _from_plan(
        "buffer",
        "The plan-owned uint8 output buffer (None before the first execution without out).",
    )
    output_bytes = _from_plan("output_bytes")
    world_size = _from_plan("world_size")

    _error = None
    _entries = None  # a quantized plan's own outputs (quantized.destination_parts)
    _preflight = True
    _given_timeout = None
    _stage = ""  # the step of a compound operation its executions are (the package's own plans)

    def _timeout(self):
        return self._plan.timeout if self._plan is not None else None

    def _execute_entries(self, name, args, group, out, async_op):
        """A quantized plan's execute into its own entries (the C++ plan's one call, its
        reshard's, whose outputs and scales they are), remade on the device of ``args`` where
        they are elsewhere; ``out`` is not taken."""
        from .quantized import _refuse, destination_parts, follow_device

        if out is not None:
            _refuse(self, group, "%s(quantize=...): out is not taken (the entries are the "
                    "plan's own)" % name)
        returned = self._entries["returned"]
        moved = follow_device(returned, args, self, group)
        if moved is not returned:
            nested = isinstance(moved[0], list) if moved else False
            self._entries = destination_parts([e for row in moved for e in row] if nested
                                              else moved)
            self._entries["returned"] = moved
        return self._execute("ReshardPlan::execute", args, group, self._entries["destinations"],
                             async_op, scales=self._entries["scales"],
                             returned=self._entries["returned"])

    def _built(self):
        if self._plan is None:
            self._error.raise_here()
        return self._plan

    def _execute(self, op, args, group, outputs, async_op, **extra):
        comm = communicator(group, self._timeout())
        _check_call(comm, op, async_op=async_op, preflight=self._preflight, hinted=True,
                    stage=self._stage)
        if self._plan is None:
            self._error.fail_call(comm, op, self._preflight, self._given_timeout, self._stage)
        return self._plan.execute(args, comm, outputs, async_op, **extra)


class AllGatherPlan(_PlanState):
    """A foreach all-gather built once and executed every step (docs/python.md, "Plans and
    unshard").

    ``AllGatherPlan(dtypes, shapes_across_group, rank)`` is pure (no communication): one
    torch dtype per tensor index and every rank's shapes, ``shapes_across_group[r][i]``.
    :meth:`for_group` builds one from this rank's tensors (collective without the shapes hint).

    ``execute(params)`` returns ``out[i][r]`` (rank r's ``params[i]``) as views into an output
    buffer: ``out`` when given (a contiguous CPU tensor of at least :attr:`output_bytes` bytes,
    any dtype), else a uint8 buffer the plan owns. The plan's buffer and the view tensors over
    it are created by the first execution and **reused by every later one**, so the results of
    execution k are overwritten by execution k + 1 (exactly like FSDP's reused unshard
    buffers): clone what must outlive the next step. The returned lists are the same objects
    too, holding the same tensors over the same bytes, unless the caller edited them (then new
    lists are built and the edited ones left alone).

    ``strategy``: "auto", "direct", "packed", "per_tensor", "shared", "padded" or
    "hierarchical" (how each moves the bytes: docs/design.md, "Strategies"; what "auto" picks:
    docs/benchmarking.md, "Strategies"). ``preflight=False`` skips the fixed-size header that
    makes mismatches raise on every rank. ``timeout`` in seconds.
    A plan is executed by one thread at a time (another thread gets a RuntimeError).

    ``quantize`` (as :func:`foreach_all_gather`'s; CPU or CUDA tensors; the constructor and
    :meth:`for_group`): FP8 on the wire, each execute one call of a quantized
    :class:`ReshardPlan` planned here (docs/quantization.md, "The reshard's quantize stage");
    ``out[i][r]`` is then as foreach_all_gather(quantize=...) gives it, in tensors the plan owns
    (rewritten by every execute); ``out`` is not taken, and ``strategy`` is "auto" or "direct".
    """

    def __init__(self, dtypes, shapes_across_group, rank, *, strategy="auto", preflight=True,
                 timeout=None, quantize=None, _stage=""):
        self._preflight, self._given_timeout, self._stage = preflight, timeout, _stage
        self._entries = None

        def build():
            listed = list(dtypes)
            shapes = [[tuple(s) for s in row] for row in shapes_across_group]
            formats = []
            if quantize is not None:  # the formats resolved against the tensors they form
                from .quantized import gather_entries

                formats, self._entries = gather_entries(listed, shapes, quantize, strategy)
            return _C.AllGatherPlan(listed, shapes, check_int("rank", rank, 0), strategy,
                                    preflight, timeout, formats, _stage)

        self._plan, self._error = _deferred(build)

    @classmethod
    def for_group(cls, params, group=None, *, shapes_across_group=None, strategy="auto",
                  preflight=True, timeout=None, quantize=None):
        """A plan for ``params`` (this rank's tensors) on ``group``, as every plan is built from
        a group. With the shapes hint nothing moves (this rank's row is checked); without it,
        every rank must call for_group (one header and one exchange of shape records). Errors
        raise on every rank; with ``quantize``, at the first execute (as the constructor's)."""
        return cls.create(params, group, strategy=strategy, preflight=preflight, timeout=timeout,
                          shapes_across_group=shapes_across_group, quantize=quantize)

    @classmethod
    def create(cls, params, group=None, params_shapes_across_group=None, *, strategy="auto",
               preflight=True, timeout=None, shapes_across_group=None, quantize=None):
        """:meth:`for_group` under the seed's name (the C++ API's too), which also takes the
        shapes hint third as ``params_shapes_across_group`` (as :func:`foreach_all_gather`:
        give one)."""
        comm = communicator(group, _setup_timeout(timeout))
        params_shapes_across_group = _one_hint(comm, "AllGatherPlan::create",
                                               params_shapes_across_group, shapes_across_group,
                                               preflight, timeout)
        _check_call(comm, "AllGatherPlan::create", strategy=strategy, preflight=preflight,
                    timeout=timeout, hinted=params_shapes_across_group is not None)
        if quantize is not None:  # the pure constructor, with every rank's shapes
            shapes = params_shapes_across_group
            if shapes is None:
                shapes = _gather_shapes(list(params) if isinstance(params, (list, tuple))
                                        else [], comm, timeout, "AllGatherPlan::create: shapes")
            return cls(_dtypes(params), shapes, comm.rank, strategy=strategy,
                       preflight=preflight, timeout=timeout, quantize=quantize)
        plan = cls.__new__(cls)
        plan._preflight, plan._given_timeout = preflight, timeout
        plan._plan = _C.AllGatherPlan.create(params, comm, params_shapes_across_group, strategy,
                                             preflight, timeout)
        return plan

    def execute(self, params, group=None, out=None, *, async_op=False):
        """Gathers ``params`` (matching the plan); returns ``out[i][r]`` views (see the class).
        ``async_op=True`` returns a :class:`Work` whose ``wait()`` returns them."""
        if self._entries is None:
            return self._execute("AllGatherPlan::execute", params, group, out, async_op)
        return self._execute_entries("AllGatherPlan", params, group, out, async_op)

    rank = _from_plan("rank")
    num_tensors = _from_plan("num_tensors")


class UnshardPlan(_PlanState):
    """Shards to full parameters, built once and executed every step (docs/python.md, "Plans
    and unshard").

    ``specs`` is a list of :class:`ShardSpec` (one per parameter): dtype, full shape, shard dim
    (any, negative allowed), per-rank sizes (None: torch.chunk) and the padded local size (as
    FSDP pads; only the real rows travel). ``execute(shards)`` writes the full parameters into
    ``out`` (contiguous tensors of each full shape and dtype; returned as a new list) or, when
    none, into a buffer the plan owns, reused by every execution like :class:`AllGatherPlan`'s:
    the full tensors of execution k are overwritten by execution k + 1.

    ``dst=r``: only rank r receives the full parameters (a gather to one rank, as a checkpoint
    export needs); on the other ranks ``execute`` only sends and returns an empty list.

    ``quantize`` (as :func:`unshard`'s; CPU or CUDA tensors): FP8 on the wire, each execute one
    call of the quantized reshard from every rank's real rows to the full tensors that the C++
    plan holds, planned here (docs/quantization.md, "The reshard's quantize stage"). A quantized
    tensor's entry is ``(data, scales)`` or, with a dequantizing spec, its dequantized tensor,
    in tensors the plan owns (rewritten by every execute, as its buffer is); ``out`` is not
    taken, and ``strategy`` is "auto" or "direct".
    """

    def __init__(self, specs, world_size, rank, *, strategy="auto", preflight=True,
                 timeout=None, dst=None, quantize=None, _stage=""):
        self._preflight, self._given_timeout, self._stage = preflight, timeout, _stage
        self._entries = None

        def build():
            args = (list(specs), check_int("world_size", world_size, 1),
                    check_int("rank", rank, 0), strategy, preflight, timeout,
                    None if dst is None else check_int("dst", dst, 0))
            plan = _C.UnshardPlan(*args, stage=_stage)
            if quantize is not None:  # the specs' sizes filled in first, to resolve against
                from .quantized import resolve, unshard_entries

                specs_q = resolve(quantize, plan.specs)
                plan = _C.UnshardPlan(*args, [None if q is None else q.format for q in specs_q],
                                      _stage)
                # Made here, where running out of memory is an error every rank hears of.
                if plan.quantized:
                    self._entries = (unshard_entries(plan.specs, specs_q) if plan.receives
                                     else unshard_entries([], []))
            return plan

        self._plan, self._error = _deferred(build)

    @classmethod
    def for_group(cls, specs, group=None, *, strategy="auto", preflight=True, timeout=None,
                  dst=None, quantize=None):
        """The plan for this rank of ``group`` (its size and rank), as every plan is built from
        a group. Pure otherwise: nothing moves."""
        comm = communicator(group, _setup_timeout(timeout))
        return cls(specs, comm.size, comm.rank, strategy=strategy, preflight=preflight,
                   timeout=timeout, dst=dst, quantize=quantize)

    def execute(self, shards, group=None, out=None, *, async_op=False, outputs=None):
        """Gathers this rank's ``shards``; returns the full parameters (see the class), into
        ``out`` when given (``outputs`` is its older name: give one). ``async_op=True`` returns
        a :class:`Work` whose ``wait()`` returns them."""
        if out is not None and outputs is not None:
            comm = communicator(group, self._timeout())
            _C._fail_call(comm, "UnshardPlan::execute", "out was given twice (outputs is its "
                          "older name)", False, self._preflight is not False,
                          _setup_timeout(self._given_timeout), self._stage)
        out = out if out is not None else outputs
        if self._entries is None:
            return self._execute("UnshardPlan::execute", shards, group, out, async_op)
        return self._execute_entries("UnshardPlan", shards, group, out, async_op)

    def shard_shape(self, rank, index):
        """The local shard shape rank ``rank`` passes for parameter ``index`` (padded if the
        spec is)."""
        return self._built().shard_shape(rank, index)

    specs = _from_plan("specs", "The specs with their sizes filled in.")


def _layout_tuples(layouts):
    """Layouts as the extension takes them: (dtype, shape, sources, destinations), each box
    (rank, offset, size). A layout is a :class:`shardgather.layouts.TensorLayout` or anything
    with its four attributes; a box, a :class:`shardgather.layouts.Box` or an (offset, size)
    pair. InvalidTypeError for what is no int, CountOverflowError for an int past 64 bits (the
    extension would refuse both with a message naming neither)."""
    def ints(what, values):
        out = []
        for v in values:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise InvalidTypeError("%s must be ints, got %r" % (what, v))
            v = int(v)
            if not -(1 << 63) <= v < 1 << 63:
                raise CountOverflowError("%s: %d does not fit 64 bits" % (what, v))
            out.append(v)
        return tuple(out)

    def boxes(t, side, entries):
        out = []
        for k, (rank, box) in enumerate(entries):
            offset, size = box
            what = "layout %d %s[%d]" % (t, side, k)
            out.append((check_int(what + " rank", rank, 0, (1 << 31) - 1),
                        ints(what + " offset", offset), ints(what + " size", size)))
        return out

    return [(x.dtype, ints("layout %d shape" % t, x.shape), boxes(t, "sources", x.sources),
             boxes(t, "destinations", x.destinations)) for t, x in enumerate(layouts)]


def _device_index(device):
    """(index, None) for execute's ``device``: -1 for the host, a CUDA index; or (None, why
    not), so that the call fails on every rank rather than raise here alone (``"cuda"`` on a
    host where CUDA cannot be used raises inside torch)."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError, ValueError) as e:
        return None, "device must be a cpu or cuda torch.device, got %r (%s)" % (device, e)
    if device.type == "cpu":
        return -1, None
    if device.type != "cuda":
        return None, "device must be a cpu or cuda torch.device, got %r" % (device,)
    if device.index is not None:
        return device.index, None
    try:
        return torch.cuda.current_device(), None
    except Exception as e:  # noqa: BLE001  (AssertionError without CUDA, RuntimeError, ...)
        return None, "device %r: CUDA cannot be used on this host (%s: %s)" % (
            str(device), type(e).__name__, e)


def _moved(name, doc):
    """A figure of what an execution moves: the plan's exchange (for a quantized plan its FP8
    data and scales) plus, for a quantized plan whose blocks are cut across ranks, the row of
    maxima each rank sends every other rank in the call's all-gather."""
    def get(self):
        plan = self._built()
        value = getattr(plan, name)
        row = plan.amax_row_bytes
        if not row:
            return value
        world, hosts = plan.world_size, self._hosts
        if name in ("bytes_sent", "bytes_received"):
            return value + row * (world - 1)
        if name in ("rank_sent", "rank_received"):
            return [v + row * (world - 1) for v in value]
        if not hosts:  # host figures: a row crosses to each rank of another host
            return value
        return [v + row * sum(1 for r in range(world) for q in range(world)
                              if (hosts[r] if name == "host_sent" else hosts[q]) == h
                              and hosts[r] != hosts[q])
                for h, v in enumerate(value)]

    return property(get, doc=doc)


def _run(name, doc):
    """A figure of how an execution runs: the plan's (a quantized plan's: its payload's)."""
    return property(lambda self: getattr(self._built(), name), doc=doc)


class ReshardPlan(_PlanState):
    """Exact-bytes redistribution between two layouts of the same tensors (docs/reshard.md):
    every destination rank receives exactly its boxes' bytes, straight from source ranks that
    hold them, in one exchange per execution.

    ``layouts``: one :class:`shardgather.layouts.TensorLayout` per tensor (global shape, dtype,
    the (rank, Box) pairs each rank holds and wants; build them with the helpers of
    :mod:`shardgather.layouts`: DTensor placements, column/row parallel, fused QKV and
    gate_up, vocabulary-parallel, experts). The constructor is pure (every rank plans the whole
    reshard and keeps its part; an argument error is kept and raised by the first
    :meth:`execute`, on every rank); :meth:`for_group` takes the world, rank and hosts from a
    group.

    ``execute(sources, destinations)``: this rank's source tensors (one per box it holds, in
    :attr:`source_boxes` order) are read; its destination tensors (one per box it wants, in
    :attr:`destination_boxes` order; any strided views, such as rows or columns of a fused
    parameter, but none whose elements share memory) are written in place and returned as a
    new list. Every rank of the group calls it, also one with nothing to send or receive. A
    plan that differs on some rank raises :class:`MismatchError` on every rank before anything
    moves. CPU tensors, or CUDA tensors on a group that moves them (NCCL, or Gloo with CUDA
    tensors): stream-ordered on the current stream, packed and unpacked on the device
    (docs/reshard.md, "On the device"); every rank's tensors of a call are on one device (a
    rank with none passes ``device=``).

    ``hosts`` (rank r's host is ``hosts[r]``, numbered from 0) lets the planner prefer a
    source on the destination's host and, with ``fan_out=True``, send the bytes that several
    ranks of one host want alike across the network once per host: one of them receives each
    piece and forwards it to the others in a second exchange inside the host.

    ``device_bucket_bytes`` (CUDA tensors; default 256 MiB): each exchange moves in
    :attr:`device_parts` parts, so that no rank holds more than about this many bytes of
    staging (sent plus received) at a time.

    ``quantize``: FP8 on the wire (:func:`shardgather.quantized.reshard`), a stage of the
    plan's one call (docs/quantization.md, "The reshard's quantize stage"): planned here, once.
    The byte figures (:attr:`bytes_sent`, :attr:`rank_sent`, ...) are then those of what moves:
    the FP8 data and scales, plus each rank's row of the maxima of blocks a cut falls in, sent
    to every other rank; :attr:`transfers`, :attr:`rounds`, :attr:`forwarding` and
    :attr:`device_parts` are those of its payload (a quantized tensor's data, then its scales,
    as tensors of their own). A quantized plan plans its exchange with the ``hosts`` it is
    given (:meth:`for_group` gives the group's), as a plain plan does.
    """

    def __init__(self, layouts, world_size, rank, *, hosts=None, fan_out=True, strategy="auto",
                 preflight=True, timeout=None, device_bucket_bytes=None, quantize=None,
                 _stage=""):
        self._preflight, self._given_timeout, self._stage = preflight, timeout, _stage
        self._quantize, self._hosts = quantize, None

        def build():
            check_keywords(strategy=strategy, preflight=preflight, timeout=timeout)
            self._hosts = None if hosts is None else list(hosts)
            formats = []
            if quantize is not None:
                from .quantized import Described, resolve

                specs = resolve(quantize, [Described(t.dtype, t.shape) for t in layouts])
                formats = [None if q is None else q.format for q in specs]
            return _C.ReshardPlan(
                _layout_tuples(layouts), check_int("world_size", world_size, 1),
                check_int("rank", rank, 0), self._hosts, bool(fan_out), strategy, preflight,
                timeout,
                None if device_bucket_bytes is None
                else check_int("device_bucket_bytes", device_bucket_bytes, 1), _stage,
                formats)

        # The keywords' kinds first, named (the extension would report them unnamed).
        self._plan, self._error = _deferred(build)

    @classmethod
    def for_group(cls, layouts, group=None, *, fan_out=True, strategy="auto", preflight=True,
                  timeout=None, device_bucket_bytes=None, quantize=None):
        """The plan for this rank of ``group`` (a ProcessGroup, a Communicator or None for the
        default group), whose hosts the planner uses: a byte held by several ranks is sent
        from one on the destination's host where there is one, and (``fan_out``) bytes that
        several ranks of a host want cross to that host once."""
        comm = communicator(group, _setup_timeout(timeout))
        return cls(layouts, comm.size, comm.rank, hosts=comm.hosts or None, fan_out=fan_out,
                   strategy=strategy, preflight=preflight, timeout=timeout,
                   device_bucket_bytes=device_bucket_bytes, quantize=quantize)

    def execute(self, sources, destinations, group=None, *, async_op=False, device=None,
                _returned=None):
        """Moves every rank's sources into every rank's destinations (see the class); returns
        ``destinations`` as a new list, or with ``async_op=True`` a :class:`Work` whose
        ``wait()`` returns it. ``device`` (a torch.device or its name): where this rank's
        tensors are; None takes it from them. A rank with no tensors in a CUDA reshard passes
        its CUDA device (``"cuda"``: the current one). Every argument is checked before anything
        moves; an error on one rank raises on every rank.

        A plan made with ``quantize`` quantizes on send (:func:`shardgather.quantized.reshard`:
        its quantized tensors' destinations are (data, scales) pairs or float32 / bfloat16
        tensors to dequantize into; CPU or CUDA tensors, the quantizer a kernel on the device;
        ``async_op`` as for any plan)."""
        extra = {}
        if self._plan is not None and self._plan.quantized:  # (data, scales) pairs: FP8 data
            from .quantized import destination_parts            # as uint8, and its scales

            extra = destination_parts(destinations)
        if _returned is not None:  # the package's own plans return their own shape
            extra["returned"] = _returned
        index = None
        if device is not None:
            index, problem = _device_index(device)
            if problem is not None:
                comm = communicator(group, self._timeout())
                _C._fail_call(comm, "ReshardPlan::execute", problem, False,
                              self._preflight is not False, _setup_timeout(self._given_timeout),
                              self._stage)
        return self._execute("ReshardPlan::execute", sources, group,
                             extra.pop("destinations", destinations), async_op, cuda_index=index,
                             **extra)

    source_boxes = _from_plan(
        "source_boxes", "This rank's sources in execute's order: (tensor index, offset, size).")
    destination_boxes = _from_plan(
        "destination_boxes",
        "This rank's destinations in execute's order: (tensor index, offset, size).")
    bytes_sent = _moved(
        "bytes_sent", "Bytes this rank sends to other ranks per execution (its local copies, "
        "a box it holds itself, not counted).")
    bytes_received = _moved(
        "bytes_received", "Bytes this rank receives from other ranks per execution (its local "
        "copies not counted).")
    rank_sent = _moved("rank_sent", "Every rank's bytes sent per execution, its local copies "
                       "included (unlike bytes_sent).")
    rank_received = _moved("rank_received", "Every rank's bytes received per execution, its "
                           "local copies included (unlike bytes_received).")
    host_sent = _moved(
        "host_sent", "Every host's bytes sent to other hosts per execution (empty: no hosts).")
    host_received = _moved(
        "host_received", "Every host's bytes received from other hosts per execution.")
    forwarding = _run(
        "forwarding", "Whether the plan fans bytes out inside hosts (more than one exchange).")
    rounds = _run(
        "rounds", "Exchanges per execution: 1, or with the fan-out its waves + 1.")
    device_parts = _run(
        "device_parts", "Parts each exchange moves in on a device (device_bucket_bytes).")

    @property
    def transfers(self):
        """(sends, receives) of this rank: (peer, tensor, source view, destination view, offset,
        size) per transfer, grouped by peer in the plan's order (the first exchange's); for a
        quantized plan, those of its payload (tensor indices of the payload's layouts: a
        quantized tensor's data, then its scales)."""
        return self._built().transfers

    fingerprint = _from_plan("fingerprint")
    rank = _from_plan("rank")


def reshard(sources, destinations, layouts, group=None, *, strategy="auto", preflight=True,
            timeout=None, async_op=False, quantize=None):
    """One-shot :class:`ReshardPlan`: plans ``layouts`` for ``group`` and executes once; returns
    ``destinations`` (written in place). Build a plan instead to reshard every step.
    ``strategy`` ("auto" or "direct") and ``preflight`` are the plan's, as for every other
    operation.

    ``quantize`` (a format name or :class:`Quantize` for every tensor of 2 or more dims it can
    quantize, or a list or dict by index): FP8 on the wire, bit-identical to quantizing each
    full tensor (:func:`shardgather.quantized.reshard`: the sources of a quantized tensor split
    one dim, and its destinations are (data, scales) pairs or float32 / bfloat16 tensors to
    dequantize into; :func:`shardgather.quantized.scale_box` gives a destination's scale
    shape)."""
    plan = ReshardPlan.for_group(layouts, group, strategy=strategy, preflight=preflight,
                                 timeout=timeout, quantize=quantize)
    return plan.execute(sources, destinations, group, async_op=async_op)


def unshard(shards, specs, group=None, *, strategy="auto", preflight=True, timeout=None,
            async_op=False, dst=None, quantize=None):
    """One-shot unshard: the full parameters (new tensors sharing one fresh buffer) from every
    rank's ``shards`` as described by ``specs`` (a list of :class:`ShardSpec`). Shard shapes are
    checked against the specs; a wrong one raises on every rank. ``async_op=True`` returns a
    :class:`Work` whose ``wait()`` returns them. ``dst=r``: only rank r receives the full
    parameters (a gather to one rank, as for :class:`UnshardPlan` and the streams); the others
    only send and get an empty list.

    ``quantize``: FP8 on the wire, quantized on send and bit-identical to quantizing each full
    tensor (:mod:`shardgather.quantized`, docs/quantization.md): a format name or
    :class:`Quantize` for every tensor of 2 or more dims it can quantize, or a list or dict (by
    index) of them.
    A quantized tensor's entry is ``(data, scales)``, or the dequantized tensor when the spec
    asks for a dtype. An agreement, then one call of a quantized :class:`UnshardPlan` made for
    it (``strategy`` "auto" or "direct"); shards passed through as (FP8 data, scales): CPU
    tensors, not with ``async_op``."""
    comm = communicator(group, _setup_timeout(timeout))
    if quantize is not None:  # its agreement checks every argument, on every rank
        from . import quantized

        return quantized.unshard(shards, specs, comm, quantize, strategy=strategy,
                                 preflight=preflight, timeout=timeout, async_op=async_op, dst=dst)
    _check_call(comm, "unshard", strategy=strategy, preflight=preflight, async_op=async_op,
                timeout=timeout, hinted=True)
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int)):
        _C._fail_call(comm, "unshard", "dst must be an int or None, got %s" % type(dst).__name__,
                      True, preflight is not False, _setup_timeout(timeout))
    try:
        specs = list(specs)
    except TypeError as e:
        _C._fail_call(comm, "unshard", "specs must be a list of ShardSpec: %s" % e, True,
                      preflight is not False, _setup_timeout(timeout))
    return _C.unshard(shards, comm, specs, strategy, preflight, timeout, async_op, dst)

