"""Reliability round 3 (docs/reliability.md, "Round 3"; the disagreement cases extended to the Python entry points): every
parameter of the stream, the export, full_tensors, the plans' constructors and started calls.

The generated family: every rank but the last makes the reference call, the last rank the same
call with one argument changed (invalid, or valid but different). Every rank must end alike:
the same error class naming the cause, or success where the argument is local to a rank (a
copy flag, a progress bar); and a valid call right after succeeds on every rank (the group is
usable). Each row is bounded by T: a rank that would wait for its deadline fails the row.

The check_* functions take (rank, world, group) and run on any backend (a spawned Gloo group
with group=None, the threads backend, MPI); the case_* wrappers are the Gloo entries and add
the DTensor rows, which need torch.distributed.
"""

import contextlib
import os
import shutil
import tempfile

import torch

import shardgather
from conftest import on_default_group
from shardgather.export import INDEX_NAME, save_safetensors

T = 20.0


def _spec(dtype, shape, dim, world):
    """A ShardSpec cut as tensor_split cuts (uneven, never fewer than world parts)."""
    sizes = [t.shape[dim] for t in torch.empty(shape).tensor_split(world, dim)]
    return shardgather.ShardSpec(dtype, shape, dim, sizes)


def _specs(world):
    """Four parameters: dim-0 uneven, dim-1, dim-0 uneven, and an empty one."""
    return {
        "attn.q": _spec(torch.float32, (2 * world + 1, 3), 0, world),
        "attn.k": _spec(torch.bfloat16, (4, 2 * world), 1, world),
        "attn.v": _spec(torch.float32, (world + 2, 5), 0, world),
        "norm": _spec(torch.int64, (0, 4), 0, world),
    }


def _full(name, spec):
    n = 1
    for d in spec.full_shape:
        n *= d
    base = sum(map(ord, name))
    return (torch.arange(n, dtype=torch.float64) + base).reshape(spec.full_shape).to(spec.dtype)


def _state(world, rank):
    specs = _specs(world)
    state = {}
    for name, spec in specs.items():
        chunks = _full(name, spec).tensor_split(world, dim=spec.shard_dim)
        state[name] = chunks[rank].contiguous()
    return state, specs


def _drain(stream):
    with stream:
        return [dict(b) for b in stream]


def _stream(group, state, specs, **kw):
    kw.setdefault("timeout", T)
    return _drain(shardgather.unshard_stream(state, specs, group, **kw))


