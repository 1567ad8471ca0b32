"""Weight sync (weight_sync_cases.py), bit for bit against every version's reference: the
threads backend at worlds 1 to 7, Gloo groups of 2 to 4 spawned processes, MPI at 2 to 4 ranks;
and the failure bounds (a destination that stops mid-sync) on threads."""

import time

import pytest

import shardgather
import weight_sync_cases
from conftest import CaseResults, check_on_threads, run_mpi_checks, run_ranks

_results = CaseResults("weight_sync_cases", weight_sync_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("check", weight_sync_cases.CHECKS, ids=lambda c: c.__name__)
def test_weight_sync_threads(world, check):
    check_on_threads(world, check)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", weight_sync_cases.CASES)
def test_weight_sync_gloo(world, case):
    _results.check(world, case)


@pytest.mark.skipif(not shardgather.has_mpi(), reason="built without MPI")
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_weight_sync_mpi(np_):
    run_mpi_checks("weight_sync_cases", np_, timeout=300)


def test_start_without_a_thread_raises_and_leaves_nothing_waiting(monkeypatch):
    """A sync whose thread cannot start raises that error from start(), and its handle, dropped,
    does not wait for a thread that never ran; the next sync works."""
    import threading

    import torch
    from shardgather.layouts import Box, TensorLayout

    box = Box((0, 0), (4, 4))
    layouts = [TensorLayout((4, 4), torch.float32, [(0, box)], [(0, box)])]
    ws = shardgather.WeightSync(layouts, shardgather.ThreadGroup(1)[0], timeout=5.0)

    def refuse(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            ws.start(1, [torch.ones(4, 4)])
    ws.sync(1, [torch.full((4, 4), 2.0)])
    with ws.read() as (version, tensors):
        assert version == 1 and bool((tensors[0] == 2.0).all())


def _fault_run(world, stage, deadline, who="destination"):
    """One sync at version 1 in which ``who`` (the last destination, or the first source) stops
    answering at ``stage`` (it returns from its exchange: a rank killed or cut off there, seen
    from its peers). Returns (per-rank (error type name, seconds) of that sync, the victim, and
    the errors of a sync of the same ranks at version 1 on a new group with the victim
    restarted, which must end bit-exact)."""
    layouts = weight_sync_cases.layouts_for(world)
    sources, groups = weight_sync_cases.roles(world)
    victim = groups[-1][-1] if who == "destination" else sources[0]
    full = weight_sync_cases.initial()
    outcome = {}
    kept = {}

    def body(rank, comm):
        ws = shardgather.weight_sync.WeightSync(layouts, comm, timeout=deadline,
                                                bucket_bytes=256)
        ws.sync(0, weight_sync_cases.shard_views(ws, full))
        mine = [t.clone() for t in full]
        weight_sync_cases.step(mine, 1)
        if rank == victim:
            calls = [0]
            real = ws._rows if stage == "vote" else ws._messages

            def dies(*a, **k):
                calls[0] += 1
                if stage == "vote" and calls[0] < 2:
                    return real(*a, **k)
                raise SystemExit  # this rank is gone from here on

            setattr(ws, "_rows" if stage == "vote" else "_messages", dies)
        began = time.monotonic()
        try:
            ws.sync(1, weight_sync_cases.shard_views(ws, mine))
            outcome[rank] = (None, time.monotonic() - began)
        except SystemExit:
            outcome[rank] = ("killed", time.monotonic() - began)
        except shardgather.ShardgatherError as e:
            outcome[rank] = (type(e).__name__, time.monotonic() - began)
        kept[rank] = ws

    run_ranks(world, body)
    # the same ranks again, on a new group: the victim restarted (nothing held), the others
    # keep their state; version 1 again is a delta from the last committed snapshot (0)
    mine = [t.clone() for t in full]
    weight_sync_cases.step(mine, 1)

    def again(rank, comm):
        if rank == victim:
            ws = shardgather.weight_sync.WeightSync(layouts, comm, timeout=deadline,
                                                    bucket_bytes=256)
        else:
            ws = kept[rank].rebuild(layouts, comm)
        ws.sync(1, weight_sync_cases.shard_views(ws, mine))
        weight_sync_cases.check_held(ws, mine, rank, 1)
        return ws.last_stats

    stats, errors = run_ranks(world, again)
    return outcome, victim, errors


@pytest.mark.parametrize("who", ["destination", "source"])
@pytest.mark.parametrize("stage", ["payload", "vote"])
@pytest.mark.parametrize("world", [3, 5])
def test_rank_lost_mid_sync(world, stage, who):
    """Every survivor raises within [0.5, 2] x the deadline, never hangs; nothing commits; the
    same ranks then sync bit-exact: a restarted destination from its replica where it has one,
    a restarted source (no snapshot) dense to every destination."""
    deadline = 2.0
    outcome, victim, errors = _fault_run(world, stage, deadline, who)
    for rank, (error, seconds) in outcome.items():
        if rank == victim:
            continue
        assert error is not None, (rank, outcome)
        assert 0.5 * deadline <= seconds <= 2 * deadline, (rank, error, seconds)
    assert not any(errors), errors


@pytest.mark.parametrize("seed", [0.02, 0.1, 0.25])
@pytest.mark.parametrize("victim", ["source", "destination"])
def test_killed_mid_sync_gloo(victim, seed):
    """kill -9 of a source or a destination at a random moment of a dense sync on a Gloo group
    of 4 processes: every survivor raises (never hangs, never commits) within 2 x the deadline
    (a closed connection is usually seen at once, well before it). The kill lands 2%, 10% or
    25% into a sync as long as the shorter of the two before, so at least one survivor must
    raise."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    world, deadline = 4, 3.0
    sources, groups = weight_sync_cases.roles(world)
    rank = sources[0] if victim == "source" else groups[-1][-1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="sg-ws-kill-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=weight_sync_cases.kill_worker,
                         args=(r, world, init_file, rank, deadline, seed, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world - 1):
            r, outcome, seconds = queue.get(timeout=120)
            got[r] = (outcome, seconds)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    assert procs[rank].exitcode == -9, procs[rank].exitcode
    survivors = [r for r in range(world) if r != rank]
    assert sorted(got) == survivors, got
    for r in survivors:
        outcome, seconds = got[r]
        # None: this survivor's sync committed before the kill reached it (the kill landed
        # after the vote); otherwise an error, bounded
        assert seconds <= 2 * deadline, (r, outcome, seconds)
    assert any(outcome is not None for outcome, _ in got.values()), got


def test_a_replacement_process_joins_a_new_group_gloo():
    """The recipe of docs/weight-sync.md, "After a failure", on a Gloo job of 3 processes (a
    source, two replicas of one engine rank): one replica is killed (SIGKILL) before a sync;
    both survivors raise; they destroy the group, join a new one on a new store and rebuild;
    a new process takes the killed one's rank there with a new WeightSync; the sync at the
    failed version then ends bit-exact on every rank, the newcomer filled from the surviving
    replica."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    world = 3
    sources, groups = weight_sync_cases.roles(world)
    victim = groups[-1][-1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    stores = []
    for _ in range(2):
        fd, path = tempfile.mkstemp(prefix="sg-ws-replace-")
        os.close(fd)
        os.unlink(path)
        stores.append(path)
    procs = [ctx.Process(target=weight_sync_cases.replace_worker,
                         args=(r, world, stores[0], stores[1], victim, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    newcomer = None
    try:
        procs[victim].join(timeout=120)
        assert procs[victim].exitcode == -9, procs[victim].exitcode
        newcomer = ctx.Process(target=weight_sync_cases.replace_worker,
                               args=(victim, world, None, stores[1], victim, queue))
        newcomer.start()
        got = {}
        for _ in range(world):
            r, failed, stats = queue.get(timeout=120)
            got[r] = (failed, stats)
    finally:
        for p in procs + ([newcomer] if newcomer is not None else []):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for path in stores:
            if os.path.exists(path):
                os.unlink(path)
    assert sorted(got) == list(range(world)), got
    for r in range(world):
        failed, stats = got[r]
        if r != victim:  # the survivors raised the failed sync (at once or at the deadline)
            assert failed in ("RemoteError", "CollectiveTimeout"), (r, failed)
    assert got[victim][1]["from_replicas"] > 0, got[victim]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_bad_round_argument_on_one_rank_fails_every_rank(world):
    """The call of rounds' binding (_C._RoundCall, what each sync runs in): a message that is
    not a 1-d uint8 CPU tensor, one that is not a tensor, a peer that is not a rank, or a row
    that is not int64, given on the last rank only, raises its class on every rank at that
    round, naming the rank, without a deadline's wait; the group works after."""
    import torch

    from shardgather import _C

    uint8 = torch.zeros(3, dtype=torch.uint8)
    cases = [("messages", {0: torch.zeros(3)}, shardgather.InvalidArgumentError,
              "the message to rank 0"),
             ("messages", {world: uint8}, shardgather.InvalidArgumentError, "not a rank"),
             ("messages", {0: "x"}, shardgather.InvalidTypeError, "not a tensor"),
             ("rows", torch.zeros(2), shardgather.InvalidArgumentError, "a round's row")]

    def body(rank, comm):
        last = rank == world - 1
        seen = []
        for kind, bad, cls, needle in cases:
            call = _C._RoundCall(comm, "WeightSync::sync", "test", 10.0, 2)
            call.open("state")
            began = time.monotonic()
            try:
                if kind == "messages":
                    call.messages(bad if last else {}, "payload", torch.empty(0, dtype=torch.uint8))
                else:
                    call.rows(bad if last else torch.zeros(1, dtype=torch.int64), "state")
                seen.append((kind, needle, "no error"))
            except shardgather.ShardgatherError as e:
                ok = (type(e) is cls and needle in str(e) and "rank %d" % (world - 1) in str(e)
                      and time.monotonic() - began < 5)
                if not ok:
                    seen.append((kind, needle, type(e).__name__, str(e)))
        call = _C._RoundCall(comm, "WeightSync::sync", "test", 10.0, 2)
        call.open("state")
        assert call.rows(torch.tensor([rank]), "state")[:, 0].tolist() == list(range(world))
        return seen

    results, errors = run_ranks(world, body)
    assert errors == [None] * world, errors
    assert results == [[]] * world, results
