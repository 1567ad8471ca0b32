"""Reliability round 4 (docs/reliability.md, "Round 4"): the reshard, quantized transfers and
weight sync keep the error contract.

- Steps: every call an operation makes inside itself (an agreement, a shapes gather, an amax
  exchange, a payload, a weight sync's rounds) carries its stage in the header, so it never
  pairs with another rank's other call: MismatchError naming both, on every rank.
- Family A: a destination whose elements share memory (as_strided, expand) is refused on every
  rank before anything moves, its bytes untouched; views that interleave without sharing work.
- An empty dequantized destination box off a block edge is no error on any rank.
- The generated disagreement family (2.8b) over every argument of ReshardPlan (constructor and
  execute), reshard, the layout helpers, quantize= on every entry point and WeightSync
  (constructor, sync, start, rebuild, read): every rank ends alike (the same class naming the
  cause, or success where the argument is local), within T / 3, and the group stays usable.
- The figures and classes of round 4's findings: CountOverflow for a layout past 64 bits from
  execute and bytes_sent alike, a quantized plan's byte counts those of what moves, a trainer's
  version, the quantization functions' argument errors.

The check_* functions take (rank, world, group) and run on any backend (a spawned Gloo group
with group=None, the threads backend, MPI); the case_* wrappers are the Gloo entries.
"""

import os
import shutil
import tempfile
import time

import numpy
import torch
from torch.distributed.tensor import Shard

import shardgather
from conftest import on_default_group
from round3_cases import _usable
from shardgather import quantized
from shardgather.layouts import (Box, TensorLayout, column_parallel, expert_boxes, fused_qkv,
                                 placement_boxes, replicated, row_parallel, target_boxes,
                                 vocab_parallel)
from weight_sync_cases import _split

T = 20.0
WS_T = 4.0  # weight-sync rows: the readers-held row waits half of it
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.contiguous().view(_BITS[t.element_size()])


def _same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(_bits(a), _bits(b))


def _full(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _region(t, box):
    return t[tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))]


def _rows(shape, world):
    """FSDP's rows: rank r holds piece r of dim 0 (uneven)."""
    return [(r, Box((o,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])))
            for r, (o, n) in enumerate(_split(shape[0], world))]


def _cols(shape, world):
    """A column split of the last dim, rank r piece r."""
    return [(r, Box((0,) * (len(shape) - 1) + (o,), tuple(shape[:-1]) + (n,)))
            for r, (o, n) in enumerate(_split(shape[-1], world))]


def _model(world):
    """Two tensors: FSDP rows into a TP column split (mxfp8's blocks: 1 x 32, columns of 64),
    and a 1-d one replicated on every rank (it travels plain under quantize)."""
    a = (4 * world + 3, 64 * world)
    return [TensorLayout(a, torch.bfloat16, _rows(a, world), _cols(a, world)),
            TensorLayout((5,), torch.float32, [(0, Box((0,), (5,)))],
                         [(r, Box((0,), (5,))) for r in range(world)])]


def _fulls(layouts):
    return [_full(t.shape, t.dtype, seed=40 + i) for i, t in enumerate(layouts)]


def _mine(layouts, rank, side):
    return [(i, box) for i, t in enumerate(layouts) for r, box in getattr(t, side) if r == rank]


def _sources(layouts, rank, fulls=None):
    fulls = fulls or _fulls(layouts)
    return [_region(fulls[i], box).clone() for i, box in _mine(layouts, rank, "sources")]


def _destinations(layouts, rank):
    return [torch.zeros(tuple(box[1]), dtype=layouts[i].dtype)
            for i, box in _mine(layouts, rank, "destinations")]


def _outcome(call):
    """(class name or "ok", message, seconds)."""
    began = time.monotonic()
    try:
        result = call()
        if isinstance(result, shardgather.Work):
            result.wait()
    except shardgather.ShardgatherError as e:
        return type(e).__name__, str(e), time.monotonic() - began
    return "ok", "", time.monotonic() - began


def _judge(rid, got, message, seconds, want, needle, wrong):
    """Appends to ``wrong`` what is wrong with one rank's outcome of row ``rid``; returns
    whether the group may still be used."""
    if got != want:
        wrong.append("%s: expected %s, got %s: %s" % (rid, want, got, message[:300]))
    elif want != "ok" and needle not in message:
        wrong.append("%s: message lacks %r: %s" % (rid, needle, message[:400]))
    if got == "CollectiveTimeout" or seconds > T / 3:
        wrong.append("%s: waited %.1f s (the deadline, not the header)" % (rid, seconds))
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Steps of compound operations never pair with another call.


def _foreach_int(group, quantize=None, hint=None):
    return shardgather.foreach_all_gather([torch.arange(3, dtype=torch.int64)], group, hint,
                                          timeout=T, quantize=quantize)


def _foreach_rows(group, world, rank, quantize=None):
    shapes = [[(2 + r, 64)] for r in range(world)]
    mine = _full((2 + rank, 64), torch.bfloat16, seed=rank)
    return shardgather.foreach_all_gather([mine], group, shapes, timeout=T, quantize=quantize)


def _unshard(group, world, rank, quantize=None):
    spec = shardgather.ShardSpec(torch.bfloat16, (4 * world + 3, 64),
                                 0, [n for _, n in _split(4 * world + 3, world)])
    mine = _full((spec.sizes[rank], 64), torch.bfloat16, seed=rank)
    return shardgather.unshard([mine], [spec], group, timeout=T, quantize=quantize)


def _reshard(group, world, rank, quantize=None):
    layouts = _model(world)
    plan = shardgather.ReshardPlan(layouts, world, rank, timeout=T, quantize=quantize)
    return plan.execute(_sources(layouts, rank), _destinations(layouts, rank), group)


def _ws_layouts(world):
    a = (4 * world, 16)
    return [TensorLayout(a, torch.float32, _rows(a, world),
                         [(r, box) for r, (_, box) in zip(range(world), _rows(a, world)[1:] +
                                                          _rows(a, world)[:1])])]


def _weight_sync(group, world, rank, version=1, **kw):
    layouts = _ws_layouts(world)
    kw.setdefault("timeout", T)
    ws = shardgather.WeightSync(layouts, group, **kw)
    return ws.sync(version, _sources(layouts, rank))


def _stream(group, world, rank):
    spec = shardgather.ShardSpec(torch.float32, (2 * world, 3), 0)
    with shardgather.unshard_stream({"w": torch.ones(2, 3)}, {"w": spec}, group,
                                    timeout=T) as stream:
        return [dict(b) for b in stream]


def _export(group, world, rank, out):
    from shardgather.export import save_safetensors

    spec = shardgather.ShardSpec(torch.float32, (2 * world, 3), 0)
    return save_safetensors({"w": torch.ones(2, 3)}, out, {"w": spec}, group, timeout=T,
                            progress=False)