def _export(group, state, specs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("timeout", T)
    return save_safetensors(state, out, specs, group, **kw)


def _renamed(state):
    out = dict(state)
    out["attn.w"] = out.pop("attn.v")
    return out


def _reordered(state):
    keys = list(state)
    keys[0], keys[1] = keys[1], keys[0]
    return {k: state[k] for k in keys}


def _respecced(specs, **change):
    out = dict(specs)
    s = out["attn.q"]
    fields = dict(dtype=s.dtype, full_shape=s.full_shape, shard_dim=s.shard_dim)
    fields.update(change)
    out["attn.q"] = shardgather.ShardSpec(fields["dtype"], fields["full_shape"],
                                          fields["shard_dim"], change.get("sizes", s.sizes))
    return out


# (id, entry, the last rank's change, expected class or "ok", needle, min world)
# A change is a dict of keyword arguments, or a callable (kw, world) -> kw for the inputs.
STREAM_ROWS = [
    ("bucket_bytes_zero", "stream", dict(bucket_bytes=0), "InvalidArgumentError",
     "bucket_bytes must be", 2),
    ("bucket_bytes_negative", "stream", dict(bucket_bytes=-8), "InvalidArgumentError",
     "bucket_bytes must be", 2),
    ("bucket_bytes_str", "stream", dict(bucket_bytes="64"), "InvalidTypeError",
     "bucket_bytes must be an int", 2),
    ("bucket_bytes_bool", "stream", dict(bucket_bytes=True), "InvalidTypeError",
     "bucket_bytes must be an int", 2),
    ("bucket_bytes_differs", "stream", dict(bucket_bytes=64), "MismatchError",
     "bucket_bytes differs", 2),
    ("prefetch_negative", "stream", dict(prefetch=-1), "InvalidArgumentError",
     "prefetch must be", 2),
    ("prefetch_float", "stream", dict(prefetch=1.5), "InvalidTypeError", "prefetch must be an int",
     2),
    ("prefetch_differs", "stream", dict(prefetch=3), "MismatchError", "prefetch differs", 2),
    ("dst_out_of_range", "stream", lambda kw, w: dict(kw, dst=w), "InvalidArgumentError",
     "dst must be a rank", 2),
    ("dst_negative", "stream", dict(dst=-1), "InvalidArgumentError", "dst must be a rank", 2),
    ("dst_str", "stream", dict(dst="0"), "InvalidTypeError", "dst must be an int", 2),
    ("dst_differs", "stream", dict(dst=0), "MismatchError", "dst differs", 2),
    ("copy_str", "stream", dict(copy="yes"), "InvalidTypeError", "copy must be a bool", 2),
    ("copy_differs", "stream", dict(copy=True), "ok", "", 2),
    ("strategy_unknown", "stream", dict(strategy="bogus"), "InvalidArgumentError", "bogus", 2),
    ("strategy_int", "stream", dict(strategy=3), "InvalidTypeError", "strategy must be a str", 2),
    ("strategy_differs", "stream", dict(strategy="packed"), "MismatchError", "strategy differs",
     2),
    ("timeout_negative", "stream", dict(timeout=-1.0), "InvalidArgumentError", "timeout", 2),
    ("timeout_str", "stream", dict(timeout="1"), "InvalidTypeError", "", 2),
    ("timeout_differs", "stream", dict(timeout=T + 5), "ok", "", 2),
    ("spec_missing", "stream", lambda kw, w: dict(kw, specs={k: v for k, v in kw["specs"].items()
                                                             if k != "attn.k"}),
     "InvalidArgumentError", "no spec for 'attn.k'", 2),
    ("spec_extra", "stream", lambda kw, w: dict(kw, specs=dict(kw["specs"], extra=kw["specs"]
                                                               ["norm"])),
     "InvalidArgumentError", "a spec for 'extra'", 2),
    ("spec_not_a_spec", "stream", lambda kw, w: dict(kw, specs=dict(kw["specs"], norm=(0, 4))),
     "InvalidTypeError", "not a shardgather.ShardSpec", 2),
    ("spec_dtype_differs", "stream",
     lambda kw, w: dict(kw, specs=_respecced(kw["specs"], dtype=torch.float64),
                        state=dict(kw["state"], **{"attn.q": kw["state"]["attn.q"].double()})),
     "MismatchError", "dtype is torch.float32 on rank 0, torch.float64", 2),
    ("spec_dim_differs", "stream",
     lambda kw, w: dict(kw, specs=_respecced(kw["specs"], shard_dim=1, full_shape=(2 * w + 1, 3),
                                            sizes=[1] * (w - 1) + [3 - w + 1])),
     "MismatchError", "shard dim is 0 on rank 0, 1", 2),
    ("spec_written_two_ways", "stream",  # default sizes and a negative dim: the same spec
     lambda kw, w: dict(kw, specs=dict(kw["specs"], **{"attn.k": shardgather.ShardSpec(
         torch.bfloat16, (4, 2 * w), -1)})), "ok", "", 2),
    ("keys_renamed", "stream", lambda kw, w: dict(kw, state=_renamed(kw["state"]),
                                                  specs=_renamed(kw["specs"])),
     "MismatchError", "lacks key 'attn.v'", 2),
    ("keys_reordered", "stream", lambda kw, w: dict(kw, state=_reordered(kw["state"]),
                                                    specs=_reordered(kw["specs"])),
     "MismatchError", "key order differs: key 0 is 'attn.q' on rank 0, 'attn.k'", 2),
    ("shards_not_a_list", "stream", lambda kw, w: dict(kw, state=7), "InvalidTypeError",
     "shards must be", 2),
    ("shard_wrong_shape", "stream",
     lambda kw, w: dict(kw, state=dict(kw["state"], **{"attn.q": torch.zeros(9, 3)})),
     "InvalidArgumentError", "should pass a f32 shard", 2),
]

EXPORT_ROWS = [
    ("export_dst_negative", "export", dict(dst=-1), "InvalidArgumentError", "dst must be a rank",
     2),
    ("export_dst_none", "export", dict(dst=None), "InvalidTypeError", "dst must be an int", 2),
    ("export_dst_out_of_range", "export", lambda kw, w: dict(kw, dst=w), "InvalidArgumentError",
     "dst must be a rank", 2),
    ("export_dst_differs", "export", dict(dst=0), "MismatchError", "dst differs", 2),
    ("export_out_dir_int", "export", dict(out=5), "InvalidTypeError", "out_dir must be", 2),
    ("export_progress_str", "export", dict(progress="no"), "InvalidTypeError",
     "progress must be a bool", 2),
    ("export_progress_differs", "export", dict(progress=True), "ok", "", 2),
    ("export_metadata_bad", "export", dict(metadata={"step": 5}), "InvalidTypeError",
     "metadata must be", 2),
    ("export_metadata_differs", "export", dict(metadata={"step": "5"}), "ok", "", 2),
    ("export_bucket_bytes_zero", "export", dict(bucket_bytes=0), "InvalidArgumentError",
     "bucket_bytes must be", 2),
    ("export_prefetch_negative", "export", dict(prefetch=-1), "InvalidArgumentError",
     "prefetch must be", 2),
    ("export_spec_missing", "export",
     lambda kw, w: dict(kw, specs={k: v for k, v in kw["specs"].items() if k != "norm"}),
     "InvalidArgumentError", "no spec for 'norm'", 2),
    ("export_keys_reordered", "export", lambda kw, w: dict(kw, state=_reordered(kw["state"]),
                                                           specs=_reordered(kw["specs"])),
     "MismatchError", "key order differs", 2),
    ("export_writers_zero", "export", dict(writers=0), "InvalidArgumentError",
     "writers must be", 2),
    ("export_writers_past_world", "export", lambda kw, w: dict(kw, writers=w + 1),
     "InvalidArgumentError", "writers must be", 2),
    ("export_writers_str", "export", dict(writers="2"), "InvalidTypeError",
     "writers must be an int", 2),
    ("export_writers_differs", "export", dict(writers=2), "MismatchError", "writers differs", 2),
    ("export_out_dir_unwritable", "export", dict(out="/proc/version/x"), "InvalidArgumentError",
     "consumer raised", 2),
]

PLAN_ROWS = [
    ("plan_dst_out_of_range", "unshard_plan", lambda kw, w: dict(kw, dst=w),
     "InvalidArgumentError", "dst", 2),
    ("plan_dst_negative", "unshard_plan", dict(dst=-1), "InvalidArgumentError", "dst must be", 2),
    ("plan_dst_str", "unshard_plan", dict(dst="0"), "InvalidTypeError", "dst must be an int", 2),
    ("plan_dst_differs", "unshard_plan", dict(dst=0), "MismatchError", "plan differs", 2),
    ("plan_rank_float", "unshard_plan", dict(rank=0.5), "InvalidTypeError", "rank must be an int",
     2),
    ("plan_world_bool", "unshard_plan", dict(world_size=True), "InvalidTypeError",
     "world_size must be an int", 2),
    ("plan_strategy_unknown", "unshard_plan", dict(strategy="bogus"), "InvalidArgumentError",
     "bogus", 2),
    ("plan_timeout_negative", "unshard_plan", dict(timeout=-2.0), "InvalidArgumentError",
     "timeout", 2),
    ("plan_specs_not_specs", "unshard_plan", lambda kw, w: dict(kw, specs=[1, 2]),
     "InvalidTypeError", "", 2),
    ("plan_async_str", "unshard_plan", dict(async_op="yes"), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("plan_started_bad_dst", "unshard_plan_started", lambda kw, w: dict(kw, dst=w),
     "InvalidArgumentError", "dst", 2),
    ("plan_outputs_wrong_shape", "unshard_plan",
     lambda kw, w: dict(kw, outputs=[torch.empty(1) for _ in kw["specs"]]),
     "InvalidArgumentError", "output", 2),
    ("allgather_create_strategy_int", "allgather_create", dict(strategy=1), "InvalidTypeError",
     "strategy must be a str", 2),
    ("allgather_create_preflight_str", "allgather_create", dict(preflight="x"),
     "InvalidTypeError", "preflight must be a bool", 2),
    ("allgather_create_timeout_negative", "allgather_create", dict(timeout=-3.0),
     "InvalidArgumentError", "timeout", 2),
    ("allgather_execute_out_small", "allgather_plan", dict(plan_out=torch.empty(1)),
     "InvalidArgumentError", "out", 2),
    ("allgather_plan_rank_str", "allgather_plan", dict(rank="0"), "InvalidTypeError",
     "rank must be an int", 2),
    ("allgather_plan_strategy", "allgather_plan", dict(strategy="bogus"), "InvalidArgumentError",
     "bogus", 2),
    ("unshard_async_str", "unshard", dict(async_op=1), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("unshard_started_timeout", "unshard_started", dict(timeout=-1.0),
     "InvalidArgumentError", "timeout", 2),
    ("unshard_preflight_str", "unshard", dict(preflight="yes"), "InvalidTypeError",
     "preflight must be a bool", 2),
    ("unshard_specs_int", "unshard", dict(specs=3), "InvalidTypeError", "specs must be", 2),
    ("unshard_dtype_differs", "unshard",
     lambda kw, w: dict(kw, specs=_respecced(kw["specs"], dtype=torch.float64),
                        state=dict(kw["state"], **{"attn.q": kw["state"]["attn.q"].double()})),
     "MismatchError", "dtype of tensor 0 differs", 2),
    ("foreach_strategy_int", "foreach", dict(strategy=1), "InvalidTypeError",
     "strategy must be a str", 2),
    ("foreach_timeout_str", "foreach", dict(timeout="3"), "InvalidTypeError",
     "timeout must be a number", 2),
    ("foreach_started_strategy", "foreach", dict(strategy="bogus", async_op=True),
     "InvalidArgumentError", "bogus", 2),
    ("unshard_started_names_dtype", "unshard_started",
     lambda kw, w: dict(kw, specs=_respecced(kw["specs"], dtype=torch.float64),
                        state=dict(kw["state"], **{"attn.q": kw["state"]["attn.q"].double()})),
     "MismatchError", "dtype of tensor 0 differs", 2),
    ("plan_started_strategy", "unshard_plan_started", dict(strategy="bogus"),
     "InvalidArgumentError", "bogus", 2),
]

ROWS = STREAM_ROWS + EXPORT_ROWS + PLAN_ROWS


def _reference(world, rank, out):
    state, specs = _state(world, rank)
    return dict(state=state, specs=specs, out=out)


def _apply(change, kw, world):
    return change(kw, world) if callable(change) else dict(kw, **change)


def _wait(result):
    """A started call's result (its error, raised here on every rank)."""
    return result.wait() if isinstance(result, shardgather.Work) else result


def _run(entry, kw, group, rank, world):
    kw = dict(kw)
    state, specs, out = kw.pop("state"), kw.pop("specs"), kw.pop("out")
    if entry == "stream":
        return _stream(group, state, specs, **kw)
    if entry == "export":
        return _export(group, state, specs, out, **kw)
    names = list(state)
    shards = [state[k] for k in names]
    spec_list = [specs[k] for k in names] if isinstance(specs, dict) else specs
    if entry in ("unshard_plan", "unshard_plan_started"):
        async_op = kw.pop("async_op", entry.endswith("_started"))
        outputs = kw.pop("outputs", None)
        kw.setdefault("world_size", world)
        kw.setdefault("rank", rank)
        kw.setdefault("timeout", T)
        plan = shardgather.UnshardPlan(spec_list, **kw)
        return _wait(plan.execute(shards, group, outputs, async_op=async_op))
    if entry in ("unshard", "unshard_started"):
        kw.setdefault("async_op", entry.endswith("_started"))
        kw.setdefault("timeout", T)
        return _wait(shardgather.unshard(shards, spec_list, group, **kw))
    if entry == "allgather_plan":
        plan_out = kw.pop("plan_out", None)
        kw.setdefault("rank", rank)
        plan = shardgather.AllGatherPlan([t.dtype for t in shards], _rows(world), timeout=T,
                                         **kw)
        return plan.execute(shards, group, plan_out)
    if entry == "allgather_create":
        kw.setdefault("timeout", T)
        return shardgather.AllGatherPlan.create(shards, group, _rows(world), **kw).execute(
            shards, group)
    kw.setdefault("timeout", T)
    return _wait(shardgather.foreach_all_gather(shards, group, _rows(world), **kw))


def _rows(world):
    """Every rank's shard shapes (rank r's of each parameter, as _state cuts them)."""
    out = []
    for r in range(world):
        state, _ = _state(world, r)
        out.append([tuple(t.shape) for t in state.values()])
    return out


def _usable(group, rank, world):
    out = shardgather.foreach_all_gather([torch.full((2,), float(rank))], group, timeout=T)
    assert all(torch.equal(out[0][r], torch.full((2,), float(r))) for r in range(world))


def run_rows(rows, rank, world, group):
    """Runs each row; raises naming every row whose outcome is wrong on this rank."""
    odd = rank == world - 1
    wrong, ran = [], 0
    out = tempfile.mkdtemp(prefix="sg-round3-")
    try:
        for rid, entry, change, cls, needle, min_world in rows:
            if world < min_world:
                continue
            kw = _reference(world, rank, os.path.join(out, rid))
            if odd:
                kw = _apply(change, kw, world)
            if entry == "export" and "dst" not in kw:
                kw["dst"] = world - 1  # the writer is the rank whose arguments change
            got = "ok"
            try:
                _run(entry, kw, group, rank, world)
            except shardgather.ShardgatherError as e:
                got = type(e).__name__
                if cls != "ok" and needle not in str(e):
                    wrong.append("%s: message lacks %r: %s" % (rid, needle, e))
                if got == "CollectiveTimeout":
                    wrong.append("%s: waited for the deadline: %s" % (rid, e))
                    break  # the group is spoiled
            if got != cls:
                wrong.append("%s: expected %s, got %s" % (rid, cls, got))
            _usable(group, rank, world)
            ran += 1
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))
    return ran


def check_stream_rows(rank, world, group):
    run_rows(STREAM_ROWS, rank, world, group)


def check_export_rows(rank, world, group):
    run_rows(EXPORT_ROWS, rank, world, group)


def check_plan_rows(rank, world, group):
    run_rows(PLAN_ROWS, rank, world, group)


def check_zero_element_buckets(rank, world, group):
    """Buckets of zero-element parameters (a whole model of them, and one such bucket among
    others) carry their names and shapes, on every receiving rank."""
    empty = {"a": shardgather.ShardSpec(torch.float32, (0, 3), 0),
             "b": shardgather.ShardSpec(torch.bfloat16, (4, 0), 1)}
    state = {k: torch.empty(s.full_shape, dtype=s.dtype).tensor_split(world, s.shard_dim)[rank]
             for k, s in empty.items()}
    for dst in (None, 0):
        buckets = _stream(group, state, empty, bucket_bytes=64, dst=dst)
        if dst is None or rank == dst:
            got = {k: t for b in buckets for k, t in b.items()}
            assert list(got) == ["a", "b"], buckets
            assert got["a"].shape == (0, 3) and got["b"].shape == (4, 0)
            assert got["b"].dtype == torch.bfloat16
    full, specs = _state(world, rank)
    mixed_state = dict(full, **{"z0": state["a"], "z1": state["b"]})
    mixed_specs = dict(specs, z0=empty["a"], z1=empty["b"])
    buckets = _stream(group, mixed_state, mixed_specs, bucket_bytes=64)
    names = [k for b in buckets for k in b]
    assert names == list(mixed_specs), names
    for b in buckets:
        for k, t in b.items():
            assert tuple(t.shape) == tuple(mixed_specs[k].full_shape), (k, t.shape)


def check_export_key_collision(rank, world, group):
    """Keys 1 and "1" would be one safetensors name: refused on every rank, nothing written."""
    spec = shardgather.ShardSpec(torch.float32, (world, 2), 0)
    shard = torch.ones(1, 2)
    out = tempfile.mkdtemp(prefix="sg-collide-")
    try:
        try:
            save_safetensors({1: shard, "1": shard}, out, {1: spec, "1": spec}, group,
                             progress=False, timeout=T)
        except shardgather.InvalidArgumentError as e:
            assert "once converted to str" in str(e), str(e)
        else:
            raise AssertionError("keys 1 and '1' were accepted")
        assert os.listdir(out) == [], os.listdir(out)
        _usable(group, rank, world)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def check_export_premade_stream(rank, world, group):
    """A stream made beforehand, saved with another dst on one rank: every rank raises, and
    the stream is still usable for the next save on every rank."""
    state, specs = _state(world, rank)
    out = tempfile.mkdtemp(prefix="sg-premade-")
    try:
        stream = shardgather.unshard_stream(state, specs, group, dst=world - 1, timeout=T)
        try:
            save_safetensors(stream, out, dst=0 if rank == world - 1 else world - 1,
                             progress=False, timeout=T)
        except shardgather.InvalidArgumentError as e:
            assert "the stream gathers to %d, not dst=0" % (world - 1) in str(e), str(e)
        else:
            raise AssertionError("a stream saved with another dst succeeded")
        _usable(group, rank, world)
        index = save_safetensors(stream, out, dst=world - 1, progress=False, timeout=T)
        assert (index is not None) == (rank == world - 1)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def check_export_replaces_atomically(rank, world, group):
    """An export over an older checkpoint: a failed one (the consumer raises on dst after the
    first file) leaves the older one whole; a successful one with fewer files leaves none of
    the older one's behind; other files stay."""
    from safetensors import safe_open

    out = tempfile.mkdtemp(prefix="sg-atomic-")
    try:
        state, specs = _state(world, rank)
        big = {k + ".old": v for k, v in state.items()}
        big_specs = {k + ".old": v for k, v in specs.items()}
        _export(group, big, big_specs, out, bucket_bytes=64)
        if rank == 0:
            with open(os.path.join(out, "config.json"), "w") as f:
                f.write("{}")
        before = _listing(out) if rank == 0 else None
        # A write failure on dst in the middle of the export (its second file).
        import shardgather.export as export
        from shardgather.checkpoint_dir import CheckpointWriter

        real, calls = export.save_file, []

        def failing(tensors, path, metadata=None):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device (injected)")
            return real(tensors, path, metadata=metadata)

        def failing_commit(self, index):
            raise OSError(5, "Input/output error (injected)")

        # (what fails, the class every rank raises, what the message names, on which ranks)
        for target, name, fake, cls, needles, named_on in (
                (export, "save_file", failing, shardgather.ShardgatherError, ["No space left"],
                 rank == 0),
                # A commit that fails on dst, after every bucket arrived: every rank is told.
                (CheckpointWriter, "commit", failing_commit, shardgather.InvalidArgumentError,
                 ["committing the checkpoint", "injected"], True)):
            with _patched(target, name, fake):
                try:
                    _export(group, state, specs, out, bucket_bytes=64)
                except cls as e:
                    assert not named_on or all(n in str(e) for n in needles), str(e)
                else:
                    raise AssertionError("the failed %s succeeded on rank %d" % (name, rank))
            if rank == 0:
                assert _listing(out) == before, "a failed %s changed the older checkpoint" % name
        _export(group, state, specs, out, bucket_bytes=1 << 20)
        if rank == 0:
            names = sorted(os.listdir(out))
            assert names == sorted(["config.json", INDEX_NAME,
                                    "model-00001-of-00001.safetensors"]), names
            with safe_open(os.path.join(out, "model-00001-of-00001.safetensors"), "pt") as f:
                assert sorted(f.keys()) == sorted(specs)
    finally:
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)


