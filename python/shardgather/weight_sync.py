"""Weight sync for RL (docs/weight-sync.md): a trainer's shards into an engine's layout, every
step, sending only what changed, with versions, a two-phase commit and readers that never see a
torn tensor.

    ws = WeightSync(layouts, group, mode="staged")      # every rank of group, the same layouts
    ws.sync(step, sources)                                # every rank; sources: this rank's shards
    with ws.read() as (version, tensors): ...             # an engine rank, any thread

One sync, on every rank of the group, is one call of rounds (shardgather/round_call.h): one
pre-flight header exchange, then rounds that each carry every rank's header, so that an error on
one rank is raised on every rank at the next round:

1. **State.** Every rank publishes the version asked for, the version its snapshot (a source) or
   its tensors (a destination) hold, and whether its tensors are mixed (a failed in-place
   apply). All ranks must ask for the same version, not older than any snapshot.
2. **Deltas.** Each source compares the copy of its shards taken when the sync started with its
   snapshot of what it last committed, bucket by bucket along each transfer of the reshard
   plan (src/copies/delta.cc: bitwise; dense bytes, (index, value) pairs or runs, the smallest,
   dense from ``dense_ratio`` up), and sends each destination only the records of the buckets
   that changed in its boxes. A destination whose version is not the snapshot's (new,
   restarted, or left behind by a failed sync) gets its boxes dense, from a destination that
   holds them at the snapshot's version (a replica) where one exists, else from the source.
3. **Apply and vote.** A destination applies every record (staged: into its second buffer;
   in place: into its tensors, under the readers' lock) and checks each bucket's checksum of
   the full new bytes. Buckets that fail are resent dense (twice at most); then every rank
   publishes its vote.
4. **Commit.** All votes good: sources make their copy the snapshot, staged destinations
   switch buffers, every rank's version becomes the new one. Anything else: nothing commits,
   and every rank raises. The next sync is a delta from the last committed snapshot (dense to
   whoever is not at it).
"""

import collections
import threading
import time
from contextlib import contextmanager

import torch

from . import _shardgather as _C
from ._groups import _setup_timeout, communicator
from ._ops import ReshardPlan
from ._shardgather import (InvalidArgumentError, InvalidTypeError, MismatchError, RemoteError,
                           ShardgatherError)

# A sparse record is sent while it is at most this fraction of the dense bytes. Measured
# (bench/python/bench_weight_sync.py --dense-ratio 0 against 1, docs/weight-sync.md, "Where dense
# wins"): on 1 Gbit/s links sparse records stayed faster end to end than dense ones up to where
# they are as large (30% random density in bf16), so the encoder goes by size alone.
DENSE_RATIO = 1.0
# A segment's header (delta.h: origin, the records' length and checksum).
_SEGMENT = 24
_NONE = -1
_INVALID = -2  # a buffer a failed sync wrote part of
_MAX_VERSION = (1 << 63) - 1  # versions travel as int64


class ReadersHeldError(ShardgatherError):
    """A sync could not write this rank's tensors: :meth:`WeightSync.read` blocks held the
    buffer it needs for longer than the sync may wait (half its timeout). Raised on that rank
    by the sync; its peers raise :class:`shardgather.RemoteError` from the same sync (the vote
    tells them), nothing is committed anywhere, and the group stays usable: sync again."""


def _slices(outer, inner):
    """Index of box ``inner`` (offset, size) inside a view of box ``outer``."""
    return tuple(slice(o - p, o - p + n) for o, p, n in zip(inner[0], outer[0], inner[1]))


def _numel(size):
    n = 1
    for s in size:
        n *= s
    return n


def _contains(outer, inner):
    return all(p <= o and o + n <= p + m
               for o, n, p, m in zip(inner[0], inner[1], outer[0], outer[1]))


class _Readers:
    """Which buffer readers hold, so that a sync never writes bytes a reader is reading: per
    buffer a count of readers; a writer waits (bounded) until its buffer has none, and in place
    (one buffer) new readers wait while it writes."""

    def __init__(self, buffers):
        self._cond = threading.Condition()
        self._count = [0] * buffers
        self._writing = None
        self.active = 0

    @contextmanager
    def reading(self, label=None):
        """Holds the active buffer; yields (its index, ``label(index)`` read under the lock)."""
        with self._cond:
            while self._writing == self.active:
                self._cond.wait()
            held = self.active
            self._count[held] += 1
            tag = None if label is None else label(held)
        try:
            yield held, tag
        finally:
            with self._cond:
                self._count[held] -= 1
                self._cond.notify_all()

    @contextmanager
    def writing(self, buffer, timeout):
        deadline = time.monotonic() + timeout
        with self._cond:
            self._writing = buffer
            try:
                while self._count[buffer]:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ReadersHeldError(
                            "weight sync: readers held buffer %d for more than %.3g s; it "
                            "cannot be written" % (buffer, timeout))
                    self._cond.wait(left)
            except BaseException:
                self._writing = None
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._writing = None
                self._cond.notify_all()

    def label(self, labels, buffer, value):
        """Sets a buffer's version label where readers read it (under the lock)."""
        with self._cond:
            labels[buffer] = value

    def switch(self):
        with self._cond:
            self.active = 1 - self.active
            self._cond.notify_all()


def _started(comm, run):
    """(a :class:`shardgather.Work` whose ``wait()`` returns ``run()``'s result or raises its
    error, the thread running it): a started sync runs on a thread of its own."""
    outcome = {}

    def body():
        try:
            outcome["value"] = run()
        except BaseException as e:  # noqa: B902  (handed to wait())
            outcome["error"] = e
        finally:
            done()

    def result():
        if "error" in outcome:
            raise outcome.pop("error")
        return outcome.get("value")

    work, done = _C._thread_work(comm, result)
    thread = threading.Thread(target=body, daemon=True)
    try:
        thread.start()
    except BaseException:  # noqa: B902  (no thread: the work must not wait for one)
        done()
        raise
    return work, thread