# (id, the others' call, the last rank's call, what the message names: the last rank's step)
STEP_ROWS = [
    ("foreach_quantized_vs_plain_no_hint", lambda g, w, r, o: _foreach_int(g),
     lambda g, w, r, o: _foreach_int(g, "mxfp8"), "foreach_all_gather(quantize): shapes"),
    ("foreach_quantized_vs_plain_hint", lambda g, w, r, o: _foreach_rows(g, w, r),
     lambda g, w, r, o: _foreach_rows(g, w, r, "mxfp8"),
     "foreach_all_gather(quantize): agreement"),
    ("unshard_quantized_vs_plain", lambda g, w, r, o: _unshard(g, w, r),
     lambda g, w, r, o: _unshard(g, w, r, "mxfp8"), "unshard(quantize): agreement"),
    ("reshard_quantized_vs_plain", lambda g, w, r, o: _reshard(g, w, r),
     lambda g, w, r, o: _reshard(g, w, r, "mxfp8"), "quantize spec "),
    ("unshard_quantized_vs_foreach_quantized", lambda g, w, r, o: _foreach_rows(g, w, r, "mxfp8"),
     lambda g, w, r, o: _unshard(g, w, r, "mxfp8"), "unshard(quantize): agreement"),
    ("weight_sync_vs_reshard", lambda g, w, r, o: _reshard(g, w, r),
     lambda g, w, r, o: _weight_sync(g, w, r), "WeightSync.sync: state"),
    ("weight_sync_vs_foreach", lambda g, w, r, o: _foreach_int(g),
     lambda g, w, r, o: _weight_sync(g, w, r), "WeightSync.sync: state"),
    ("stream_vs_foreach", lambda g, w, r, o: _foreach_int(g),
     lambda g, w, r, o: _stream(g, w, r), "unshard_stream: agreement"),
    ("export_vs_stream", lambda g, w, r, o: _stream(g, w, r),
     lambda g, w, r, o: _export(g, w, r, o), "save_safetensors: agreement"),
]


def check_steps_never_pair(rank, world, group):
    """Each row: the last rank makes a compound operation's call, the others a call of their
    own whose first collective looks alike; every rank raises MismatchError naming the step."""
    odd = rank == world - 1
    wrong = []
    out = tempfile.mkdtemp(prefix="sg-round4-")
    try:
        for rid, theirs, mine, step in STEP_ROWS:
            call = mine if odd else theirs
            got, message, seconds = _outcome(
                lambda: call(group, world, rank, os.path.join(out, rid)))
            # A step's name, or the start of it (a quantized plan's names its spec's hash).
            for needle in ("operation differs", "as the step '%s" % step):
                if not _judge(rid, got, message, seconds, "MismatchError", needle, wrong):
                    break
            _usable(group, rank, world)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))


# ---------------------------------------------------------------------------------------------
# Family A: destinations whose elements share memory.