@contextlib.contextmanager
def _patched(obj, name, value):
    """``obj.name`` is ``value`` inside the block."""
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


def _listing(path):
    """{name: bytes} of the files in ``path``."""
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


CHECKS = [check_stream_rows, check_export_rows, check_plan_rows, check_zero_element_buckets,
          check_export_key_collision, check_export_premade_stream]


for _check in CHECKS + [check_export_replaces_atomically]:
    globals()["case_" + _check.__name__[len("check_"):]] = on_default_group(_check)


def case_full_tensors_rows(rank, world):
    """full_tensors over DTensors: dict keys that differ or come in another order, a dtype
    that differs in a list (named as the dtype), an unsupported placement on one rank, bad
    strategy and timeout values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from dtensor_cases import without_collectives

    mesh = init_device_mesh("cpu", (world,))
    odd = rank == world - 1

    def dt(shape, dtype=torch.float32):
        # Without collectives: distribute_tensor communicates, and layouts that differ by rank
        # would break torch's own collective before ours runs.
        full = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape).to(dtype)
        return without_collectives(full, mesh, 0)

    rows = [
        ("keys_reordered", lambda: {"b": dt((5, 2)), "a": dt((3, 2))} if odd else
         {"a": dt((3, 2)), "b": dt((5, 2))}, {}, "MismatchError", "key order differs"),
        ("keys_renamed", lambda: {"a": dt((3, 2)), "c": dt((5, 2))} if odd else
         {"a": dt((3, 2)), "b": dt((5, 2))}, {}, "MismatchError", "lacks key 'b'"),
        ("dtype_in_list", lambda: [dt((3, 2)), dt((5, 2), torch.float64 if odd else
                                                  torch.float32)], {},
         "MismatchError", "dtype of tensor 1 differs"),
        ("dtype_in_dict", lambda: {"a": dt((3, 2)), "b": dt((5, 2), torch.float64 if odd else
                                                            torch.float32)}, {},
         "MismatchError", "dtype is torch.float32 on rank 0, torch.float64"),
        ("partial_on_one_rank", lambda: [dt((3, 2)), DTensor.from_local(
            torch.ones(4, 2), mesh, [Partial()]) if odd else dt((4 * world, 2))], {},
         "InvalidArgumentError", "placement Partial"),
        ("strategy_int", lambda: [dt((3, 2))], {"strategy": 2} if odd else {},
         "InvalidTypeError", "strategy must be a str"),
        ("strategy_unknown", lambda: [dt((3, 2))], {"strategy": "bogus"} if odd else {},
         "InvalidArgumentError", "bogus"),
        ("timeout_negative", lambda: [dt((3, 2))], {"timeout": -1.0} if odd else {},
         "InvalidArgumentError", "timeout"),
        ("shape_in_dict", lambda: {"a": dt((4 if odd else 3, 2))}, {}, "MismatchError",
         "full shape is [3, 2] on rank 0, [4, 2]"),
    ]
    wrong = []
    for rid, make, kw, cls, needle in rows:
        kw = dict(kw)
        kw.setdefault("timeout", T)
        try:
            shardgather.full_tensors(make(), **kw)
            got = "ok"
        except shardgather.ShardgatherError as e:
            got = type(e).__name__
            if needle not in str(e):
                wrong.append("%s: message lacks %r: %s" % (rid, needle, e))
            if got == "CollectiveTimeout":
                wrong.append("%s: waited for the deadline" % rid)
                break
        if got != cls:
            wrong.append("%s: expected %s, got %s" % (rid, cls, got))
        _usable(None, rank, world)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))


def case_stream_mesh_without_group(rank, world):
    """A stream over DTensors on a 2-D mesh that spans part of the world, without group=:
    InvalidArgumentError on the mesh's ranks from the constructor, before any exchange (the
    mesh's ranks cannot agree over the world: the others make no call)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if world < 3:
        return
    mesh = DeviceMesh("cpu", [[0], [1]])  # every rank builds it: its sub-groups are collective
    if rank > 1:
        return
    t = DTensor.from_local(torch.ones(1, 3), mesh, [Shard(0), Replicate()], run_check=False,
                           shape=(2, 3), stride=(3, 1))
    try:
        shardgather.unshard_stream({"w": t}, timeout=T)
    except shardgather.InvalidArgumentError as e:
        assert "pass group=" in str(e), str(e)
    else:
        raise AssertionError("a mesh over part of the world streamed without group=")


CASES = sorted(k for k in globals() if k.startswith("case_"))