_REBUILD_KEYWORDS = ("mode", "destinations", "chunk_bytes", "bucket_bytes", "dense_ratio",
                     "timeout")


class WeightSync:
    """Sync of one model's tensors from source ranks (a trainer's shards) to destination ranks
    (an engine's boxes) of one group, by version (module docstring; docs/weight-sync.md).

    ``layouts``: as for :class:`shardgather.ReshardPlan` (one TensorLayout per tensor, the same
    on every rank). ``group``: a ProcessGroup, a Communicator, or None (the default group),
    used by this object only while a sync runs; give it a group of its own (a sync may run on
    a thread while the trainer uses its group).

    ``mode``: where destinations receive.
    - ``"staged"``: this object holds two buffers per destination box; a sync writes the one
      readers do not see and switches on commit. Readers (:meth:`read`) always see one
      committed version whole.
    - ``"in_place"``: ``destinations`` (this rank's views, one per destination box in
      :attr:`destination_boxes` order, any strides) are written in place while a sync applies
      (:attr:`mixed` names their tensors meanwhile); :meth:`read` and :meth:`fence` wait for
      the apply to end.

    ``chunk_bytes``: the unit of change detection, encoding and checksum (default 1 MiB; every
    rank passes the same). ``bucket_bytes`` is its older name (give one): a bucket is what the
    stream and the export hold at a time, and the device reshard's staging is
    ``device_bucket_bytes``.
    ``dense_ratio``: see :data:`DENSE_RATIO`. ``timeout``: each sync's deadline, in seconds (one
    for the whole sync, every round included).

    Memory, stated in advance (:meth:`memory`): a source holds two copies of its shards (the
    committed snapshot and the copy a running sync reads, so the trainer may write its shards
    as soon as :meth:`start` returns); a staged destination two buffers of its boxes; an
    in-place one none, or for a CUDA destination a host mirror of it.

    CUDA tensors: sources are copied to the host by :meth:`start` (after the work queued on
    the current stream); an in-place CUDA destination is written through its host mirror, each
    transfer a sync wrote copied to the device before the sync commits (a staged sync's
    buffers are host tensors). The diff, the records and their apply run on the host. Messages: a delta's records, dense at worst (a new destination's boxes).

    The constructor is pure (nothing is exchanged): an argument error found there (layouts,
    ``mode``, ``destinations``, ``chunk_bytes``, ``dense_ratio``, ``timeout``) is kept and
    raised by the first :meth:`sync`, on every rank, with its class (docs/errors.md), as every
    argument error of :meth:`sync` and :meth:`start` is. :attr:`version`: the last version this
    rank committed, on every rank (a trainer's too); -1 before the first commit.

    Threading: one sync at a time per object; :meth:`read`, :meth:`fence`, :attr:`version`
    from any thread.
    """

    _mirror_host = False  # test hook: in place, host destinations mirrored as CUDA ones are

    def __init__(self, layouts, group=None, *, mode="staged", destinations=None,
                 chunk_bytes=None, dense_ratio=DENSE_RATIO, timeout=None, bucket_bytes=None,
                 _state=None):
        self.comm = communicator(group, _setup_timeout(timeout))
        self._round_timeout = _setup_timeout(timeout)
        self._call = None  # the running sync's call of rounds
        self._recv = torch.empty(0, dtype=torch.uint8)  # the rounds' receive buffer, reused
        self._outgoing = {}  # peer -> its message (_C._DeltaMessage), reused
        self.timeout = _setup_timeout(timeout) or 300.0
        # Readers holding a buffer a sync must write delay it by at most this, so that the
        # rank still reaches the vote before its peers' deadline.
        self._reader_wait = 0.5 * self.timeout
        self.layouts, self.mode = [], "staged"
        self.source_boxes, self.destination_boxes, self._sends, self._receives = [], [], [], []
        self.chunk_bytes, self.fingerprint = 0, 0
        self._init_sources(None)
        self._init_destinations(None, None)
        self.last_stats = None
        self._corrupt = None  # test hook: (sender, peer, message) -> None, may flip bytes
        self._settle = False  # bench hook: a sync point before the payload exchange
        self._thread = None  # the last started sync's
        # An argument wrong on this rank only is raised by the first sync, on every rank (the
        # constructor is pure: the others cannot know).
        self._error = None
        try:
            self._build(layouts, mode, destinations, _chunk_bytes(chunk_bytes, bucket_bytes),
                        dense_ratio, timeout, _state)
        except Exception as e:  # noqa: BLE001  (whatever it is, the first sync tells the peers)
            self._error = e

    @property
    def bucket_bytes(self):
        """:attr:`chunk_bytes` under its older name."""
        return self.chunk_bytes

    def _build(self, layouts, mode, destinations, chunk_bytes, dense_ratio, timeout, state):
        from ._agree import check_int

        if mode not in ("staged", "in_place"):
            raise InvalidArgumentError("mode must be 'staged' or 'in_place', got %r" % (mode,))
        self.chunk_bytes = check_int(*chunk_bytes, 8)
        if isinstance(dense_ratio, bool) or not isinstance(dense_ratio, (int, float)):
            raise InvalidTypeError("dense_ratio must be a number, got %s"
                                   % type(dense_ratio).__name__)
        if not 0.0 <= dense_ratio <= 1.0:
            raise InvalidArgumentError("dense_ratio must be in [0, 1], got %r" % (dense_ratio,))
        self.layouts, self.mode, self.dense_ratio = list(layouts), mode, float(dense_ratio)
        world, rank = self.comm.size, self.comm.rank
        self._hosts = list(self.comm.hosts or [0] * world)

        def plan(r):
            return ReshardPlan(self.layouts, world, r, hosts=self._hosts, fan_out=False,
                               timeout=timeout)

        self._plan_for = plan
        self._plans = {rank: plan(rank)}
        self.plan = self._plans[rank]
        self.fingerprint = self.plan.fingerprint
        self.source_boxes = [(t, tuple(o), tuple(n)) for t, o, n in self.plan.source_boxes]
        self.destination_boxes = [(t, tuple(o), tuple(n))
                                  for t, o, n in self.plan.destination_boxes]
        self._sends, self._receives = self.plan.transfers
        self._pair_cache = {}
        self._init_sources(state)
        self._init_destinations(destinations, state)

    # --- state -------------------------------------------------------------------------------

    def _key(self, box):
        """What survives a rebuild on a new group or layout: (tensor, offset, size, dtype)."""
        t, offset, size = box
        return (t, tuple(offset), tuple(size), self.layouts[t].dtype)

    def _init_sources(self, state):
        """A source's state is per box it sends (its transfers' boxes, each once however many
        destinations want it), packed: the sync's copy packs them as it copies, and the diff
        and encode then read contiguous memory. Keyed by (tensor, offset, size), which a
        rebuild on another group or layout keeps."""
        self._boxes = {}  # key -> (source view, index in the view)
        for tr in self._sends:
            key = self._key((tr[1], tr[4], tr[5]))
            if key not in self._boxes:
                box = self.source_boxes[tr[2]][1:]
                self._boxes[key] = (tr[2], _slices(box, (tr[4], tr[5])))
        self._snapshot, self._pending = {}, {}
        self.snapshot_version = _NONE
        if state is not None and state["snapshot_version"] != _NONE:
            kept = state["snapshot"]
            if all(key in kept for key in self._boxes):
                self._snapshot = {key: kept[key] for key in self._boxes}
                self.snapshot_version = state["snapshot_version"]

    def _init_destinations(self, destinations, state):
        shapes = [(self.layouts[t].dtype, n) for t, _, n in self.destination_boxes]
        self.version, self._mixed, self._writing = _NONE, set(), set()
        if self.mode == "in_place":
            try:
                destinations = list(destinations or [])
            except TypeError:
                raise InvalidTypeError("in_place: destinations must be a list of tensors, got "
                                       "%s" % type(destinations).__name__) from None
            if len(destinations) != len(shapes):
                raise InvalidArgumentError(
                    "in_place: rank %d has %d destination boxes but %d destinations were given "
                    "(an in-place sync, and its rebuild, take destinations=)"
                    % (self.comm.rank, len(shapes), len(destinations)))
            for v, (d, (dtype, size)) in enumerate(zip(destinations, shapes)):
                if not isinstance(d, torch.Tensor):
                    raise InvalidTypeError("in_place: destination %d of rank %d must be a "
                                           "torch.Tensor, got %s"
                                           % (v, self.comm.rank, type(d).__name__))
                if (d.dtype != dtype or tuple(d.shape) != tuple(size)
                        or d.device.type not in ("cpu", "cuda")):
                    raise InvalidArgumentError(
                        "in_place: destination %d of rank %d is %s %s on %s; its box wants "
                        "%s %s on the host or a CUDA device"
                        % (v, self.comm.rank, d.dtype, tuple(d.shape), d.device, dtype,
                           tuple(size)))
                if _C._overlaps_itself(d):
                    raise InvalidArgumentError(
                        "in_place: destination %d of rank %d: its elements share memory (a "
                        "stride of 0, or strides that map two indices to one element): a write "
                        "would land twice" % (v, self.comm.rank))
            self._buffers = [destinations]
            self._readers = _Readers(1)
        else:
            self._buffers = [[torch.zeros(size, dtype=dtype) for dtype, size in shapes]
                             for _ in range(2)]
            self._readers = _Readers(2)
        self._buffer_version = [_NONE] * len(self._buffers)
        self._touched_last = None  # transfers the last commit wrote (staged refresh)
        # ... and its records, where they were at most a quarter of the boxes' bytes
        self._last_records, self._applied = None, None
        self._record_room = sum(b.numel() * b.element_size() for b in self._buffers[0]) // 4
        self._replaced_version = _INVALID  # the version of the buffer that commit replaced
        if state is not None and state["version"] != _NONE:
            kept = state["buffers"]
            if all(self._key(b) in kept for b in self.destination_boxes):
                for v, b in enumerate(self.destination_boxes):
                    self._buffers[0][v].copy_(kept[self._key(b)])
                self.version = self._buffer_version[0] = state["version"]
        self._mirror = self._mirrors()

    def _mirrors(self):
        """In place: per destination the tensor a sync applies records to: itself on the host,
        or for a CUDA tensor a host copy of it (pinned), whose transfers a sync writes are then
        copied to the device (the records are applied by the host; docs/weight-sync.md)."""
        if self.mode != "in_place":
            return None
        mirror = []
        for d in self._buffers[0]:
            if d.device.type == "cpu" and not self._mirror_host:
                mirror.append(d)
                continue
            m = torch.empty(d.shape, dtype=d.dtype, pin_memory=d.device.type == "cuda")
            m.copy_(d)
            mirror.append(m)
        return mirror

    def _push(self, written):
        """In place: the transfers ``written`` copied from their host mirrors to the CUDA
        destinations (the caller holds the writers' side of the readers)."""
        for k in sorted(written):
            dv = self._receives[k][3]
            if self._mirror[dv] is not self._buffers[0][dv]:
                box = self.destination_boxes[dv][1:]
                where = _slices(box, self._receives[k][4:6])
                self._buffers[0][dv][where].copy_(self._mirror[dv][where])

    def rebuild(self, layouts, group=None, **kwargs):
        """The same sync over a changed set of ranks (a new or restarted engine, a new group):
        a new WeightSync for ``layouts`` on ``group`` that keeps this one's snapshot and
        committed tensors for the boxes both layouts share (matched by tensor and box, not by
        rank). A rank new to the group constructs a WeightSync instead; its first sync fills it
        from replicas where they exist. Pure, as the constructor: an argument error (an unknown
        keyword included) is raised by the first sync, on every rank. ``kwargs`` are the
        constructor's (``mode``, ``destinations``, ``chunk_bytes``, ``dense_ratio``,
        ``timeout``), this object's by default, except ``destinations``: an in-place sync's
        rebuild takes its views again (the same ones, or the new layout's)."""
        # Tensors an in-place apply left written but uncommitted hold no version a peer knows:
        # the new object starts them behind (dense), as this one would have.
        version = _NONE if self._mixed else self.version
        state = {"snapshot_version": self.snapshot_version, "version": version,
                 "snapshot": self._snapshot,
                 "buffers": {self._key(b): t for b, t in
                             zip(self.destination_boxes, self._buffers[self._readers.active])}}
        unknown = sorted(set(kwargs) - set(_REBUILD_KEYWORDS))
        kwargs = {k: v for k, v in kwargs.items() if k in _REBUILD_KEYWORDS}
        kwargs.setdefault("mode", self.mode)
        if "bucket_bytes" not in kwargs:
            kwargs.setdefault("chunk_bytes", self.chunk_bytes)
        kwargs.setdefault("dense_ratio", self.dense_ratio)
        kwargs.setdefault("timeout", self.timeout)
        out = WeightSync(layouts, group, _state=state, **kwargs)
        if unknown and out._error is None:  # raised by its first sync, on every rank
            out._error = InvalidTypeError("rebuild() got an unexpected keyword argument %r (it "
                                          "takes %s)" % (unknown[0], ", ".join(_REBUILD_KEYWORDS)))
        return out

    def memory(self):
        """Bytes this object holds between syncs, stated in advance:
        - ``sources``: two copies (the snapshot, the sync's copy) of each box this rank sends,
          which is its shards' bytes twice when destination boxes do not overlap;
        - ``destinations``: two buffers of its boxes staged; in place none, but a host mirror
          of each CUDA destination (the records are applied on the host);
        - ``records``: staged, the last commit's records kept for the catch-up, at most a
          quarter of the boxes (and another quarter while a sync runs);
        - ``exchange``: the receive buffer the exchange keeps for reuse, as large as the most
          bytes received in one round so far (a dense round: the boxes' bytes).
        - ``messages``: the buffers of the messages this rank sends, kept for reuse: the
          records it sent each peer in the last sync, up to its boxes' bytes once per
          destination that received them dense, in buffers grown by doubling (one more than 4
          times its last message is let go by the next sync)."""
        def nbytes(boxes):
            return sum(_numel(n) * self.layouts[t].dtype.itemsize for t, _, n in boxes)

        staged = self.mode == "staged"
        boxes = nbytes(self.destination_boxes)
        mirrored = sum(m.numel() * m.element_size()
                       for m, d in zip(self._mirror or [], self._buffers[0]) if m is not d)
        return {"sources": 2 * nbytes([key[:3] for key in self._boxes]),
                "destinations": (2 if staged else 0) * boxes + mirrored,
                "records": boxes // 4 if staged else 0,
                "exchange": self._recv.numel(),
                "messages": sum(m.held_bytes for m in list(self._outgoing.values()))}

    # --- readers -----------------------------------------------------------------------------

    @contextmanager
    def read(self):
        """``with ws.read() as (version, tensors):`` this rank's destination tensors (in
        :attr:`destination_boxes` order) and the version they hold, whole: no sync writes them
        until the block ends (a sync that needs them waits, up to its timeout). In place, a
        tensor a failed apply left mixed is in :attr:`mixed`."""
        with self._readers.reading(self._buffer_version.__getitem__) as (held, version):
            yield version, list(self._buffers[held])

    def fence(self):
        """Waits until no sync is writing this rank's tensors; returns the version they hold
        (in place, ``mixed`` names any a failed apply left half written)."""
        with self.read() as (version, _):
            return version

    @property
    def mixed(self):
        """Indices of the tensors (into ``layouts``) that may hold two versions at once now:
        those an in-place apply is writing, and those a failed one left half written (the next
        sync sends them dense). Always empty when staged."""
        return sorted(self._writing | self._mixed)

    # --- the sync ----------------------------------------------------------------------------

    def sync(self, version, sources=()):
        """One sync at ``version`` (an int, the same on every rank; not older than the last
        committed one: the same version again only brings new or restarted destinations up to
        it). ``sources``: this rank's shards, one per :attr:`source_boxes` entry. Blocking;
        returns this rank's stats."""
        return self.start(version, sources).wait()

    def start(self, version, sources=()):
        """:meth:`sync`, started: returns once this rank's sources are copied (the trainer may
        write them from then on), the rest runs on a thread of its own; a
        :class:`shardgather.Work` whose ``wait()`` returns the stats (Ctrl-C in it aborts the
        group, as for every Work). A sync still running on this object is waited for first
        (its outcome stays in its own work)."""
        if self._thread is not None:
            self._thread.join()
        work, self._thread = self._start(version, sources)
        return work

    def _start(self, version, sources):
        try:
            if self._error is not None:
                raise self._error
            version = self._check_sources(version, sources)
        except Exception as e:  # noqa: BLE001  (raised on every rank by the state round)
            error = e
            return _started(self.comm, lambda: self._fail(error, None))
        fresh = version != self.snapshot_version
        t0 = time.perf_counter()
        if fresh:
            for key, (v, index) in self._boxes.items():
                region = sources[v][index]
                if key not in self._pending:
                    self._pending[key] = torch.empty(region.numel(), dtype=region.dtype)
                self._pending[key].view(region.shape).copy_(region)
        self._copy_seconds = time.perf_counter() - t0
        return _started(self.comm, lambda: self._run(version, fresh))

    def _rounds(self):
        """A sync's call of rounds: the state row is the widest (7 values)."""
        return _C._RoundCall(self.comm, "WeightSync::sync", "WeightSync.sync",
                             self._round_timeout, 7)

    def _fail(self, error, round_name):
        """This rank's error, raised on every rank (naming this rank, with its class) by the
        round its peers are in: ``round_name``, or the call's opening when None (a sync that
        failed before it began)."""
        from ._agree import _CORE_NAMES, classify

        cls, message = classify(error)
        code, text = _CORE_NAMES.get(cls, "InvalidArgument"), "WeightSync.sync: " + message
        if round_name is None:  # the sync's call is made for it, and its opening raises it
            self._call = self._rounds()
            self._call.fail(code, text)
            self._call.open("state")
        self._call.fail(code, text)
        self._call.rows(torch.zeros(0, dtype=torch.int64), round_name)

    def _rows(self, row, name):
        """Every rank's int64 ``row`` as a [world, width] table (zero-padded: the width is
        7, or the world size + 1 where that is more), of round ``name``."""
        return self._call.rows(row, name)

    def _messages(self, outgoing, name):
        """(peer -> the bytes it sent here, the [world, world] size table) of one round of
        messages; the received bytes are views of one buffer, valid until the next round."""
        received, sizes, self._recv = self._call.messages(outgoing, name, self._recv)
        return received, sizes

    def _check_sources(self, version, sources):
        from ._agree import check_int

        version = check_int("version", version, 0, _MAX_VERSION)
        try:
            sources = list(sources)
        except TypeError:
            raise InvalidTypeError("sources must be a list of tensors, got %s"
                                   % type(sources).__name__) from None
        if len(sources) != len(self.source_boxes):
            raise InvalidArgumentError("rank %d has %d source boxes but %d sources were given"
                                       % (self.comm.rank, len(self.source_boxes), len(sources)))
        for v, (s, (t, _, size)) in enumerate(zip(sources, self.source_boxes)):
            dtype = self.layouts[t].dtype
            if not isinstance(s, torch.Tensor):
                raise InvalidTypeError("source %d of rank %d (tensor %d) must be a torch.Tensor, "
                                       "got %s" % (v, self.comm.rank, t, type(s).__name__))
            if (s.dtype != dtype or tuple(s.shape) != tuple(size)
                    or s.device.type not in ("cpu", "cuda")):
                raise InvalidArgumentError(
                    "source %d of rank %d (tensor %d) must be a host or CUDA %s tensor of "
                    "shape %s, got %s" % (v, self.comm.rank, t, dtype, tuple(size),
                                          _describe(s)))
        return version

    def _run(self, version, fresh):
        began = time.perf_counter()
        self._call = self._rounds()
        self._call.open("state")
        states = self._exchange_state(version)
        try:
            outgoing, stats = self._encode(version, fresh, states)
        except Exception as e:  # noqa: B902  (raised on every rank: the peers wait in the next round)
            self._fail(e, "settle" if self._settle else "payload sizes")
        if self._settle:  # a bench measuring the transfer alone: every rank ready first
            self._rows(torch.zeros(1, dtype=torch.int64), "settle")
        t0 = time.perf_counter()
        received, sizes = self._messages(outgoing, "payload")
        stats["exchange_seconds"] = time.perf_counter() - t0
        rank = self.comm.rank
        # to and from other ranks (what crosses a link); this rank's own records are not counted
        stats["bytes_received"] = int(sizes[:, rank].sum() - sizes[rank, rank])
        stats["bytes_sent"] = int(sizes[rank].sum() - sizes[rank, rank])
        t0 = time.perf_counter()
        touched = self._apply_and_vote(received, version, fresh, stats)
        stats["apply_seconds"] = time.perf_counter() - t0
        self._commit(version, fresh, touched)
        stats["seconds"] = time.perf_counter() - began
        stats["copy_seconds"] = self._copy_seconds
        self.last_stats = stats
        return stats

    def _exchange_state(self, version):
        fingerprint = _signed(self.fingerprint)
        held = self.version if self.destination_boxes else _NONE  # a destination's tensors'
        row = torch.tensor([version, self.snapshot_version, held,
                            1 if self._mixed else 0,
                            (1 if self.source_boxes else 0) | (2 if self.destination_boxes else 0),
                            fingerprint, self.chunk_bytes], dtype=torch.int64)
        table = self._rows(row, "state")
        for column, what in ((5, "layouts (the plan's fingerprint)"), (6, "chunk_bytes")):
            values = table[:, column].tolist()
            if len(set(values)) != 1:
                r = next(r for r, v in enumerate(values) if v != values[0])
                raise MismatchError("WeightSync.sync: the %s differ: %d on rank 0, %d on rank %d"
                                    % (what, values[0], values[r], r))
        asked = table[:, 0].tolist()
        if len(set(asked)) != 1:
            r = next(r for r, v in enumerate(asked) if v != asked[0])
            raise InvalidArgumentError("WeightSync.sync: rank %d asked for version %d, rank 0 "
                                       "for %d" % (r, asked[r], asked[0]))
        newest = int(table[:, 1].max())
        if version < newest:
            r = int(table[:, 1].argmax())
            raise InvalidArgumentError(
                "WeightSync.sync: version %d is older than rank %d's committed snapshot %d"
                % (version, r, newest))
        return table

    # --- sending ---------------------------------------------------------------------------

    def _extent(self, tr):
        """(elements, element size) of a transfer (peer, tensor, src view, dst view, offset,
        size): what numbers its buckets within a pair (delta.h's pair_buckets)."""
        return _numel(tr[5]), self.layouts[tr[1]].dtype.itemsize

    def _receives_of(self, d, s):
        """The transfers destination ``d`` receives from source ``s`` (d's plan, built once)."""
        if d not in self._plans:
            self._plans[d] = self._plan_for(d)
        return [tr for tr in self._plans[d].transfers[1] if tr[0] == s]

    def _encode(self, version, fresh, states):
        rank = self.comm.rank
        stats = {"version": version, "records": 0, "dense_records": 0, "changed_sent": 0,
                 "changed_received": 0, "resent_buckets": 0, "encode_seconds": 0.0,
                 "from_sources": 0, "from_replicas": 0}
        t0 = time.perf_counter()
        writer = _Writer(self._outgoing, self.chunk_bytes)
        self._encode_sources(fresh, states, writer, stats)
        self._encode_replicas(states, writer, stats)
        stats["encode_seconds"] = time.perf_counter() - t0
        messages = writer.finish()
        if self._corrupt is not None:
            for peer, m in messages.items():
                self._corrupt(rank, peer, m)
        return messages, stats

    def _is_current(self, states, d, version_of_source):
        return int(states[d, 2]) == version_of_source and not int(states[d, 3])

    def _encode_sources(self, fresh, states, writer, stats):
        """This rank's records as a source: per destination, the buckets of its transfers that
        changed (nothing on a sync at the snapshot's version), dense where the destination is
        not at the snapshot and no replica sends it."""
        snap_v = self.snapshot_version
        by_dest = {}
        for k, tr in enumerate(self._sends):
            by_dest.setdefault(tr[0], []).append(k)
        encoded = {}  # what a segment holds -> the destination it was encoded for
        for d, ks in by_dest.items():
            current = self._is_current(states, d, snap_v) and snap_v != _NONE
            replicas = {} if current else self._replica_map(states, d, self.comm.rank)
            transfers = [self._sends[k] for k in ks]
            # Replicas of one engine rank want the same boxes: their segments are the same
            # bytes (bucket ids are the pair's), encoded once.
            what = (current, tuple(sorted(replicas)),
                    tuple(self._key((tr[1], tr[4], tr[5])) for tr in transfers))
            if what in encoded:
                writer.copy(d, encoded[what])
                continue
            encoded[what] = d
            writer.segment(d, self.comm.rank)
            items = []
            for j, tr in enumerate(transfers):
                after, before = self._regions(tr, fresh)
                if current or j in replicas:
                    # a delta; nothing where the destination holds the snapshot's bytes already
                    items.append(((after, before) if fresh else (None, None))
                                 + self._extent(tr))
                else:
                    items.append((after, None) + self._extent(tr))
            writer.pair(d, items, self.dense_ratio, stats)

    def _regions(self, tr, fresh):
        """(after, before) of one transfer's box, flat: the sync's copy (the snapshot, on a
        sync at its version) and the snapshot (None before the first commit)."""
        key = self._key((tr[1], tr[4], tr[5]))
        before = self._snapshot.get(key)
        return (self._pending[key] if fresh else before), before

    def _replica_map(self, states, d, s):
        """For destination ``d`` not at source ``s``'s snapshot: which of s's transfers to d a
        replica sends instead (index into the pair's transfers -> replica rank): a destination
        at that snapshot, unmixed, holding the whole box; one on d's host first, then the one
        with the fewest bytes given so far, then the lowest rank. The same on every rank."""
        snap_v = int(states[s, 1])
        if snap_v == _NONE:
            return {}
        holders = []  # (rank, tensor, box)
        for t, layout in enumerate(self.layouts):
            for r, box in layout.destinations:
                if r != d and self._is_current(states, r, snap_v):
                    holders.append((r, t, (tuple(box[0]), tuple(box[1]))))
        load, out = {}, {}
        for j, (_, t, _, _, offset, size) in enumerate(self._receives_of(d, s)):
            cands = sorted({r for r, tt, box in holders
                            if tt == t and _contains(box, (tuple(offset), tuple(size)))},
                           key=lambda r: (self._hosts[r] != self._hosts[d], load.get(r, 0), r))
            if cands:
                out[j] = cands[0]
                load[cands[0]] = load.get(cands[0], 0) + _numel(size)
        return out

    def _encode_replicas(self, states, writer, stats):
        """This rank's records as a replica: the boxes of destinations behind the snapshot
        that _replica_map gives it, dense from its committed tensors."""
        if not self.destination_boxes or self.version == _NONE or self._mixed:
            return
        rank, world = self.comm.rank, self.comm.size
        sources = [s for s in range(world) if int(states[s, 4]) & 1]
        for d in range(world):
            if d == rank or not int(states[d, 4]) & 2:
                continue
            for s in sources:
                snap_v = int(states[s, 1])
                if self._is_current(states, d, snap_v) or self.version != snap_v:
                    continue
                mine = [j for j, r in self._replica_map(states, d, s).items() if r == rank]
                if not mine:
                    continue
                transfers = self._receives_of(d, s)
                writer.segment(d, s)
                with self._readers.reading() as (held, _):
                    items = [(self._held_region(held, tr) if j in mine else None, None)
                             + self._extent(tr) for j, tr in enumerate(transfers)]
                    writer.pair(d, items, 1.0, stats)

    def _held_region(self, buffer, tr):
        _, t, _, _, offset, size = tr
        for v, (tv, o, n) in enumerate(self.destination_boxes):
            if tv == t and _contains((o, n), (tuple(offset), tuple(size))):
                # In place, the host mirror (a CUDA destination's records are encoded from it).
                tensors = self._mirror if self._mirror is not None else self._buffers[buffer]
                return tensors[v][_slices((o, n), (offset, size))].reshape(-1)
        raise AssertionError("replica holds no box for %r" % (tr,))

    # --- receiving ---------------------------------------------------------------------------

    def _apply_and_vote(self, received, version, fresh, stats):
        """Applies every record received, resends failed buckets dense (twice at most), and
        returns the transfers written once every rank voted good; raises on every rank
        otherwise."""
        target = 0 if self.mode == "in_place" else 1 - self._readers.active
        touched, error, failed = set(), None, {}
        if self.destination_boxes:
            self._applied, self._record_used = [], 0
            try:
                self._prepare(target)
                if self.mode == "staged":  # until this sync commits
                    self._readers.label(self._buffer_version, target, _INVALID)
                failed = self._apply(received, target, touched, stats, version)
            except Exception as e:  # noqa: B902  (published by the vote, raised on every rank)
                error = e
            if self.mode == "in_place":
                # Written but not committed: the next sync sends these tensors dense unless
                # this one commits.
                self._mixed |= {self._receives[k][1] for k in touched}
        for attempt in range(3):
            vote = torch.tensor([1 if error is not None else 0, sum(map(len, failed.values()))],
                                dtype=torch.int64)
            table = self._rows(vote, "vote")
            if bool(table[:, 0].any()):
                self._raise_failed(table, error)
            if not bool(table[:, 1].any()):
                return touched
            if attempt == 2:
                r = int(table[:, 1].argmax())
                raise ShardgatherError(
                    "WeightSync.sync: rank %d still had %d buckets whose checksum failed after "
                    "2 dense resends" % (r, int(table[r, 1])))
            failed, error = self._resend(failed, target, touched, version, fresh, stats)
        return touched

    def _raise_failed(self, table, error):
        if error is not None:
            raise error
        r = int(table[:, 0].nonzero()[0])
        raise RemoteError("WeightSync.sync: rank %d could not apply what it received (its "
                          "error names the cause); nothing was committed" % r)

    def _prepare(self, target):
        """Staged: brings the buffer about to be written to the active one's bytes: nothing where
        it holds them, the transfers the last commit wrote where it is the buffer that commit
        replaced, everything otherwise (first sync, after a failed one)."""
        if self.mode == "in_place":
            return
        active = self._readers.active
        versions = self._buffer_version
        if versions[target] == versions[active] and versions[target] != _INVALID:
            return
        with self._readers.writing(target, self._reader_wait):
            behind = versions[target] == self._replaced_version
            if not (behind and self._replay(target)):
                if behind and self._touched_last is not None:
                    for k in self._touched_last:
                        self._transfer_view(target, k).copy_(self._transfer_view(active, k))
                else:
                    for a, b in zip(self._buffers[active], self._buffers[target]):
                        b.copy_(a)
            versions[target] = versions[active]

    def _replay(self, target):
        """Applies the last commit's records again, to the buffer it replaced (which holds the
        version they were a delta from): the cheapest way there, where they were kept."""
        if self._last_records is None:
            return False
        failed, scratch = {}, collections.Counter()
        for origin, body in self._last_records:
            self._apply_segment(origin, origin, body, target, set(), failed, scratch,
                                verify=False)
        return not failed

    def _transfer_view(self, buffer, k):
        """Transfer k's view in ``buffer`` as a sync writes it (in place: the mirror)."""
        _, _, _, dv, offset, size = self._receives[k]
        box = self.destination_boxes[dv][1:]
        tensors = self._mirror if self._mirror is not None else self._buffers[buffer]
        return tensors[dv][_slices(box, (offset, size))]

    def _apply(self, received, target, touched, stats, version):
        """Applies the segments received: replicas' first (their dense bytes are the snapshot's
        version, which the sources' deltas then bring to the new one), then the sources' own.
        Returns origin source -> the set of its buckets whose checksum failed."""
        replicas, direct, failed = [], [], {}
        for sender, message in received.items():
            for origin, body, whole in _segments(sender, message):
                if not whole:  # damaged in flight: every bucket of the pair, dense again
                    failed.setdefault(origin, set()).update(range(self._pair_of(origin)[1]))
                    continue
                (direct if origin == sender else replicas).append((sender, origin, body))
                if sender != self.comm.rank:
                    key = "from_sources" if origin == sender else "from_replicas"
                    stats[key] += _SEGMENT + body.numel()
        with self._readers.writing(target, self._reader_wait):
            if self.mode == "in_place":
                self._writing = {tr[1] for tr in self._receives}
            try:
                if self.mode == "in_place":
                    self._buffer_version[0] = _INVALID  # readers wait meanwhile
                written = set()
                try:
                    for sender, origin, body in replicas + direct:
                        self._apply_segment(sender, origin, body, target, written, failed,
                                            stats)
                        self._keep(origin, body)
                finally:  # a failed apply's partial writes too: the device holds the mirror's
                    touched |= written
                    if self.mode == "in_place":
                        self._push(written)
                if self.mode == "in_place" and not failed:
                    # Whole and checked: what a reader sees is this version's bytes, though
                    # the sync may still fail to commit (then `mixed` names them).
                    self._buffer_version[0] = version
            finally:
                self._writing = set()
        return failed

    def _keep(self, origin, body):
        """Staged: keeps what this sync applied (copied: the exchange reuses its buffer) for
        _replay, while it fits its room."""
        if self.mode != "staged" or self._applied is None:
            return
        self._record_used = getattr(self, "_record_used", 0) + body.numel()
        if self._record_used > self._record_room:
            self._applied = None
        else:
            self._applied.append((origin, body.clone()))

    def _pair_of(self, origin):
        """This rank's receives from ``origin`` (indices into its receives) and how many buckets
        they are cut into."""
        if origin not in self._pair_cache:  # the receives never change: once per pair
            mine = [k for k, tr in enumerate(self._receives) if tr[0] == origin]
            count = _C._delta_bucket_count([self._extent(self._receives[k]) for k in mine],
                                           self.chunk_bytes)
            self._pair_cache[origin] = (mine, count)
        return self._pair_cache[origin]

    def _apply_segment(self, sender, origin, body, target, touched, failed, stats,
                       verify=True):
        """One segment's records, applied (delta.h's apply_pair: every record checked before
        any is written)."""
        mine, _ = self._pair_of(origin)
        views = [self._transfer_view(target, k) for k in mine]
        try:
            written, bad, changed = _C._delta_apply_pair(body, views, self.chunk_bytes, verify)
        except InvalidArgumentError as e:
            raise InvalidArgumentError("WeightSync.sync: rank %d sent rank %d records of source "
                                       "%d that do not apply: %s"
                                       % (sender, self.comm.rank, origin, e)) from None
        touched.update(mine[j] for j in written)
        stats["changed_received"] += changed
        if bad:
            failed.setdefault(origin, set()).update(bad)

    def _resend(self, failed, target, touched, version, fresh, stats):
        """One repair round: each destination asks the origin sources of the buckets whose
        checksum failed for them again; each source sends those buckets dense (the new
        version's bytes, so that a bad replica record is repaired too); the destination applies
        them. Returns what _apply returns, and an error of this rank's apply or None."""
        asks = {s: torch.tensor(sorted(b), dtype=torch.int64).view(torch.uint8)
                for s, b in failed.items()}
        got, _ = self._messages(asks, "resend asks")
        try:
            messages = self._resend_records(got, fresh, stats)
        except Exception as e:  # noqa: B902  (raised on every rank: the peers wait in the next round)
            self._fail(e, "resend sizes")
        received, _ = self._messages(messages, "resend")
        if not self.destination_boxes:
            return {}, None
        try:
            return self._apply(received, target, touched, stats, version), None
        except Exception as e:  # noqa: B902  (published by the vote)
            return {}, e

    def _resend_records(self, got, fresh, stats):
        """The dense records of the buckets each destination asked again of this source."""
        writer = _Writer(self._outgoing, self.chunk_bytes)
        for d, ask in got.items():
            transfers = [tr for tr in self._sends if tr[0] == d]
            only = ask.view(torch.int64).tolist()
            writer.segment(d, self.comm.rank)
            items = [(self._regions(tr, fresh)[0], None) + self._extent(tr) for tr in transfers]
            try:
                writer.pair(d, items, 1.0, stats, only)
            except InvalidArgumentError as e:
                raise InvalidArgumentError("WeightSync.sync: rank %d asked rank %d: %s"
                                           % (d, self.comm.rank, e)) from None
            stats["resent_buckets"] += len(only)
        return writer.finish()

    def _commit(self, version, fresh, touched):
        if self.source_boxes and fresh:
            self._snapshot, self._pending = self._pending, self._snapshot
            self.snapshot_version = version
        if self.destination_boxes:
            if self.mode == "staged":
                target = 1 - self._readers.active
                self._replaced_version = self._buffer_version[self._readers.active]
                if self._replaced_version == version and touched:
                    # a sync at the version it already held that wrote bytes (a source that
                    # restarted): the same label, other bytes
                    self._readers.label(self._buffer_version, self._readers.active, _INVALID)
                    self._replaced_version = _INVALID
                self._readers.label(self._buffer_version, target, version)
                self._touched_last = touched
                self._last_records, self._applied = self._applied, None
                self._readers.switch()
            else:
                self._readers.label(self._buffer_version, 0, version)
                self._mixed = set()
        self.version = version  # every rank's, a trainer's too