def _aliased(shape, dtype, kind):
    """A view of ``shape`` ([rows, cols]) whose elements share memory, over a sentinel-filled
    storage: "rows" (strides [1, 1]), "half" ([cols // 2, 1]), "expand" ([0, 1])."""
    rows, cols = shape
    strides = {"rows": (1, 1), "half": (max(1, cols // 2), 1), "expand": (0, 1)}[kind]
    reach = strides[0] * (rows - 1) + strides[1] * (cols - 1) + 1
    storage = torch.full((reach,), 3.0).to(dtype)
    return storage.as_strided(shape, strides), storage


def _alias_layout(world):
    """Every rank holds its rows of a [4 * world, 64] bf16 tensor and wants all of them (its
    destination has 4 * world rows, so rows that overlap are rows it receives)."""
    a = (4 * world, 64)
    return [TensorLayout(a, torch.bfloat16, _rows(a, world),
                         [(r, Box((0, 0), a)) for r in range(world)])]


def check_aliasing_destinations(rank, world, group):
    """A destination whose elements share memory, on the last rank only, of a reshard (as_strided
    rows, half-overlapping rows, an expanded row), of a quantized reshard (the FP8 data of a
    (data, scales) pair; a bf16 tensor to dequantize into) and of an in-place weight sync:
    InvalidArgumentError naming it on every rank before anything moves, its storage as it was;
    the group usable after each."""
    odd = rank == world - 1
    layouts = _alias_layout(world)
    fulls = _fulls(layouts)
    wrong = []
    shape = tuple(layouts[0].shape)
    for kind in ("rows", "half", "expand"):
        for quantize in (None, "mxfp8", ("mxfp8", "pair")):
            rid = "alias_%s_%s" % (kind, quantize if not isinstance(quantize, tuple) else "pair")
            fmt = quantize[0] if isinstance(quantize, tuple) else quantize
            dest, storage = _aliased(shape, torch.bfloat16, kind) if odd else (
                torch.zeros(shape, dtype=torch.bfloat16), None)
            if isinstance(quantize, tuple):  # (FP8 data, scales): the data aliases
                sbox = quantized.scale_box(fmt, shape, Box((0, 0), shape))
                data = (_aliased(shape, torch.uint8, kind)[0] if odd
                        else torch.zeros(shape, dtype=torch.uint8))
                storage = data if odd else None
                dest = (data.view(torch.float8_e4m3fn) if not odd else data,
                        torch.zeros(sbox.size, dtype=torch.uint8).view(torch.float8_e8m0fnu))
            before = None if storage is None else storage.clone()
            got, message, seconds = _outcome(lambda: shardgather.reshard(
                _sources(layouts, rank, fulls), [dest], layouts, group, timeout=T,
                quantize=fmt))
            if not _judge(rid, got, message, seconds, "InvalidArgumentError", "share memory",
                          wrong):
                break
            if before is not None and not torch.equal(_bits(before), _bits(storage)):
                wrong.append("%s: the refused destination was written" % rid)
            _usable(group, rank, world)
    # An in-place weight sync whose destination aliases (raised by its first sync).
    ws_layouts = _alias_layout(world)
    views = [_aliased(shape, torch.bfloat16, "rows")[0] if odd
             else torch.zeros(shape, dtype=torch.bfloat16)]
    got, message, seconds = _outcome(lambda: shardgather.WeightSync(
        ws_layouts, group, mode="in_place", destinations=views, timeout=T).sync(
            1, _sources(ws_layouts, rank, fulls)))
    _judge("alias_weight_sync_in_place", got, message, seconds, "InvalidArgumentError",
           "share memory", wrong)
    _usable(group, rank, world)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))


def check_interleaved_destinations_work(rank, world, group):
    """Views that interleave without sharing an element (strides no order proves apart, as
    [2, 3] over [3, 2]), and a transposed one: written exactly, on every rank."""
    a = (3 * world, 2)
    layouts = [TensorLayout(a, torch.float32, _rows(a, world),
                            [(r, Box((3 * r, 0), (3, 2))) for r in range(world)])]
    fulls = _fulls(layouts)
    storage = torch.full((8,), -1.0)
    inter = storage.as_strided((3, 2), (2, 3))
    shardgather.reshard(_sources(layouts, rank, fulls), [inter], layouts, group, timeout=T)
    _same_bits(inter.contiguous(), _region(fulls[0], Box((3 * rank, 0), (3, 2))))
    assert float(storage[1]) == -1.0 and float(storage[6]) == -1.0  # no element of the view
    wide = torch.full((2, 3), -1.0)
    shardgather.reshard(_sources(layouts, rank, fulls), [wide.t()], layouts, group, timeout=T)
    _same_bits(wide.t().contiguous(), _region(fulls[0], Box((3 * rank, 0), (3, 2))))


# ---------------------------------------------------------------------------------------------
# A quantized reshard into empty dequantized boxes off block edges.


def check_empty_dequantized_boxes(rank, world, group):
    """Destination boxes with no elements whose offsets fall inside a block (along either dim),
    dequantized into float32 / bfloat16 tensors, next to non-empty ones: success on every rank
    and every non-empty box bit-exact, for every format."""
    from shardgather.quantization import dequantize, quantize

    for fmt in ("fp8_e4m3_128x128", "fp8_e4m3_1x128", "mxfp8"):
        shape = (130 * world, 256)
        full = _full(shape, torch.bfloat16, seed=5)
        dests = []
        for r in range(world):
            dests += [(r, Box((3 + 130 * r, 0), (0, 256))),       # no rows, mid-block
                      (r, Box((7, 50 + r), (5, 0))),               # no columns, mid-block
                      (r, Box((130 * r + 1, 33), (64, 100)))]      # a real box, off the edges
        layouts = [TensorLayout(shape, torch.bfloat16, _rows(shape, world), dests)]
        mine = [box for r, box in dests if r == rank]
        out = [torch.full(tuple(b[1]), 9.0, dtype=torch.float32 if k % 2 else torch.bfloat16)
               for k, b in enumerate(mine)]
        shardgather.reshard(_sources(layouts, rank, [full]), out, layouts, group, timeout=T,
                            quantize=quantized.Quantize(fmt))
        data, scales = quantize(full, fmt)
        for box, got in zip(mine, out):
            _same_bits(got, _region(dequantize(data, scales, fmt, got.dtype), box))


# ---------------------------------------------------------------------------------------------
# The figures and classes round 4 found wrong.


def check_count_overflow_is_one_class(rank, world, group):
    """A layout whose bytes pass 64 bits, and one with a dim past 64 bits: CountOverflowError
    from execute on every rank, and from bytes_sent (this rank alone: no call)."""
    big = 1 << 40
    for layout in (TensorLayout((big, big), torch.float32, [(0, Box((0, 0), (big, big)))],
                                [(r, Box((0, 0), (1, 1))) for r in range(world)]),
                   TensorLayout((1 << 70, 2), torch.float32, [(0, Box((0, 0), (1, 2)))],
                                [(r, Box((0, 0), (1, 2))) for r in range(world)])):
        plan = shardgather.ReshardPlan([layout], world, rank, timeout=T)
        for what, call in (("execute", lambda: plan.execute([], [], group)),
                           ("bytes_sent", lambda: plan.bytes_sent)):
            try:
                call()
            except shardgather.CountOverflowError:
                pass
            else:
                raise AssertionError("%s: no CountOverflowError" % what)
        _usable(group, rank, world)


def check_quantized_plan_counts_what_moves(rank, world, group):
    """A quantized ReshardPlan's byte figures are those of its FP8 data and scales (and its
    amax exchange): here exactly the data (1 byte per element) plus the E8M0 scales (1 per 32)
    each rank receives from others, against twice that for the bf16 plan."""
    layouts = _model(world)
    plain = shardgather.ReshardPlan(layouts, world, rank)
    plan = shardgather.ReshardPlan(layouts, world, rank, quantize="mxfp8")
    received = 0
    for i, box in _mine(layouts, rank, "destinations"):
        for r, held in layouts[i].sources:
            lo = [max(o, p) for o, p in zip(box[0], held[0])]
            hi = [min(o + n, p + m) for o, n, p, m in zip(box[0], box[1], held[0], held[1])]
            n = 1
            for a, b in zip(lo, hi):
                n *= max(0, b - a)
            if r != rank and n:
                if i == 0:
                    received += n + n // 32  # bf16 -> 1 byte, a scale per 32 along the row
                else:
                    received += 4 * n  # float32, 1-d: travels plain
    assert plan.bytes_received == received, (plan.bytes_received, received)
    assert sum(plan.rank_sent) == sum(plan.rank_received)
    assert plan.bytes_received <= 0.52 * plain.bytes_received + 20, (
        plain.bytes_received, plan.bytes_received)
    out = plan.execute(_sources(layouts, rank), [
        torch.zeros(tuple(b[1]), dtype=torch.bfloat16) if i == 0 else
        torch.zeros(tuple(b[1])) for i, b in _mine(layouts, rank, "destinations")], group)
    assert len(out) == len(_mine(layouts, rank, "destinations"))
    # 128 x 128 blocks cut by the FSDP rows (130 per rank), two ranks a host: the figures add
    # the payload's and the amax exchange's, per rank and per host.
    shape = (130 * world, 256)
    cut = [TensorLayout(shape, torch.bfloat16, _rows(shape, world), _cols(shape, world))]
    hosts = [r // 2 for r in range(world)]
    plan = shardgather.ReshardPlan(cut, world, rank, hosts=hosts, quantize="fp8_e4m3_128x128")
    # The payload's figures plus the row of cut blocks' maxima every rank all-gathers: each
    # rank sends its row to every other rank (to each one on another host, for the host ones).
    row, payload = plan._built().amax_row_bytes, plan._built()
    assert (row > 0) == (world > 1), row
    assert plan.bytes_sent == payload.bytes_sent + row * (world - 1)
    assert plan.bytes_received == payload.bytes_received + row * (world - 1)
    assert plan.rank_sent == [v + row * (world - 1) for v in payload.rank_sent]
    off_host = [sum(1 for q in range(world) if hosts[q] != hosts[r]) for r in range(world)]
    for name in ("host_sent", "host_received"):
        want = [v + row * sum(off_host[r] for r in range(world) if hosts[r] == h)
                for h, v in enumerate(getattr(payload, name))]
        assert getattr(plan, name) == want, (name, getattr(plan, name), want)
    assert len(plan.host_sent) == hosts[-1] + 1


def check_trainer_version_follows_commits(rank, world, group):
    """Every rank's version is the last committed one, a source-only rank's too (the classes
    of a sync's bad arguments are the generated rows' ws_*)."""
    a = (4 * world, 8)
    layouts = [TensorLayout(a, torch.float32, [(0, Box((0, 0), a))],
                            [(r, Box((0, 0), a)) for r in range(1, world)] or
                            [(0, Box((0, 0), a))])]
    fulls = _fulls(layouts)
    ws = shardgather.WeightSync(layouts, group, timeout=T)
    assert ws.version == -1
    for v in (3, 7):
        ws.sync(v, _sources(layouts, rank, fulls))
        assert ws.version == v, (rank, ws.version, v)


def check_quantize_functions_raise_their_classes(rank, world, group):
    """shardgather.quantization's functions: a format that is no str, or data that is no tensor,
    raise InvalidTypeError (a TypeError), an unknown format InvalidArgumentError: never the
    binding's raw "incompatible arguments"."""
    from shardgather.quantization import dequantize, quantize

    x = torch.ones(4, 64)
    for call, cls in ((lambda: quantize(x, None), shardgather.InvalidTypeError),
                      (lambda: quantize("x", "mxfp8"), shardgather.InvalidTypeError),
                      (lambda: quantize(x, 5), shardgather.InvalidTypeError),
                      (lambda: quantize(x, "fp9"), shardgather.InvalidArgumentError),
                      (lambda: dequantize(x, None, "mxfp8", torch.float32),
                       shardgather.InvalidTypeError),
                      (lambda: dequantize(*quantize(x, "mxfp8"), None, torch.float32),
                       shardgather.InvalidTypeError),
                      (lambda: dequantize(*quantize(x, "mxfp8"), "mxfp8", "f32"),
                       shardgather.InvalidTypeError)):
        try:
            call()
        except cls as e:
            assert "incompatible" not in str(e), str(e)
        else:
            raise AssertionError("no %s" % cls.__name__)
    del rank, world, group


# ---------------------------------------------------------------------------------------------
# The generated disagreement family, over every argument of the round's entry points.

def _hosts(world):
    return [r // 2 for r in range(world)]


def _run_reshard_plan(kw, group, rank, world):
    """ReshardPlan(...) then execute(...): keywords of both in one dict."""
    kw = dict(kw)
    layouts = kw.pop("layouts")
    exec_kw = {k: kw.pop(k) for k in ("async_op", "device") if k in kw}
    sources = kw.pop("sources", None)
    destinations = kw.pop("destinations", None)
    kw.setdefault("world_size", world)
    kw.setdefault("rank", rank)
    kw.setdefault("timeout", T)
    plan = shardgather.ReshardPlan(layouts, **kw)
    if sources is None:
        sources = _sources(layouts, rank) if isinstance(layouts, list) else []
    if destinations is None:
        destinations = _destinations(layouts, rank) if isinstance(layouts, list) else []
    out = plan.execute(sources, destinations, group, **exec_kw)
    return out.wait() if exec_kw.get("async_op") else out


def _run_reshard(kw, group, rank, world):
    kw = dict(kw)
    layouts = kw.pop("layouts")
    sources = kw.pop("sources", None)
    destinations = kw.pop("destinations", None)
    kw.setdefault("timeout", T)
    return shardgather.reshard(_sources(layouts, rank) if sources is None else sources,
                               _destinations(layouts, rank) if destinations is None
                               else destinations, layouts, group, **kw)


def _run_helpers(kw, group, rank, world):
    """Layouts from the helpers (kw: how the destination side is built), resharded."""
    # world + 1 experts: torch.chunk's split and vLLM's balanced one differ from 3 ranks on
    shape = (world + 1, 4 * world) if kw.get("helper") == "experts" else (8 * world, 4 * world)
    build = kw.get("helper", "column")
    if build == "experts":
        dst = expert_boxes(shape, list(range(world)), split=kw.get("split", "chunk"))
    elif build == "placements":
        dst = placement_boxes(shape, list(range(world)), [Shard(kw.get("dim", 0))])
    elif build == "qkv":  # q, k and v of GQA attention into each rank's fused qkv_proj
        return _run_qkv(kw, group, rank, world)
    elif build == "column":
        dst = column_parallel(shape, kw.get("ranks", list(range(world))))
    elif build == "row":
        dst = row_parallel(shape, kw.get("ranks", list(range(world))))
    elif build == "replicated":
        dst = replicated(shape, list(range(world)))
    else:
        dst = [(s.rank, s.box)
               for s in vocab_parallel(shape, list(range(world)), pad_to=kw.get("pad_to"))]
    layouts = [TensorLayout(shape, torch.float32, _rows(shape, world), dst)]
    return _run_reshard(dict(layouts=layouts), group, rank, world)


def _run_qkv(kw, group, rank, world):
    """fused_qkv's Targets as the destinations of three global tensors (q: 4 heads, k and v:
    ``kv_heads`` heads, head_dim 4, hidden 8)."""
    heads, kv, dim, hidden = 4 * world, kw.get("kv_heads", world), 4, 8
    shapes = {"q": (heads * dim, hidden), "k": (kv * dim, hidden), "v": (kv * dim, hidden)}
    targets = fused_qkv(shapes["q"], shapes["k"], shapes["v"], heads, kv, dim,
                        list(range(world)))
    layouts = [TensorLayout(shapes[p], torch.float32, _rows(shapes[p], world),
                            target_boxes(targets[p])) for p in ("q", "k", "v")]
    return _run_reshard(dict(layouts=layouts), group, rank, world)


def _q_layouts(world):
    return _model(world)


def _run_foreach_q(kw, group, rank, world):
    kw = dict(kw)
    shapes = [[(2 + r, 64)] for r in range(world)]
    mine = [_full((2 + rank, 64), torch.bfloat16, seed=rank)]
    kw.setdefault("timeout", T)
    kw.setdefault("quantize", "mxfp8")
    return _waited(shardgather.foreach_all_gather(mine, group, shapes, **kw))


def _waited(got):
    """A started call's results (its Work waited for), or ``got``."""
    return got.wait() if isinstance(got, shardgather.Work) else got


def _run_unshard_q(kw, group, rank, world):
    kw = dict(kw)
    n = 4 * world + 3
    spec = shardgather.ShardSpec(torch.bfloat16, (n, 64), 0, [s for _, s in _split(n, world)])
    mine = [_full((spec.sizes[rank], 64), torch.bfloat16, seed=rank)]
    kw.setdefault("timeout", T)
    kw.setdefault("quantize", "mxfp8")
    return _waited(shardgather.unshard(mine, [spec], group, **kw))


def _run_stream_q(kw, group, rank, world):
    kw = dict(kw)
    n = 4 * world + 3
    spec = shardgather.ShardSpec(torch.bfloat16, (n, 64), 0, [s for _, s in _split(n, world)])
    kw.setdefault("timeout", T)
    kw.setdefault("quantize", "mxfp8")
    with shardgather.unshard_stream({"w": _full((spec.sizes[rank], 64), torch.bfloat16,
                                                seed=rank)}, {"w": spec}, group,
                                    **kw) as stream:
        return [dict(b) for b in stream]


def _run_export_q(kw, group, rank, world):
    from shardgather.export import save_safetensors

    kw = dict(kw)
    out = kw.pop("out")
    n = 4 * world + 3
    spec = shardgather.ShardSpec(torch.bfloat16, (n, 64), 0, [s for _, s in _split(n, world)])
    kw.setdefault("timeout", T)
    kw.setdefault("quantize", "mxfp8")
    kw.setdefault("progress", False)
    return save_safetensors({"w": _full((spec.sizes[rank], 64), torch.bfloat16, seed=rank)},
                            out, {"w": spec}, group, **kw)


class _Held:
    """A reader holding this rank's in-place tensors for ``seconds`` from another thread."""

    def __init__(self, ws, seconds):
        import threading

        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._hold, args=(ws, seconds), daemon=True)
        self.thread.start()
        self.ready.wait()

    def _hold(self, ws, seconds):
        with ws.read():
            self.ready.set()
            time.sleep(seconds)


def _run_ws(kw, group, rank, world):
    """A WeightSync made and synced once (version 1; the constructor's keywords, then
    ``version``, ``sources``, ``how`` (sync, start, rebuild, read_held))."""
    kw = dict(kw)
    layouts = kw.pop("layouts", None) or _ws_layouts(world)
    version = kw.pop("version", 1)
    sources = kw.pop("sources", None if isinstance(layouts, list) else [])
    how = kw.pop("how", "sync")
    rebuild_kw = kw.pop("rebuild_kw", {})
    kw.setdefault("timeout", WS_T)
    if kw.get("mode") == "in_place" and "destinations" not in kw:
        kw["destinations"] = _destinations(layouts, rank)
    ws = shardgather.WeightSync(layouts, group, **kw)
    if sources is None:
        sources = _sources(layouts, rank)
    if how == "start":
        return ws.start(version, sources).wait()
    if how == "rebuild":
        ws.sync(1, _sources(layouts, rank))
        return ws.rebuild(layouts, group, **rebuild_kw).sync(2, _sources(layouts, rank))
    if how == "read_held":  # an in-place sync whose readers hold the tensors too long
        ws.sync(1, _sources(layouts, rank))
        held = _Held(ws, 0.8 * WS_T) if rank == world - 1 else None
        try:
            return ws.sync(2, _sources(layouts, rank))
        finally:
            if held is not None:
                held.thread.join()
    return ws.sync(version, sources)


RUNNERS = {"reshard_plan": _run_reshard_plan, "reshard_plan_q": _run_reshard_plan,
           "reshard": _run_reshard, "reshard_q": _run_reshard, "helpers": _run_helpers,
           "helpers_vocab": _run_helpers, "helpers_experts": _run_helpers,
           "helpers_placements": _run_helpers, "helpers_qkv": _run_helpers,
           "foreach_q": _run_foreach_q, "unshard_q": _run_unshard_q, "stream_q": _run_stream_q,
           "export_q": _run_export_q, "ws": _run_ws}


def _w(f):
    """A change that depends on the world: f(kw, world) -> kw."""
    return f


def _layouts_kw(kw, world):
    return dict(kw, layouts=_model(world))


def _bad_box(kw, world):
    layouts = _model(world)
    layouts[1] = TensorLayout((5,), torch.float32, [(0, Box((0,), (5,)))],
                              [(r, Box((3,), (5,))) for r in range(world)])
    return dict(kw, layouts=layouts, destinations=[])


def _other_dtype(kw, world):
    layouts = _model(world)
    layouts[1] = TensorLayout((5,), torch.float64, layouts[1].sources, layouts[1].destinations)
    return dict(kw, layouts=layouts)


def _other_shape(kw, world):
    layouts = _model(world)
    a = (4 * world + 4, 64 * world)
    layouts[0] = TensorLayout(a, torch.bfloat16, _rows(a, world), _cols(a, world))
    return dict(kw, layouts=layouts)


def _huge_dim(kw, world):
    layouts = _model(world)
    layouts[1] = TensorLayout((1 << 70,), torch.float32, [(0, Box((0,), (5,)))],
                              [(r, Box((0,), (5,))) for r in range(world)])
    return dict(kw, layouts=layouts, sources=_sources(_model(world), world - 1),
                destinations=_destinations(_model(world), world - 1))


def _str_dim(kw, world):
    layouts = _model(world)
    layouts[1] = TensorLayout(("5",), torch.float32, layouts[1].sources, layouts[1].destinations)
    return dict(kw, layouts=layouts, sources=_sources(_model(world), world - 1),
                destinations=_destinations(_model(world), world - 1))


def _bytes_overflow(kw, world):
    layouts = _model(world)
    big = 1 << 40
    layouts[1] = TensorLayout((big, big), torch.float32, [(0, Box((0, 0), (big, big)))],
                              [(r, Box((0, 0), (1, 1))) for r in range(world)])
    return dict(kw, layouts=layouts, sources=[], destinations=[])


def _fewer_sources(kw, world):
    return dict(kw, sources=_sources(_model(world), world - 1)[:-1])


def _source_dtype(kw, world):
    return dict(kw, sources=[s.double() for s in _sources(_model(world), world - 1)])


def _source_not_tensor(kw, world):
    return dict(kw, sources=["x" for _ in _sources(_model(world), world - 1)])


def _numpy_sources(kw, world):
    return dict(kw, sources=[numpy.zeros(tuple(s.shape), dtype=numpy.float32)
                             for s in _sources(_ws_layouts(world), world - 1)])


def _ws_other_layouts(kw, world):
    a = (4 * world, 16)
    return dict(kw, layouts=[TensorLayout(a, torch.float32, _rows(a, world), _rows(a, world))])


def _ws_bad_layouts(kw, world):
    a = (4 * world, 16)
    return dict(kw, layouts=[TensorLayout(a, torch.float32, _rows(a, world),
                                          [(0, Box((0, 0), (4 * world + 1, 16)))])])


def _ws_fewer_sources(kw, world):
    return dict(kw, sources=_sources(_ws_layouts(world), world - 1)[:0])


def _ws_alias(kw, world):
    mine = [box for r, box in _ws_layouts(world)[0].destinations if r == world - 1]
    view = torch.zeros(64).as_strided(tuple(mine[0][1]), (1, 1))
    return dict(kw, mode="in_place", destinations=[view])


# (id, runner, the last rank's change (a dict of keywords, or f(kw, world) -> kw), expected
# class or "ok" (or a pair: the last rank's, the others'), needle, min world)
ROWS = [
    # ReshardPlan: the constructor's arguments
    ("plan_layout_shape_differs", "reshard_plan", _other_shape, "MismatchError", "differs", 2),
    ("plan_layout_dtype_differs", "reshard_plan", _other_dtype, "MismatchError", "dtype", 2),
    ("plan_layout_box_outside", "reshard_plan", _bad_box, "InvalidArgumentError", "", 2),
    ("plan_layout_dim_2_70", "reshard_plan", _huge_dim, "CountOverflowError",
     "does not fit 64 bits", 2),
    ("plan_layout_dim_str", "reshard_plan", _str_dim, "InvalidTypeError", "must be ints", 2),
    ("plan_layout_bytes_overflow", "reshard_plan", _bytes_overflow, "CountOverflowError", "", 2),
    ("plan_layouts_not_a_list", "reshard_plan", dict(layouts=5, sources=[], destinations=[]),
     "InvalidTypeError", "", 2),
    ("plan_world_differs", "reshard_plan", _w(lambda kw, w: dict(kw, world_size=w + 1)),
     "InvalidArgumentError", "the plan was built for", 2),
    ("plan_world_bool", "reshard_plan", dict(world_size=True), "InvalidTypeError",
     "world_size must be an int", 2),
    ("plan_rank_str", "reshard_plan", dict(rank="0"), "InvalidTypeError", "rank must be an int",
     2),
    ("plan_rank_other", "reshard_plan", dict(rank=0), "InvalidArgumentError",
     "the plan was built for", 2),
    ("plan_hosts_differ", "reshard_plan", _w(lambda kw, w: dict(kw, hosts=[0] * w)),
     "MismatchError", "plan differs", 2),
    ("plan_hosts_short", "reshard_plan", dict(hosts=[0]), "InvalidArgumentError", "hosts", 2),
    ("plan_hosts_str", "reshard_plan", dict(hosts="ab"), "InvalidTypeError", "", 2),
    ("plan_fan_out_differs", "reshard_plan", dict(fan_out=False), "MismatchError",
     "plan differs", 2),
    ("plan_strategy_bogus", "reshard_plan", dict(strategy="bogus"), "InvalidArgumentError",
     "bogus", 2),
    ("plan_strategy_packed", "reshard_plan", dict(strategy="packed"), "InvalidArgumentError",
     "", 2),
    ("plan_strategy_int", "reshard_plan", dict(strategy=1), "InvalidTypeError",
     "strategy must be a str", 2),
    ("plan_preflight_str", "reshard_plan", dict(preflight="yes"), "InvalidTypeError",
     "preflight must be a bool", 2),
    ("plan_timeout_negative", "reshard_plan", dict(timeout=-1.0), "InvalidArgumentError",
     "timeout", 2),
    ("plan_timeout_str", "reshard_plan", dict(timeout="1"), "InvalidTypeError",
     "timeout must be a number", 2),
    ("plan_timeout_differs", "reshard_plan", dict(timeout=T + 5), "ok", "", 2),
    ("plan_device_bucket_zero", "reshard_plan", dict(device_bucket_bytes=0),
     "InvalidArgumentError", "device_bucket_bytes", 2),
    ("plan_device_bucket_differs", "reshard_plan", dict(device_bucket_bytes=4096),
     "MismatchError", "plan differs", 2),
    ("plan_quantize_one_rank", "reshard_plan", dict(quantize="mxfp8"), "MismatchError",
     "operation differs", 2),
    # ReshardPlan.execute's arguments
    ("exec_fewer_sources", "reshard_plan", _fewer_sources, "InvalidArgumentError", "sources",
     2),
    ("exec_source_dtype", "reshard_plan", _source_dtype, "InvalidArgumentError", "", 2),
    ("exec_source_not_tensor", "reshard_plan", _source_not_tensor, "InvalidTypeError", "", 2),
    ("exec_destinations_int", "reshard_plan", dict(destinations=5), "InvalidTypeError", "", 2),
    ("exec_async_str", "reshard_plan", dict(async_op="yes"), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("exec_async_differs", "reshard_plan", dict(async_op=True), "ok", "", 2),
    ("exec_device_bogus", "reshard_plan", dict(device="bogus"), "InvalidArgumentError",
     "device", 2),
    ("exec_device_int_str", "reshard_plan", dict(device=[1]), "InvalidArgumentError", "device",
     2),
    ("exec_device_cpu", "reshard_plan", dict(device="cpu"), "ok", "", 2),
    # reshard(): its own keywords
    ("reshard_timeout_negative", "reshard", dict(layouts=None, timeout=-3.0),
     "InvalidArgumentError", "timeout", 2),
    ("reshard_async_str", "reshard", dict(layouts=None, async_op=2), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("reshard_quantize_one_rank", "reshard", dict(layouts=None, quantize="mxfp8"),
     "MismatchError", "operation differs", 2),
    ("reshard_strategy_direct", "reshard", dict(layouts=None, strategy="direct"), "ok", "", 2),
    ("reshard_strategy_packed", "reshard", dict(layouts=None, strategy="packed"),
     "InvalidArgumentError", "strategy is packed", 2),
    ("reshard_strategy_bogus", "reshard", dict(layouts=None, strategy="bogus"),
     "InvalidArgumentError", "bogus", 2),
    ("reshard_preflight_str", "reshard", dict(layouts=None, preflight="yes"),
     "InvalidTypeError", "preflight must be a bool", 2),
    # the layout helpers: another layout on one rank is another plan
    ("helpers_row_vs_column", "helpers", dict(helper="row"), "MismatchError", "", 2),
    ("helpers_ranks_reversed", "helpers", _w(lambda kw, w: dict(kw, ranks=list(range(w))[::-1])),
     "MismatchError", "", 2),
    ("helpers_replicated", "helpers", dict(helper="replicated"), "MismatchError", "", 2),
    ("helpers_vocab_pad", "helpers_vocab", _w(lambda kw, w: dict(kw, pad_to=12 * w)),
     "MismatchError", "", 2),
    ("helpers_experts_balanced", "helpers_experts", dict(split="balanced"), "MismatchError",
     "", 3),
    ("helpers_placement_dim", "helpers_placements", dict(dim=1), "MismatchError", "", 2),
    ("helpers_qkv_kv_heads", "helpers_qkv", _w(lambda kw, w: dict(kw, kv_heads=2 * w)),
     "MismatchError", "", 2),
    # quantize= on every entry point
    ("foreach_q_format_differs", "foreach_q", dict(quantize="fp8_e4m3_1x128"), "MismatchError",
     "quantize spec", 2),
    ("foreach_q_dequantize_differs", "foreach_q",
     dict(quantize=quantized.Quantize("mxfp8", torch.float32)), "MismatchError",
     "quantize spec", 2),
    ("foreach_q_unknown", "foreach_q", dict(quantize="fp9"), "InvalidArgumentError", "fp9", 2),
    ("foreach_q_int", "foreach_q", dict(quantize=5), "InvalidTypeError", "quantize must be", 2),
    ("foreach_q_none", "foreach_q", dict(quantize=None), "MismatchError", "operation differs",
     2),
    ("foreach_q_async", "foreach_q", dict(async_op=True), "MismatchError", "async_op differs",
     2),
    ("foreach_q_async_str", "foreach_q", dict(async_op="yes"), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("foreach_q_timeout_negative", "foreach_q", dict(timeout=-1.0), "InvalidArgumentError",
     "timeout", 2),
    ("unshard_q_format_differs", "unshard_q", dict(quantize="fp8_e4m3_1x128"), "MismatchError",
     "quantize spec", 2),
    ("unshard_q_unknown", "unshard_q", dict(quantize="fp9"), "InvalidArgumentError", "fp9", 2),
    ("unshard_q_none", "unshard_q", dict(quantize=None), "MismatchError", "operation differs",
     2),
    ("unshard_q_dst_differs", "unshard_q", dict(dst=0), "MismatchError", "dst differs", 2),
    ("unshard_q_async", "unshard_q", dict(async_op=True), "ok", "", 2),
    ("unshard_q_async_str", "unshard_q", dict(async_op=1), "InvalidTypeError",
     "async_op must be a bool", 2),
    ("reshard_q_format_differs", "reshard_q", dict(quantize="fp8_e4m3_1x128"),
     "MismatchError", "quantize spec", 2),
    ("reshard_q_unknown", "reshard_q", dict(quantize="fp9"), "InvalidArgumentError", "fp9", 2),
    ("reshard_q_none", "reshard_q", dict(quantize=None), "MismatchError", "operation differs",
     2),
    ("reshard_q_timeout_str", "reshard_q", dict(timeout="1"), "InvalidTypeError", "timeout", 2),
    ("plan_q_device_cuda", "reshard_plan_q", dict(device="cuda"), "InvalidArgumentError",
     "device", 2),
    ("plan_q_device_cpu", "reshard_plan_q", dict(device="cpu"), "ok", "", 2),
    ("plan_q_async", "reshard_plan_q", dict(async_op=True), "ok", "", 2),
    ("plan_q_format_differs", "reshard_plan_q", dict(quantize="fp8_e4m3_1x128"),
     "MismatchError", "quantize spec", 2),
    ("plan_q_world_differs", "reshard_plan_q", _w(lambda kw, w: dict(kw, world_size=w + 1)),
     "InvalidArgumentError", "", 2),
    ("plan_q_destination_int", "reshard_plan_q",
     _w(lambda kw, w: dict(kw, destinations=[5] * len(_destinations(_model(w), w - 1)))),
     "InvalidTypeError", "destinations[0]", 2),
    ("plan_q_fewer_sources", "reshard_plan_q", _fewer_sources, "InvalidArgumentError",
     "sources", 2),
    ("stream_q_format_differs", "stream_q", dict(quantize="fp8_e4m3_1x128"), "MismatchError",
     "quantize spec", 2),
    ("stream_q_dequantize", "stream_q", dict(quantize=quantized.Quantize("mxfp8",
                                                                          torch.float32)),
     "InvalidArgumentError", "dequantize", 2),
    # A quantized stream moves each bucket as one personal exchange: "packed" on one rank is
    # refused on every rank when the stream is built.
    ("stream_q_strategy", "stream_q", dict(strategy="packed"), "InvalidArgumentError",
     "personal exchange", 2),
    ("export_q_format_differs", "export_q", dict(quantize="fp8_e4m3_1x128"), "MismatchError",
     "quantize spec", 2),
    ("export_q_writers", "export_q", dict(writers=2), "InvalidArgumentError", "writer", 2),
    # WeightSync: the constructor's arguments (raised by the first sync, on every rank)
    ("ws_layouts_differ", "ws", _ws_other_layouts, "MismatchError", "layouts", 2),
    ("ws_layouts_bad", "ws", _ws_bad_layouts, "InvalidArgumentError", "", 2),
    ("ws_layouts_not_a_list", "ws", dict(layouts=5), "InvalidTypeError", "", 2),
    ("ws_mode_bogus", "ws", dict(mode="bogus"), "InvalidArgumentError", "mode must be", 2),
    ("ws_mode_differs", "ws", dict(mode="in_place"), "ok", "", 2),
    ("ws_in_place_no_destinations", "ws", dict(mode="in_place", destinations=[]),
     "InvalidArgumentError", "destinations", 2),
    ("ws_in_place_destinations_int", "ws", dict(mode="in_place", destinations=5),
     "InvalidTypeError", "destinations", 2),
    ("ws_in_place_alias", "ws", _ws_alias, "InvalidArgumentError", "share memory", 2),
    ("ws_chunk_bytes_differs", "ws", dict(chunk_bytes=64), "MismatchError", "chunk_bytes", 2),
    ("ws_chunk_bytes_zero", "ws", dict(chunk_bytes=0), "InvalidArgumentError", "chunk_bytes", 2),
    ("ws_chunk_bytes_twice", "ws", dict(chunk_bytes=64, bucket_bytes=64), "InvalidArgumentError",
     "chunk_bytes was given twice", 2),
    # bucket_bytes, its older name: named as given
    ("ws_bucket_bytes_differs", "ws", dict(bucket_bytes=64), "MismatchError", "chunk_bytes",
     2),
    ("ws_bucket_bytes_zero", "ws", dict(bucket_bytes=0), "InvalidArgumentError",
     "bucket_bytes", 2),
    ("ws_bucket_bytes_str", "ws", dict(bucket_bytes="8"), "InvalidTypeError", "bucket_bytes", 2),
    ("ws_dense_ratio_str", "ws", dict(dense_ratio="1"), "InvalidTypeError", "dense_ratio", 2),
    ("ws_dense_ratio_2", "ws", dict(dense_ratio=2.0), "InvalidArgumentError", "dense_ratio", 2),
    ("ws_dense_ratio_differs", "ws", dict(dense_ratio=0.0), "ok", "", 2),
    ("ws_timeout_negative", "ws", dict(timeout=-1.0), "InvalidArgumentError", "timeout", 2),
    ("ws_timeout_str", "ws", dict(timeout="1"), "InvalidTypeError", "", 2),
    ("ws_timeout_differs", "ws", dict(timeout=WS_T + 1), "ok", "", 2),
    # WeightSync.sync and start
    ("ws_version_2_63", "ws", dict(version=1 << 63), "InvalidArgumentError", "version", 2),
    ("ws_version_negative", "ws", dict(version=-1), "InvalidArgumentError", "version", 2),
    ("ws_version_float", "ws", dict(version=1.5), "InvalidTypeError", "version", 2),
    ("ws_version_differs", "ws", dict(version=2), "InvalidArgumentError", "asked for version",
     2),
    ("ws_sources_numpy", "ws", _numpy_sources, "InvalidTypeError", "torch.Tensor", 2),
    ("ws_sources_fewer", "ws", _ws_fewer_sources, "InvalidArgumentError", "sources", 2),
    ("ws_sources_int", "ws", dict(sources=5), "InvalidTypeError", "sources", 2),
    ("ws_start_version_2_63", "ws", dict(how="start", version=1 << 63), "InvalidArgumentError",
     "version", 2),
    ("ws_start_sources_numpy", "ws", _w(lambda kw, w: dict(_numpy_sources(kw, w), how="start")),
     "InvalidTypeError", "torch.Tensor", 2),
    # WeightSync.rebuild and read
    ("ws_rebuild_unknown_keyword", "ws", dict(how="rebuild", rebuild_kw=dict(bogus=1)),
     "InvalidTypeError", "bogus", 2),
    ("ws_rebuild_bucket_bytes", "ws", dict(how="rebuild", rebuild_kw=dict(bucket_bytes=64)),
     "MismatchError", "chunk_bytes", 2),
    ("ws_rebuild_chunk_bytes", "ws", dict(how="rebuild", rebuild_kw=dict(chunk_bytes=64)),
     "MismatchError", "chunk_bytes", 2),
    ("ws_rebuild_in_place_no_destinations", "ws",
     dict(how="rebuild", rebuild_kw=dict(mode="in_place")), "InvalidArgumentError",
     "destinations", 2),
    ("ws_read_held_in_place", "ws", dict(how="read_held", mode="in_place"),
     ("ReadersHeldError", "RemoteError"), "", 2),
]


def _reference(runner, world, rank, out):
    kw = {}
    if runner in ("reshard_plan", "reshard_plan_q", "reshard", "reshard_q"):
        kw["layouts"] = _model(world)
    if runner in ("reshard_plan_q", "reshard_q"):
        kw["quantize"] = "mxfp8"
    if runner.startswith("helpers_"):
        kw["helper"] = runner[len("helpers_"):]
    if runner == "export_q":
        kw["out"] = out
    return kw


def _apply(change, kw, world):
    kw = change(kw, world) if callable(change) else dict(kw, **change)
    if kw.get("layouts", 0) is None:
        kw["layouts"] = _model(world)
    return kw


def run_rows(rows, rank, world, group):
    odd = rank == world - 1
    wrong, ran = [], 0
    out = tempfile.mkdtemp(prefix="sg-round4-")
    try:
        for rid, runner, change, want, needle, min_world in rows:
            if world < min_world:
                continue
            kw = _reference(runner, world, rank, os.path.join(out, rid))
            if odd:
                kw = _apply(change, kw, world)
            elif runner == "ws" and "how" in (change if isinstance(change, dict) else {}):
                kw["how"] = change["how"]  # the others rebuild / read too, unchanged
                if change["how"] == "read_held":
                    kw["mode"] = "in_place"
            elif runner == "ws" and callable(change) and rid.startswith("ws_start"):
                kw["how"] = "start"
            if isinstance(want, tuple):
                want = want[0] if odd else want[1]
            got, message, seconds = _outcome(lambda: RUNNERS[runner](kw, group, rank, world))
            usable = _judge(rid, got, message, seconds, want, needle, wrong)
            if not usable:
                break
            _usable(group, rank, world)
            ran += 1
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))
    return ran


def check_reshard_rows(rank, world, group):
    run_rows([r for r in ROWS if r[1] in ("reshard_plan", "reshard_plan_q", "reshard")
              or r[1].startswith("helpers")], rank, world, group)


def check_quantize_rows(rank, world, group):
    run_rows([r for r in ROWS if r[1] in ("foreach_q", "unshard_q", "reshard_q", "stream_q",
                                          "export_q")],
             rank, world, group)


def check_weight_sync_rows(rank, world, group):
    run_rows([r for r in ROWS if r[1] == "ws"], rank, world, group)


def check_device_cuda_fails_everywhere(rank, world, group):
    """execute(device="cuda") where CUDA cannot be used, on one rank: InvalidArgumentError on
    every rank at once (the header), not torch's RuntimeError on one rank and a deadline on
    the others; "cuda:0" alike. Where CUDA works it names a real device: nothing to test."""
    if torch.cuda.is_available():
        return
    layouts = _model(world)
    for device in ("cuda", "cuda:0"):
        kw = dict(layouts=layouts)
        if rank == world - 1:
            kw["device"] = device
        got, message, seconds = _outcome(lambda: _run_reshard_plan(kw, group, rank, world))
        wrong = []
        _judge("device_" + device, got, message, seconds, "InvalidArgumentError", "", wrong)
        assert not wrong, wrong
        _usable(group, rank, world)


def check_stream_rerun_never_pairs(rank, world, group):
    """A quantized stream run again on the last rank while the others make a plain call:
    every rank raises MismatchError naming the stream (its begin is a call with a header; the
    amax exchange of the Python quantizer, once the first call of a later run, used to pair
    headerless and crash)."""
    n = 130 * world
    spec = shardgather.ShardSpec(torch.bfloat16, (n, 256), 0, [s for _, s in _split(n, world)])
    mine = {"w": _full((spec.sizes[rank], 256), torch.bfloat16, seed=rank)}
    stream = shardgather.unshard_stream(mine, {"w": spec}, group, timeout=T,
                                        quantize="fp8_e4m3_128x128")
    with stream:
        first = [dict(b) for b in stream]
    assert any("w_scale_inv" in b for b in first), first
    if world == 1:
        return

    def again():
        with stream:
            return [dict(b) for b in stream]

    odd = rank == world - 1
    got, message, seconds = _outcome(again if odd else lambda: _foreach_int(group))
    wrong = []
    if _judge("stream_rerun", got, message, seconds, "MismatchError",
              "calls UnshardStream", wrong):
        _usable(group, rank, world)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))


CHECKS = [check_steps_never_pair, check_stream_rerun_never_pairs, check_aliasing_destinations,
          check_interleaved_destinations_work, check_empty_dequantized_boxes,
          check_count_overflow_is_one_class, check_quantized_plan_counts_what_moves,
          check_trainer_version_follows_commits, check_quantize_functions_raise_their_classes,
          check_reshard_rows, check_quantize_rows, check_weight_sync_rows,
          check_device_cuda_fails_everywhere]

for _check in CHECKS:
    globals()["case_" + _check.__name__[len("check_"):]] = on_default_group(_check)


def case_full_tensors_quantize_rows(rank, world):
    """full_tensors(quantize=) over DTensors (Gloo: they need torch.distributed): a spec that
    differs on one rank, an unknown format, quantize on one rank only, a plain strategy."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_cases import without_collectives

    mesh = init_device_mesh("cpu", (world,))
    odd = rank == world - 1
    full = torch.arange(64 * 4 * world, dtype=torch.float32).reshape(4 * world, 64)
    wrong = []
    for rid, quantize, strategy, want, needle in (
            ("format_differs", "fp8_e4m3_1x128" if odd else "mxfp8", "auto", "MismatchError",
             "quantize spec"),
            ("unknown", "fp9" if odd else "mxfp8", "auto", "InvalidArgumentError", "fp9"),
            ("one_rank_only", "mxfp8" if odd else None, "auto", "MismatchError", "given on rank"),
            # The quantized plan's one personal exchange: a strategy of the plain unshard is
            # refused, on every rank, in the agreement.
            ("strategy", "mxfp8", "packed", "InvalidArgumentError",
             'strategy is "auto" or "direct"'),
            # The same on one rank only: its agreement error reaches every rank, none waits.
            ("strategy_one_rank", "mxfp8", "packed" if odd else "auto", "InvalidArgumentError",
             'strategy is "auto" or "direct"')):
        t = {"w": without_collectives(full, mesh, 0)}
        got, message, seconds = _outcome(lambda: shardgather.full_tensors(
            t, timeout=T, quantize=quantize, strategy=strategy))
        _judge("full_tensors_" + rid, got, message, seconds, want, needle, wrong)
        _usable(None, rank, world)
    assert not wrong, "rank %d:\n  %s" % (rank, "\n  ".join(wrong))


CASES = sorted(k for k in globals() if k.startswith("case_"))
