"""Weight sync (shardgather.weight_sync): each check takes (rank, world, comm) and runs on the
threads backend, Gloo groups and MPI. Every rank builds the same model from a seed and applies
the same random steps to it, so every rank knows every version's full tensors: sources sync
their shards, destinations compare what they hold with the reference bit for bit, every step.

Steps: SG_WS_STEPS (default 40 here; `SG_WS_STEPS=1000 pytest tests/python/test_weight_sync.py`
is the full run of docs/weight-sync.md)."""

import os
import threading
import time

import torch

import shardgather
from shardgather import _shardgather as _C
from conftest import on_default_group
from shardgather.layouts import Box, TensorLayout
from shardgather.weight_sync import WeightSync

T = 30.0
STEPS = int(os.environ.get("SG_WS_STEPS", "40"))
# (shape, dtype): a dtype mix, a 1-d tensor, a 3-d one, sizes that do not divide evenly
MODEL = [((48, 40), torch.bfloat16), ((33, 20), torch.float32), ((17,), torch.float16),
         ((6, 5, 9), torch.int8), ((10, 3), torch.int64), ((64, 64), torch.bfloat16)]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    return t.contiguous().view(_BITS[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _split(n, parts):
    base, extra = divmod(n, parts)
    out, at = [], 0
    for p in range(parts):
        size = base + (p < extra)
        out.append((at, size))
        at += size
    return out


def roles(world):
    """Sources: the first third of the ranks (at least one); destinations: the rest, as TP 2 x
    replicas where there are 4 or more (a rank left over holds nothing), else TP 1 replicas;
    world 1: the rank is both (a re-layout in one group)."""
    if world == 1:
        return [0], [[0]]
    ns = max(1, world // 3)
    dest = list(range(ns, world))
    tp = 2 if len(dest) >= 4 else 1
    groups = [dest[k:k + tp] for k in range(0, len(dest) - len(dest) % tp, tp)]
    return list(range(ns)), groups


def layouts_for(world, model=MODEL, joiner=None):
    """FSDP rows on the sources; on the destinations, each TP group splits the last dim (a
    column split), every group a replica of the others. ``joiner``: a rank left out of the
    destinations (a late joiner's 'before')."""
    sources, groups = roles(world)
    out = []
    for shape, dtype in model:
        srcs = []
        for r, (o, n) in zip(sources, _split(shape[0], len(sources))):
            srcs.append((r, Box((o,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))))
        dsts = []
        for g in groups:
            for r, (o, n) in zip(g, _split(shape[-1], len(g))):
                if r == joiner:
                    continue
                off = (0,) * (len(shape) - 1) + (o,)
                dsts.append((r, Box(off, tuple(shape[:-1]) + (n,))))
        out.append(TensorLayout(shape, dtype, srcs, dsts))
    return out


def initial(seed=0, model=MODEL):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in model:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        else:
            out.append(torch.randint(-100, 100, shape, generator=g).to(dtype))
    return out


def step(full, k):
    """Step k's update of the full model, in place and the same on every rank: sparse random
    updates at 0.1% to 10% density, every 7th step dense, every 11th nothing, and bit-level
    corner cases (-0.0 over +0.0, NaN payloads) now and then."""
    g = torch.Generator().manual_seed(1000 + k)
    kind = k % 11
    for i, t in enumerate(full):
        flat = t.view(-1)
        if kind == 10:
            continue
        density = 1.0 if k % 7 == 6 else [0.001, 0.01, 0.03, 0.1][int(torch.randint(
            4, (1,), generator=g))]
        n = max(1, int(flat.numel() * density))
        at = torch.randperm(flat.numel(), generator=g)[:n]
        if t.dtype.is_floating_point:
            values = torch.randn(n, generator=g).to(t.dtype)
            if k % 5 == 0:
                values[0] = -0.0 if bits(flat[at[:1]]).item() == 0 else float("nan")
        else:
            values = torch.randint(-100, 100, (n,), generator=g).to(t.dtype)
        flat[at] = values


def shard_views(ws, full):
    return [full[t][tuple(slice(o, o + n) for o, n in zip(off, size))]
            for t, off, size in ws.source_boxes]


def expected(ws, full):
    return [full[t][tuple(slice(o, o + n) for o, n in zip(off, size))]
            for t, off, size in ws.destination_boxes]


def check_held(ws, full, rank, k):
    if not ws.destination_boxes:
        return
    with ws.read() as (version, tensors):
        assert version == k, (rank, version, k)
        for v, (have, want) in enumerate(zip(tensors, expected(ws, full))):
            assert same_bits(have, want), (rank, k, v, ws.destination_boxes[v])


class _Mirrored(WeightSync):
    """In place through host mirrors, as CUDA destinations are (here on host tensors: the
    mirror logic is the same, the copies are host ones)."""
    _mirror_host = True


def _make(rank, world, comm, mode, cls=WeightSync, **kw):
    layouts = layouts_for(world)
    dests = None
    if mode == "in_place":
        probe = shardgather.ReshardPlan(layouts, world, rank)
        dests = [torch.zeros(size, dtype=layouts[t].dtype)
                 for t, _, size in probe.destination_boxes]
    return cls(layouts, comm, mode=mode, destinations=dests, timeout=T,
               bucket_bytes=kw.pop("bucket_bytes", 256), **kw)


def _random_steps(rank, world, comm, mode):
    ws = _make(rank, world, comm, mode)
    full = initial()
    for k in range(STEPS):
        if k:
            step(full, k)
        stats = ws.sync(k, shard_views(ws, full))
        check_held(ws, full, rank, k)
        if ws.destination_boxes and k % 11 == 10:
            assert stats["bytes_received"] == 0, (rank, k, stats)
    assert ws.version == STEPS - 1  # every rank's, a source-only rank's too


def check_random_steps_staged(rank, world, comm):
    _random_steps(rank, world, comm, "staged")


def check_random_steps_in_place(rank, world, comm):
    _random_steps(rank, world, comm, "in_place")


def check_sends_only_changes(rank, world, comm):
    """After the first (dense) sync, a destination receives the records of the changed buckets
    only: with one element changed per tensor, one record per tensor box it holds at most."""
    ws = _make(rank, world, comm, "staged", bucket_bytes=64)
    full = initial()
    dense = ws.sync(0, shard_views(ws, full))
    # what this rank keeps for reuse holds at least what the dense sync moved
    held = ws.memory()
    assert held["messages"] >= dense["bytes_sent"], (rank, held, dense)
    assert held["exchange"] >= dense["bytes_received"], (rank, held, dense)
    for t in full:
        t.view(-1)[0] = t.view(-1)[1]
    calls, collectives = ws.comm.calls_issued, ws.comm.collectives_issued
    stats = ws.sync(1, shard_views(ws, full))
    # One call (one sequence number): its opening header, the state, the payload's sizes, the
    # payload, the vote. Nothing is planned per sync.
    assert ws.comm.calls_issued - calls == 1, (rank, ws.comm.calls_issued - calls)
    assert ws.comm.collectives_issued - collectives == (5 if world > 1 else 0), rank
    check_held(ws, full, rank, 1)
    changed = sum(1 for t, off, _ in ws.destination_boxes if all(o == 0 for o in off))
    assert stats["changed_received"] <= changed, (rank, stats, changed)
    # one record: 40 bytes of header + a pair (4 + 8 bytes), padded; a segment header per pair
    assert stats["bytes_received"] <= changed * 56 + 24 * world, (rank, stats)


def _damaged_in_flight(rank, world, comm, at, mask):
    """One dense sync whose messages to other ranks have byte ``at`` xor ``mask``: it must end
    bit-exact, with the damaged buckets resent by every source that sent to another rank."""
    if world == 1:
        return
    ws = _make(rank, world, comm, "staged")

    def corrupt(sender, peer, message):
        if sender != peer and message.numel() > at:
            message[at] ^= mask

    ws._corrupt = corrupt
    full = initial()
    stats = ws.sync(0, shard_views(ws, full))
    ws._corrupt = None
    check_held(ws, full, rank, 0)
    assert (stats["resent_buckets"] > 0) == any(tr[0] != rank for tr in ws._sends), stats


def check_in_place_through_mirrors(rank, world, comm):
    """In place through host mirrors (the CUDA destinations' path): every version lands in the
    destination tensors themselves, the resend of a bucket damaged in flight too; the mirrors
    are counted in memory()."""
    ws = _make(rank, world, comm, "in_place", cls=_Mirrored)
    views = ws._buffers[0]
    assert all(m is not d for m, d in zip(ws._mirror, views))
    boxes = sum(d.numel() * d.element_size() for d in views)
    assert ws.memory()["destinations"] == boxes, (rank, ws.memory(), boxes)
    full = initial()
    for k in range(6):
        if k:
            step(full, k)
        if k == 3 and world > 1:
            ws._corrupt = lambda sender, peer, m: (
                m.__setitem__(24 + 40, m[24 + 40] ^ 0x5A)
                if sender != peer and m.numel() > 64 else None)
        ws.sync(k, shard_views(ws, full))
        ws._corrupt = None
        check_held(ws, full, rank, k)
        assert all(v is d for v, d in zip(ws._buffers[0], views))


def check_restarted_destination_through_mirrors(rank, world, comm):
    """The restart above in place through host mirrors (the CUDA destinations' path): the
    replicas encode the restarted rank's records from their mirrors."""
    check_restarted_destination(rank, world, comm, "in_place", _Mirrored)


def check_checksum_resend(rank, world, comm):
    """A byte flipped in flight (the first value of the first dense record to each peer) fails
    that bucket's checksum; the destination gets it resent dense and ends bit-exact."""
    _damaged_in_flight(rank, world, comm, 24 + 40, 0x5A)


def check_header_damage(rank, world, comm):
    """A bit flipped in the first record's bucket id (a record of the right size for another
    bucket): the segment's checksum catches it, the pair's buckets are resent dense, and the
    sync ends bit-exact."""
    _damaged_in_flight(rank, world, comm, 24 + 4, 1)


def check_same_version_other_bytes(rank, world, comm):
    """The sources restart (no snapshot) and sync the committed version again with other bytes
    (a trainer resumed from another checkpoint): every destination holds them, and the next
    step's delta lands on them, not on the replaced buffer's older bytes of the same label."""
    ws = _make(rank, world, comm, "staged")
    x0 = initial()
    x1, x1b = [t.clone() for t in x0], [t.clone() for t in x0]
    step(x1, 1)
    step(x1b, 2)
    ws.sync(0, shard_views(ws, x0))
    ws.sync(1, shard_views(ws, x1))
    if rank in roles(world)[0]:  # every source: one version is one set of bytes
        ws = _make(rank, world, comm, "staged")
    ws.sync(1, shard_views(ws, x1b))
    check_held(ws, x1b, rank, 1)
    step(x1b, 3)
    ws.sync(2, shard_views(ws, x1b))
    check_held(ws, x1b, rank, 2)


def check_in_place_failed_vote_then_rebuild(rank, world, comm):
    """In place: a sync whose vote fails (one destination's apply raises) leaves the others'
    tensors written and `mixed`; after a rebuild, the retry with other bytes still ends
    bit-exact (a mixed tensor keeps no version across the rebuild: it is sent dense)."""
    sources, groups = roles(world)
    if world < 3:
        return
    victim = groups[-1][-1]
    ws = _make(rank, world, comm, "in_place")
    views = ws._buffers[0]
    x0 = initial()
    x1, y1 = [t.clone() for t in x0], [t.clone() for t in x0]
    step(x1, 1)
    step(y1, 2)
    ws.sync(0, shard_views(ws, x0))
    if rank == victim:
        def boom(target):
            raise shardgather.ShardgatherError("injected: this rank's apply fails")
        ws._prepare = boom
    try:
        ws.sync(1, shard_views(ws, x1))
    except shardgather.ShardgatherError:
        pass
    else:
        raise AssertionError("a sync whose vote failed committed")
    if ws.destination_boxes and rank != victim:
        assert ws.mixed, (rank, "written but uncommitted tensors must be mixed")
    ws = ws.rebuild(layouts_for(world), comm, destinations=views)
    ws.sync(1, shard_views(ws, y1))
    check_held(ws, y1, rank, 1)


def check_version_rules(rank, world, comm):
    """Ranks that ask for different versions, or for one older than the snapshot, raise
    InvalidArgumentError on every rank before anything is applied; the next good sync works."""
    ws = _make(rank, world, comm, "staged")
    full = initial()
    ws.sync(3, shard_views(ws, full))
    for bad in ([3 + (rank == world - 1)] if world > 1 else []) + [2]:
        try:
            ws.sync(bad, shard_views(ws, full))
        except shardgather.InvalidArgumentError as e:
            assert "version" in str(e), e
        else:
            raise AssertionError("version %d was accepted" % bad)
    step(full, 1)
    ws.sync(5, shard_views(ws, full))
    check_held(ws, full, rank, 5)


def check_restarted_destination(rank, world, comm, mode="staged", cls=WeightSync):
    """A destination restarts (a new WeightSync: nothing held) between two syncs: it is
    brought up to the version from a replica of its boxes, bit-exact; on a sync at the same
    version the sources send nothing at all."""
    sources, groups = roles(world)
    if len(groups) < 2:
        return
    victim = groups[-1][0]
    ws = _make(rank, world, comm, mode, cls=cls)
    full = initial()
    ws.sync(0, shard_views(ws, full))
    step(full, 1)
    ws.sync(1, shard_views(ws, full))
    if rank == victim:
        ws = _make(rank, world, comm, mode, cls=cls)
    stats = ws.sync(1, shard_views(ws, full))  # the same version: only the restarted one moves
    check_held(ws, full, rank, 1)
    if rank in sources:
        assert stats["bytes_sent"] == 0, (rank, stats)
    if rank == victim:
        assert stats["from_sources"] == 0 and stats["from_replicas"] > 0, stats
    step(full, 2)
    ws.sync(2, shard_views(ws, full))
    check_held(ws, full, rank, 2)


def check_late_joiner(rank, world, comm):
    """A rank that held nothing joins as a replica: every rank rebuilds the sync for the new
    layout (the joiner constructs one); the joiner's boxes come from its replica, 0 bytes from
    the sources, and the next step's delta reaches it bit-exact."""
    sources, groups = roles(world)
    if len(groups) < 2:
        return
    joiner = groups[-1][-1]
    ws = WeightSync(layouts_for(world, joiner=joiner), comm, timeout=T, bucket_bytes=512)
    full = initial()
    ws.sync(0, shard_views(ws, full))
    step(full, 1)
    ws.sync(1, shard_views(ws, full))
    if rank == joiner:
        assert not ws.destination_boxes
        ws = WeightSync(layouts_for(world), comm, timeout=T, bucket_bytes=512)
    else:
        ws = ws.rebuild(layouts_for(world), comm)
    stats = ws.sync(1, shard_views(ws, full))
    check_held(ws, full, rank, 1)
    if rank == joiner:
        assert stats["from_sources"] == 0 and stats["from_replicas"] > 0, stats
    step(full, 2)
    ws.sync(2, shard_views(ws, full))
    check_held(ws, full, rank, 2)


def check_trainer_writes_during_sync(rank, world, comm):
    _torn_reads(rank, world, comm, "staged")


def check_trainer_writes_during_sync_in_place(rank, world, comm):
    _torn_reads(rank, world, comm, "in_place")


def _torn_reads(rank, world, comm, mode):
    """start() returns once the sources are copied: the trainer then writes its shards (the
    next step) while the sync runs, and a reader thread on every destination checks, all the
    while, that each read sees one version's values whole (0 torn tensors). Syncs: STEPS / 2,
    at least 10 (SG_WS_STEPS=2000: 1000)."""
    ws = _make(rank, world, comm, mode)
    full = initial()
    history = {}
    stop, torn, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            with ws.read() as (version, tensors):
                if version < 0:
                    continue
                want = expected(ws, history[version])
                for v, (have, w) in enumerate(zip(tensors, want)):
                    if not same_bits(have, w):
                        torn.append((version, v))
                reads[0] += 1

    thread = threading.Thread(target=reader, daemon=True)
    history[0] = [t.clone() for t in full]
    shards = [s.clone() for s in shard_views(ws, full)]
    ws.sync(0, shards)
    if ws.destination_boxes:
        thread.start()
    for k in range(1, max(10, STEPS // 2)):
        step(full, k)
        history[k] = [t.clone() for t in full]
        for s, new in zip(shards, shard_views(ws, full)):
            s.copy_(new)
        work = ws.start(k, shards)
        assert isinstance(work, shardgather.Work), type(work)  # the one async type
        # the trainer's next optimizer step, while the sync runs: the copy keeps the sync whole
        for s in shards:
            s.add_(1) if not s.dtype.is_floating_point else s.mul_(2)
        stats = work.wait()
        assert work.is_completed() and stats["version"] == k, stats
        assert work.wait() is stats  # a second wait returns the same outcome
    time.sleep(0.05)
    stop.set()
    if ws.destination_boxes:
        thread.join()
        assert not torn, (rank, torn[:5])
        assert reads[0] > 0


def _arguments(rank, world):
    """(what, constructor keywords, sync arguments or None, expected class) per RELIABILITY 2.8b
    row: the last rank passes the argument, every other rank the reference."""
    layouts = layouts_for(world)
    other = layouts_for(world)
    other[0] = TensorLayout((48, 41), other[0].dtype, [], [])
    last_holds = bool(shardgather.ReshardPlan(layouts, world, world - 1).destination_boxes)
    return [
        ("chunk_bytes 0", {"chunk_bytes": 0}, None, shardgather.InvalidArgumentError),
        ("chunk_bytes '64'", {"chunk_bytes": "64"}, None, shardgather.InvalidTypeError),
        ("chunk_bytes 512", {"chunk_bytes": 512}, None, shardgather.MismatchError),
        ("bucket_bytes 512 (its older name)", {"bucket_bytes": 512}, None,
         shardgather.MismatchError),
        ("chunk_bytes given twice", {"bucket_bytes": 256, "chunk_bytes": 256}, None,
         shardgather.InvalidArgumentError),
        ("dense_ratio 2", {"dense_ratio": 2.0}, None, shardgather.InvalidArgumentError),
        ("dense_ratio 'x'", {"dense_ratio": "x"}, None, shardgather.InvalidTypeError),
        ("mode 'bogus'", {"mode": "bogus"}, None, shardgather.InvalidArgumentError),
        ("timeout -1", {"timeout": -1}, None, shardgather.InvalidArgumentError),
    ] + ([("in_place without destinations", {"mode": "in_place"}, None,
           shardgather.InvalidArgumentError)] if last_holds else []) + [
        ("layouts that differ", {"layouts": other}, None, shardgather.MismatchError),
        ("version '1'", {}, ("1", None), shardgather.InvalidTypeError),
        ("version -1", {}, (-1, None), shardgather.InvalidArgumentError),
        ("version 2", {}, (2, None), shardgather.InvalidArgumentError),
        ("sources too few", {}, (1, "few"), shardgather.InvalidArgumentError),
        ("a source of the wrong dtype", {}, (1, "dtype"), shardgather.InvalidArgumentError),
    ], layouts


def check_bad_arguments(rank, world, comm):
    """RELIABILITY 2.8b for WeightSync: one argument wrong (or different) on the last rank
    only; every rank raises the expected class, none waits for its deadline, and a valid sync
    right after works on every rank."""
    if world == 1:
        return
    cases, layouts = _arguments(rank, world)
    full = initial()
    for what, kw, call, cls in cases:
        mine = dict(timeout=T, chunk_bytes=256)
        if rank == world - 1:
            mine.update(kw)
            if kw.keys() == {"bucket_bytes"}:
                del mine["chunk_bytes"]
        lays = mine.pop("layouts", layouts)
        ws = WeightSync(lays, comm, **mine)
        version, sources = 1, shard_views(ws, full) if ws.destination_boxes or \
            ws.source_boxes else []
        if call is not None and rank == world - 1:
            version = call[0]
            if call[1] == "few":
                sources = sources[:-1] if sources else [torch.zeros(1)]
            elif call[1] == "dtype":
                sources = [s.double() for s in sources] or [torch.zeros(1)]
        began = time.monotonic()
        try:
            ws.sync(version, sources)
        except shardgather.ShardgatherError as e:
            assert isinstance(e, cls), (rank, what, type(e).__name__, str(e))
            assert time.monotonic() - began < T / 2, (rank, what, "waited for its deadline")
        else:
            raise AssertionError("rank %d: %s was accepted" % (rank, what))
        good = WeightSync(layouts, comm, timeout=T, bucket_bytes=256)
        good.sync(1, shard_views(good, full))
        check_held(good, full, rank, 1)


def _oom(*args, **kwargs):
    raise MemoryError("no room for the records")


def _damage(sender, peer, message):
    """Flips a byte of the first record of every message to another rank: its segment fails
    its checksum, and every such pair's buckets are asked for again."""
    if sender != peer and message.numel() > 40:
        message[40] ^= 1


def _fail_mid_sync(rank, world, comm, where, corrupt):
    """Sync 0, then sync 1 with the last rank's step ``where`` raising MemoryError. Returns
    (the object, the tensors, the error's text or None, the seconds the failed sync took)."""
    ws = _make(rank, world, comm, "staged")
    full = initial()
    ws.sync(0, shard_views(ws, full))
    step(full, 1)
    if rank == world - 1:
        setattr(ws, where, _oom)
    ws._corrupt = corrupt
    began, text = time.monotonic(), None
    try:
        ws.sync(1, shard_views(ws, full))
    except shardgather.OutOfMemoryError as e:
        text = str(e)
    ws._corrupt = None
    if rank == world - 1:
        delattr(ws, where)
    return ws, full, text, time.monotonic() - began


def check_local_failure_mid_sync(rank, world, comm):
    """A step that fails on one rank between two rounds of a sync (its encode, then its dense
    resend, runs out of memory): every rank raises that error's class at the next round,
    naming the rank, its text and the round, without waiting for a deadline; nothing commits,
    and the next sync is exact."""
    for where, round_name, corrupt in (("_encode_sources", "payload sizes", None),
                                       ("_resend_records", "resend sizes", _damage)):
        ws, full, text, seconds = _fail_mid_sync(rank, world, comm, where, corrupt)
        if corrupt is not None and world == 1:
            assert text is None  # nothing crosses a link: nothing to resend
            continue
        assert text is not None, (rank, where)
        assert seconds < T / 2, (rank, where, seconds, "waited for a deadline")
        assert "no room for the records" in text and "rank %d" % (world - 1) in text, text
        if world > 1:
            assert "WeightSync.sync: %s" % round_name in text, (rank, text)
        assert ws.version == 0, (rank, ws.version)
        ws.sync(1, shard_views(ws, full))
        check_held(ws, full, rank, 1)


def _rename_first_bucket(sender, peer, message):
    """The first record of every message to another rank names bucket 2^31 - 1 (no pair has
    that many), its segment's checksum made to match: it arrives intact, and does not apply."""
    if sender == peer or message.numel() < 24 + 40:
        return
    records = int(message[8:16].view(torch.int64)[0])
    message[28:32] = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.uint8)
    checksum = _C._delta_checksum(message[24:24 + records], 0, records)
    signed = checksum - (1 << 64) if checksum >= 1 << 63 else checksum
    message[16:24] = torch.tensor([signed], dtype=torch.int64).view(torch.uint8)


def check_records_that_do_not_apply(rank, world, comm):
    """RELIABILITY (adversarial input): an intact segment whose record names a bucket its pair
    does not have. The rank that received it raises InvalidArgumentError naming the sender,
    itself, the source and the bucket; its peers raise RemoteError from the vote; nothing
    commits, and the next sync is exact."""
    if world == 1:
        return
    for mode in ("staged", "in_place"):
        ws = _make(rank, world, comm, mode)
        full = initial()
        ws.sync(0, shard_views(ws, full))
        step(full, 1)
        ws._corrupt = _rename_first_bucket
        try:
            ws.sync(1, shard_views(ws, full))
        except shardgather.InvalidArgumentError as e:
            text = str(e)
            assert "rank %d records of source" % rank in text, (rank, text)
            assert "that do not apply" in text and "bucket 2147483647" in text, (rank, text)
        except shardgather.RemoteError as e:
            assert "could not apply" in str(e), (rank, str(e))
        else:
            raise AssertionError("rank %d: the sync committed records that do not apply" % rank)
        ws._corrupt = None
        assert ws.version == 0, (rank, mode, ws.version)
        ws.sync(1, shard_views(ws, full))
        check_held(ws, full, rank, 1)


CHECKS = [check_random_steps_staged, check_random_steps_in_place, check_sends_only_changes,
          check_checksum_resend, check_version_rules, check_restarted_destination,
          check_late_joiner, check_trainer_writes_during_sync,
          check_trainer_writes_during_sync_in_place, check_bad_arguments,
          check_header_damage, check_same_version_other_bytes,
          check_in_place_failed_vote_then_rebuild, check_local_failure_mid_sync,
          check_in_place_through_mirrors, check_restarted_destination_through_mirrors,
          check_records_that_do_not_apply]
for _check in CHECKS:
    globals()[on_default_group(_check).__name__] = on_default_group(_check)
CASES = ["case_" + c.__name__[len("check_"):] for c in CHECKS]


def kill_worker(rank, world, init_file, victim, deadline, seed, queue):
    """One process of a Gloo group (test_weight_sync.py's kill -9 case): a dense sync of a few
    MB, during which rank ``victim`` SIGKILLs itself ``seed`` x the time of a sync before it
    (an arbitrary byte of the exchange, or of the encoding or the apply). Each survivor puts
    (rank, error class or None, seconds) on ``queue``."""
    import datetime
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    big = [((512, 384), torch.float32), ((256, 512), torch.bfloat16), ((300, 257), torch.float32)]
    ws = WeightSync(layouts_for(world, model=big), None, timeout=deadline, bucket_bytes=1 << 16)
    full = initial(model=big)
    ws.sync(0, shard_views(ws, full))
    # Two dense syncs (every element changes: the longest there is), timed: the first one after
    # sync 0 also touches its buffers for the first time, so the shorter of the two is the
    # measure of the one the kill lands in (a longer measure could put the kill after its commit).
    took = []
    for version in (1, 2):
        for t in full:
            t.add_(1)
        began = time.monotonic()
        ws.sync(version, shard_views(ws, full))
        took.append(time.monotonic() - began)
    for t in full:
        t.add_(1)
    if rank == victim:
        delay = seed * min(took)  # seed: a fraction of a sync
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    began = time.monotonic()
    try:
        ws.sync(3, shard_views(ws, full))
        outcome = None
    except shardgather.ShardgatherError as e:
        outcome = type(e).__name__
    if rank == victim:
        time.sleep(5)  # the timer kills it; nothing it reports counts
    queue.put((rank, outcome, time.monotonic() - began))


def replace_worker(rank, world, first, second, victim, queue):
    """One process of the replacement case (test_weight_sync.py): a Gloo group on the store
    ``first``; rank ``victim`` is killed (SIGKILL) before sync 1, which every survivor raises;
    the survivors then destroy that group, join a new one on the store ``second`` and rebuild
    their WeightSync on it. ``first`` None: the replacement process, which joins ``second``
    directly with a new WeightSync. Every process syncs version 1 on the new group and checks
    what it holds; each puts (rank, what it raised in the failed sync or None, its stats)."""
    import datetime
    import signal

    import torch.distributed as dist

    def join(store):
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))

    layouts = layouts_for(world)
    full = initial()
    failed = None
    if first is not None:
        join(first)
        ws = WeightSync(layouts, None, timeout=5.0, bucket_bytes=256)
        ws.sync(0, shard_views(ws, full))
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        step(full, 1)
        try:
            ws.sync(1, shard_views(ws, full))
        except shardgather.ShardgatherError as e:
            failed = type(e).__name__
        # The documented recipe (docs/weight-sync.md, "After a failure"): the old group goes,
        # a new one on a new store (or a new prefix of one store), the object rebuilt on it.
        dist.destroy_process_group()
        join(second)
        ws = ws.rebuild(layouts, None)
    else:
        step(full, 1)
        join(second)
        ws = WeightSync(layouts, None, timeout=5.0, bucket_bytes=256)
    stats = ws.sync(1, shard_views(ws, full))
    check_held(ws, full, rank, 1)
    queue.put((rank, failed, {k: stats[k] for k in ("from_replicas", "from_sources")}))
    dist.destroy_process_group()