def _chunk_bytes(chunk_bytes, bucket_bytes):
    """(the name given, the value) of the change-detection unit, which has two names."""
    if bucket_bytes is None:
        return "chunk_bytes", 1 << 20 if chunk_bytes is None else chunk_bytes
    if chunk_bytes is not None:
        raise InvalidArgumentError("chunk_bytes was given twice (bucket_bytes is its older name)")
    return "bucket_bytes", bucket_bytes


def _signed(u64):
    return u64 - (1 << 64) if u64 >= 1 << 63 else u64


def _describe(x):
    if isinstance(x, torch.Tensor):
        return "%s %s on %s" % (x.dtype, tuple(x.shape), x.device)
    return type(x).__name__


def _segments(sender, message):
    """(origin source, records, whether their checksum holds) of each segment of a message
    (delta.h's framing)."""
    try:
        found = _C._delta_segments(message)
    except InvalidArgumentError as e:
        raise InvalidArgumentError("WeightSync.sync: rank %d sent %s" % (sender, e)) from None
    return [(origin, message[at:at + n], intact) for origin, at, n, intact in found]


class _Writer:
    """Builds each peer's message: segments (origin source, records), records encoded straight
    into it (C++ delta::Message). ``messages``: peer -> its message, kept by the caller so
    that the buffers serve the next sync too."""

    def __init__(self, messages, chunk_bytes):
        self._messages, self._chunk_bytes = messages, chunk_bytes
        for m in messages.values():
            m.clear()

    def _of(self, peer):
        if peer not in self._messages:
            self._messages[peer] = _C._DeltaMessage()
        return self._messages[peer]

    def segment(self, peer, origin):
        self._of(peer).segment(origin)

    def pair(self, peer, transfers, ratio, stats, only=None):
        """The records of a pair's buckets into ``peer``'s open segment: ``transfers`` as
        (after, before, elements, element size) (``_DeltaMessage.pair``)."""
        records, dense, changed = self._of(peer).pair(transfers, self._chunk_bytes, ratio, only)
        stats["records"] += records
        stats["dense_records"] += dense
        stats["changed_sent"] += changed

    def copy(self, peer, other):
        """``peer``'s message: a copy of ``other``'s (each holds one segment so far)."""
        self._of(peer).copy(self._messages[other])

    def finish(self):
        done = {p: m.finish() for p, m in self._messages.items()}
        return {p: t for p, t in done.items() if t.numel()}
