"""Reshard cases, run on every rank of a spawned Gloo group (conftest.run_cases) and on the
threads backend. Each takes (rank, world, group) and raises on failure. Every destination is
compared bit for bit with the full tensor, which every rank builds alike from a seed, sliced to
the destination's box; the bytes around a destination inside a larger (fused) tensor must stay
as they were."""

import random
import sys

import torch

import shardgather
from shardgather import layouts as L
from shardgather.layouts import Box, TensorLayout

T = 30.0  # per-call deadline: a broken case fails instead of hanging the harness

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]


def full_tensor(layout, index, seed):
    """Tensor ``index`` of a case, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + index)
    if layout.dtype == torch.bool:  # a bool is 0 or 1 (torch's copies normalise other bytes)
        return torch.randint(0, 2, layout.shape, generator=g).bool()
    bits = torch.randint(0, 256, (max(1, layout.dtype.itemsize) * _numel(layout.shape),),
                         generator=g, dtype=torch.uint8)
    return bits.view(layout.dtype).reshape(layout.shape)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def region(t, box):
    """The view of ``t`` (global coordinates) that ``box`` names."""
    for d, (lo, n) in enumerate(zip(box.offset, box.size)):
        t = t.narrow(d, lo, n)
    return t


def _grid(shape, rnd):
    """Boxes of uneven cuts along one or two dims (some empty)."""
    cuts = [[0, s] for s in shape]
    for _ in range(rnd.randint(1, min(2, len(shape))) if shape else 0):
        d = rnd.randrange(len(shape))
        cuts[d] += [rnd.randint(0, shape[d]) for _ in range(rnd.randint(0, 3))]
        cuts[d].sort()
    boxes = [Box((), ())]
    for d in range(len(shape)):
        boxes = [Box(b.offset + (lo,), b.size + (hi - lo,))
                 for b in boxes for lo, hi in zip(cuts[d], cuts[d][1:])]
    return boxes


def _place(boxes, ranks, replicas, rnd):
    out = []
    for box in boxes:
        start = rnd.randrange(len(ranks))
        for k in range(min(len(ranks), rnd.randint(1, replicas))):
            out.append((ranks[(start + k) % len(ranks)], box))
    return out


def random_layouts(world, seed):
    """1-4 tensors of 0-4 dims and mixed dtypes; sources and destinations as uneven grids with
    replicas, on rank sets that are the same, disjoint or random."""
    rnd = random.Random(seed)
    src = sorted(rnd.sample(range(world), rnd.randint(1, world)))
    mode = rnd.randrange(3)
    rest = [r for r in range(world) if r not in src]
    dst = src if mode == 0 or (mode == 1 and not rest) else rest if mode == 1 else \
        sorted(rnd.sample(range(world), rnd.randint(1, world)))
    layouts = []
    for _ in range(rnd.randint(1, 4)):
        shape = tuple(rnd.randint(0 if rnd.random() < 0.05 else 1, 6)
                      for _ in range(rnd.randint(0, 4)))
        layouts.append(TensorLayout(shape, rnd.choice(DTYPES),
                                    _place(_grid(shape, rnd), src, 3, rnd),
                                    _place(_grid(shape, rnd), dst, 2, rnd)))
    return layouts


def _destination(box, dtype, fused, rnd):
    """A zero destination for ``box``: its own tensor, or a view into a larger one (returned
    with that larger tensor, whose other bytes must stay zero)."""
    if not fused or not box.size:
        t = torch.zeros(box.size, dtype=dtype)
        return t, t
    pads = [rnd.randint(0, 2) for _ in box.size]
    big = torch.zeros([s + p for s, p in zip(box.size, pads)], dtype=dtype)
    view = big
    for d, (s, p) in enumerate(zip(box.size, pads)):
        view = view.narrow(d, rnd.randint(0, p), s)
    return view, big


def _source(t, strided):
    """``t`` as a contiguous copy, or the same values in a transposed storage."""
    if strided and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t.clone()


def _bytes(t):
    """The bytes of a contiguous tensor (NaN payloads compare as bytes)."""
    return t.reshape(-1).view(torch.uint8)


def run_layouts(rank, group, layouts, seed, fused, plan=None):
    rnd = random.Random(seed * 7 + rank)
    if plan is None:
        plan = shardgather.ReshardPlan.for_group(layouts, group, timeout=T)
    fulls = [full_tensor(t, i, seed) for i, t in enumerate(layouts)]
    sources = [_source(region(fulls[i], Box(o, s)), fused)
               for i, o, s in plan.source_boxes]
    dests, bigs, expected = [], [], []
    for i, o, s in plan.destination_boxes:
        view, big = _destination(Box(o, s), layouts[i].dtype, fused, rnd)
        dests.append(view)
        bigs.append(big)
        want = torch.zeros_like(big)
        want_view = want.as_strided(view.shape, view.stride(),
                                    view.storage_offset() - big.storage_offset())
        want_view.copy_(region(fulls[i], Box(o, s)))
        expected.append(want)
    out = plan.execute(sources, dests, group)
    assert len(out) == len(dests) and all(a is b for a, b in zip(out, dests))
    for k, (big, want) in enumerate(zip(bigs, expected)):
        assert torch.equal(_bytes(big), _bytes(want)), \
            "destination %d of rank %d (seed %d)" % (k, rank, seed)
    return plan


def case_random_layouts(rank, world, group=None):
    for k in range(12):
        run_layouts(rank, group, random_layouts(world, 100 + k), 100 + k, k % 2 == 1)


def _two_hosts(world):
    """Planning hosts for ``world`` ranks: the first half on host 0, the rest on host 1."""
    return [0 if r < max(world // 2, 1) else 1 for r in range(world)]


def case_fan_out_inside_a_host(rank, world, group=None):
    """Plans told of two hosts (the first half of the ranks, the rest): what several ranks of
    host 1 want alike crosses to it once and is forwarded inside it, bit-exact, also into
    fused views; random layouts too."""
    hosts = _two_hosts(world)
    wanted = [r for r in range(world) if hosts[r] == 1]
    layout = TensorLayout((64, 40), torch.bfloat16,
                          [(0, Box((0, 0), (64, 40)))],
                          [(r, Box((0, 0), (64, 40))) for r in wanted] +
                          [(r, Box((8, 0), (8, 40))) for r in wanted[:1]])
    plan = shardgather.ReshardPlan([layout], world, rank, hosts=hosts, timeout=T)
    flat = shardgather.ReshardPlan([layout], world, rank, hosts=hosts, fan_out=False, timeout=T)
    if world > 1:
        whole = 64 * 40 * 2
        assert plan.forwarding == (len(wanted) > 1)
        assert plan.host_received == [0, whole + (8 * 40 * 2 if hosts[0] != 1 else 0)], \
            plan.host_received
        assert flat.host_received[1] == whole * len(wanted) + 8 * 40 * 2 * (hosts[0] != 1)
    for p, fused in ((plan, False), (plan, True), (flat, True)):
        run_layouts(rank, group, [layout], 17, fused, plan=p)
        if world > 1:
            assert p.last_stats["payload_collectives"] == p.rounds
            assert (p.rounds > 1) == p.forwarding
    for k in range(8):
        layouts = random_layouts(world, 300 + k)
        run_layouts(rank, group, layouts, 300 + k, k % 2 == 0, plan=shardgather.ReshardPlan(
            layouts, world, rank, hosts=hosts, timeout=T))


def case_steady_state_moves_in_one_exchange(rank, world, group=None):
    layout = TensorLayout((8, 6), torch.float32,
                          [(r, Box((r * 8 // world, 0), ((r + 1) * 8 // world - r * 8 // world, 6)))
                           for r in range(world)],
                          [(r, Box((0, 0), (8, 6))) for r in range(world)])
    plan = run_layouts(rank, group, [layout], 5, False)
    stats = plan.last_stats
    assert stats["preflight_collectives"] == (1 if world > 1 else 0), stats
    assert stats["payload_collectives"] == (1 if world > 1 else 0), stats
    assert plan.bytes_received == 8 * 6 * 4 - plan.rank_sent[rank] // world, \
        (plan.bytes_received, plan.rank_sent)


def case_started_execution_returns_the_destinations(rank, world, group=None):
    layout = TensorLayout((world * 3,), torch.int64,
                          [(r, Box((3 * r,), (3,))) for r in range(world)],
                          [((r + 1) % world, Box((3 * r,), (3,))) for r in range(world)])
    plan = shardgather.ReshardPlan.for_group([layout], group, timeout=T)
    src = [torch.arange(3 * rank, 3 * rank + 3)]
    dst = [torch.zeros(3, dtype=torch.int64)]
    work = plan.execute(src, dst, group, async_op=True)
    out = work.wait()
    prev = (rank - 1) % world
    assert torch.equal(out[0], torch.arange(3 * prev, 3 * prev + 3)), out


def case_a_layout_differing_on_one_rank_raises_mismatch_everywhere(rank, world, group=None):
    if world == 1:
        return
    dst_col = 1 if rank == world - 1 else 0
    layout = TensorLayout((4, 2), torch.float32, [(r, Box((0, 0), (4, 2))) for r in range(world)],
                          [(r, Box((0, dst_col), (4, 1))) for r in range(world)])
    dst = [torch.full((4, 1), 7.0)]
    try:
        shardgather.reshard([torch.ones(4, 2)], dst, [layout], group, timeout=T)
    except shardgather.MismatchError:
        assert torch.equal(dst[0], torch.full((4, 1), 7.0)), "written before the check"
        return
    raise AssertionError("no MismatchError on rank %d" % rank)


def case_one_shot_reshard_takes_strategy_and_preflight(rank, world, group=None):
    """reshard() takes the plan's strategy and preflight as every other operation does: each
    valid pair gives the same bytes; an unknown strategy raises on every rank."""
    layout = TensorLayout((world, 3), torch.int64, [(r, Box((r, 0), (1, 3))) for r in range(world)],
                          [(r, Box((0, 0), (world, 3))) for r in range(world)])
    want = torch.arange(3 * world).reshape(world, 3)
    for strategy in ("auto", "direct"):
        for preflight in (True, False):
            dst = [torch.zeros(world, 3, dtype=torch.int64)]
            shardgather.reshard([want[rank:rank + 1].clone()], dst, [layout], group,
                                strategy=strategy, preflight=preflight, timeout=T)
            assert torch.equal(dst[0], want), (strategy, preflight, dst[0])
    try:
        shardgather.reshard([want[rank:rank + 1].clone()], [torch.zeros(world, 3)], [layout],
                            group, strategy="packed", timeout=T)
    except shardgather.InvalidArgumentError as e:
        assert "strategy" in str(e), str(e)
        return
    raise AssertionError("no InvalidArgumentError for strategy='packed' on rank %d" % rank)


def case_device_bucket_is_part_of_the_plan(rank, world, group=None):
    """device_bucket_bytes sets the device parts, is checked, and ranks that disagree on it
    raise MismatchError on every rank before anything moves (it is in the fingerprint)."""
    layout = TensorLayout((8, 8), torch.float32, [(r, Box((0, 0), (8, 8))) for r in range(world)],
                          [(r, Box((0, r % 8), (8, 1))) for r in range(world)])
    plan = shardgather.ReshardPlan([layout], world, rank, device_bucket_bytes=8, timeout=T)
    # With a copy on every rank each takes its column from itself: nothing to move.
    assert plan.device_parts == 1, plan.device_parts
    try:
        shardgather.ReshardPlan([layout], world, rank, device_bucket_bytes=0).fingerprint
    except shardgather.InvalidArgumentError as e:
        assert "device_bucket_bytes" in str(e), str(e)
    else:
        raise AssertionError("a bucket of 0 bytes was accepted")
    one = TensorLayout((8, 8), torch.float32, [(0, Box((0, 0), (8, 8)))],
                       [(r, Box((0, r % 8), (8, 1))) for r in range(world)])
    bucket = 16 if rank == world - 1 and world > 1 else 8
    plan = shardgather.ReshardPlan.for_group([one], group, device_bucket_bytes=bucket, timeout=T)
    # Rank 0 sends 8 x 4 bytes to each other rank, over 8-byte parts.
    assert world == 1 or plan.device_parts == (4 * (world - 1) if bucket == 8 else 2 * (world - 1))
    src = [torch.ones(8, 8)] if rank == 0 else []
    dst = [torch.full((8, 1), 7.0)]
    try:
        plan.execute(src, dst, group)
    except shardgather.MismatchError:
        assert world > 1 and torch.equal(dst[0], torch.full((8, 1), 7.0)), "written first"
        return
    assert world == 1 and torch.equal(dst[0], torch.ones(8, 1)), dst


def case_a_rank_with_no_tensors_may_name_its_device(rank, world, group=None):
    """device= on execute: "cpu" where the tensors are on the host (what a rank with none in a
    CUDA reshard does with "cuda"), and an unknown device raised on every rank."""
    layout = TensorLayout((6,), torch.int32, [(0, Box((0,), (6,)))],
                          [(world - 1, Box((0,), (6,)))])
    plan = shardgather.ReshardPlan.for_group([layout], group, timeout=T)
    src = [torch.arange(6, dtype=torch.int32)] if rank == 0 else []
    dst = [torch.zeros(6, dtype=torch.int32)] if rank == world - 1 else []
    out = plan.execute(src, dst, group, device="cpu")
    if rank == world - 1:
        assert torch.equal(out[0], torch.arange(6, dtype=torch.int32)), out
    try:
        plan.execute(src, dst, group, device="meta" if rank == 0 else "cpu")
    except shardgather.InvalidArgumentError as e:
        assert "device must be a cpu or cuda" in str(e) or "rank 0" in str(e), str(e)
        return
    raise AssertionError("an unknown device was accepted on rank %d" % rank)


def case_a_bad_destination_on_one_rank_raises_everywhere(rank, world, group=None):
    layout = TensorLayout((4, 2), torch.float32, [(0, Box((0, 0), (4, 2)))],
                          [(r, Box((0, 0), (4, 2))) for r in range(world)])
    plan = shardgather.ReshardPlan.for_group([layout], group, timeout=T)
    src = [torch.ones(4, 2)] if rank == 0 else []
    dst = [torch.zeros(4, 2 if rank != world - 1 else 3)]
    try:
        plan.execute(src, dst, group)
    except shardgather.InvalidArgumentError as e:
        assert "rank %d" % (world - 1) in str(e) and "shape [4, 3]" in str(e), str(e)
        return
    raise AssertionError("no InvalidArgumentError on rank %d" % rank)


def case_an_element_no_source_holds_is_refused(rank, world, group=None):
    layout = TensorLayout((4,), torch.float32, [(0, Box((0,), (3,)))], [(0, Box((0,), (4,)))])
    src = [torch.ones(3)] if rank == 0 else []
    dst = [torch.zeros(4)] if rank == 0 else []
    try:  # the plan is pure: its error is raised by the first execution, on every rank
        shardgather.reshard(src, dst, [layout], group, timeout=T)
    except shardgather.InvalidArgumentError as e:
        assert "element (3)" in str(e), str(e)
        return
    raise AssertionError("planned an uncovered element")


def case_a_group_without_point_to_point_is_refused(rank, world, group=None):
    if group is not None or world == 1:
        return  # a torch group's own property
    import torch.distributed as dist

    comm = shardgather._shardgather._process_group_communicator(dist.group.WORLD, p2p=False,
                                                                timeout=T)
    layout = TensorLayout((4,), torch.float32, [(0, Box((0,), (4,)))], [(1, Box((0,), (4,)))])
    plan = shardgather.ReshardPlan([layout], world, rank, timeout=T)
    src = [torch.ones(4)] if rank == 0 else []
    dst = [torch.zeros(4)] if rank == 1 else []
    try:
        plan.execute(src, dst, comm)
    except shardgather.InvalidArgumentError as e:
        assert "point-to-point" in str(e), str(e)
        return
    raise AssertionError("no InvalidArgumentError on rank %d" % rank)


def _reshard_and_check(rank, group, layouts, seed, dests=None):
    """Reshards ``layouts`` with sources sliced from the full tensors; ``dests``: this rank's
    destination views (default: new tensors); checks each against its box of the full tensor."""
    plan = shardgather.ReshardPlan.for_group(layouts, group, timeout=T)
    fulls = [full_tensor(t, i, seed) for i, t in enumerate(layouts)]
    sources = [region(fulls[i], Box(o, s)).clone() for i, o, s in plan.source_boxes]
    if dests is None:
        dests = [torch.zeros(s, dtype=layouts[i].dtype) for i, _, s in plan.destination_boxes]
    plan.execute(sources, dests, group)
    for (i, o, s), d in zip(plan.destination_boxes, dests):
        assert torch.equal(_bytes(d.contiguous()), _bytes(region(fulls[i], Box(o, s)).contiguous())), \
            "rank %d tensor %d box %s" % (rank, i, (o, s))
    return plan


def case_dtensor_meshes_1d_and_2d(rank, world, group=None):
    from torch.distributed.tensor import Replicate, Shard

    ranks = list(range(world))
    two_d = [ranks[: world // 2], ranks[world // 2:]] if world % 2 == 0 else [ranks]
    cases = [
        (ranks, [Shard(0)], ranks, [Shard(1)]),                        # 1-D, dim 0 -> dim 1
        (ranks, [Shard(1)], two_d, [Shard(0), Replicate()]),           # 1-D -> 2-D
        (two_d, [Shard(0), Shard(1)], ranks[::-1], [Shard(0)]),        # FSDP x TP -> reversed
        (two_d, [Shard(0), Shard(0)], two_d, [Replicate(), Shard(1)]),  # one dim sharded twice
    ]
    layouts = [L.dtensor_layout((7, 5), torch.float32, *c) for c in cases]
    _reshard_and_check(rank, group, layouts, 31)


def case_trainer_to_engine_fused_qkv_and_gate_up(rank, world, group=None):
    """FSDP rows on every rank -> a TP engine of the largest degree in (1, 2, 4) that fits the
    world, on the last ranks, with fused qkv (8 q heads, 2 kv heads, replicated at TP 4) and
    gate_up, written in place into each engine rank's fused parameters."""
    t = max(d for d in (1, 2, 4) if d <= world)
    engine = list(range(world - t, world))
    hidden, hd, inter = 16, 2, 12
    shapes = {"q": (8 * hd, hidden), "k": (2 * hd, hidden), "v": (2 * hd, hidden),
              "gate": (inter, hidden), "up": (inter, hidden)}
    qkv = L.fused_qkv(shapes["q"], shapes["k"], shapes["v"], 8, 2, hd, engine)
    gate_up = L.fused_gate_up(shapes["gate"], shapes["up"], engine)
    targets = {**qkv, **gate_up}
    fsdp = list(range(world))
    layouts = [TensorLayout(shapes[n], torch.bfloat16,
                            L.placement_boxes(shapes[n], fsdp, [_shard0()]),
                            L.target_boxes(targets[n]))
               for n in ("q", "k", "v", "gate", "up")]
    mine = [t for n in ("q", "k", "v", "gate", "up") for t in targets[n] if t.rank == rank]
    params = {}
    if rank in engine:
        kv_local = max(1, 2 // t)
        params = {"qkv_proj": torch.zeros(((8 // t) + 2 * kv_local) * hd, hidden,
                                          dtype=torch.bfloat16),
                  "gate_up_proj": torch.zeros(2 * inter // t, hidden, dtype=torch.bfloat16)}
    dests = L.local_views(mine, params) if mine else []
    _reshard_and_check(rank, group, layouts, 47, dests)
    for p in params.values():  # every row of each fused parameter was written
        assert not (p == 0).all(dim=1).any(), "a fused row was left unwritten on rank %d" % rank


def _shard0():
    from torch.distributed.tensor import Shard

    return Shard(0)


# ---- End to end: an FSDP trainer's step resharded into a tensor-parallel engine ----------------

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 96, 32, 4, 2, 8, 48, 2


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x):
    """Rotary embedding of x [batch, heads, seq, HEAD_DIM] at positions 0..seq-1."""
    pos = torch.arange(x.shape[2], dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], dim=-1)
    half = torch.cat([-x[..., HEAD_DIM // 2:], x[..., : HEAD_DIM // 2]], dim=-1)
    return x * ang.cos() + half * ang.sin()


def _attention(x, q_w, k_w, v_w, o_w, heads, kv_heads, reduce):
    """Causal grouped-query attention of this rank's heads; o_w's output is reduced."""
    b, n, _ = x.shape
    q = (x @ q_w.T).view(b, n, heads, HEAD_DIM).transpose(1, 2)
    k = (x @ k_w.T).view(b, n, kv_heads, HEAD_DIM).transpose(1, 2)
    v = (x @ v_w.T).view(b, n, kv_heads, HEAD_DIM).transpose(1, 2)
    q, k = _rope(q), _rope(k)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, heads * HEAD_DIM)
    return reduce(a @ o_w.T)


def _mlp(x, gate_w, up_w, down_w, reduce):
    return reduce((torch.nn.functional.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T)


class _Layer(torch.nn.Module):
    """One decoder layer (HF's parameter names); its own forward, so FSDP2 unshards it."""

    def __init__(self):
        super().__init__()
        lin = lambda o, i: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.post_attention_layernorm = torch.nn.Module()
        self.post_attention_layernorm.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.self_attn = torch.nn.Module()
        for name, rows in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS)):
            setattr(self.self_attn, name, lin(rows * HEAD_DIM, HIDDEN))
        self.self_attn.o_proj = lin(HIDDEN, HEADS * HEAD_DIM)
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = lin(INTER, HIDDEN), lin(INTER, HIDDEN)
        self.mlp.down_proj = lin(HIDDEN, INTER)

    def forward(self, h):
        same = lambda t: t  # noqa: E731
        a, m = self.self_attn, self.mlp
        x = _rms(h, self.input_layernorm.weight)
        h = h + _attention(x, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                           a.o_proj.weight, HEADS, KV_HEADS, same)
        x = _rms(h, self.post_attention_layernorm.weight)
        return h + _mlp(x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, same)


class _TinyLlama(torch.nn.Module):
    """A Llama-shaped model (HF's parameter names) whose forward is the unsharded reference."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(LAYERS)])
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return _rms(h, self.norm.weight) @ self.lm_head.weight.T


def _engine_targets(engine):
    """Per trainer parameter: (rank, Box) destinations and each engine rank's local parameter
    name and narrow (dim, start) — vLLM's layout: fused qkv and gate_up column-parallel,
    o and down row-parallel, the rest replicated."""
    shapes = {k: tuple(v.shape) for k, v in _TinyLlama().state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            layer = name.rsplit(".self_attn.", 1)[0]
            qkv = L.fused_qkv(shapes[layer + ".self_attn.q_proj.weight"],
                              shapes[layer + ".self_attn.k_proj.weight"],
                              shapes[layer + ".self_attn.v_proj.weight"], HEADS, KV_HEADS,
                              HEAD_DIM, engine, param=layer + ".qkv_proj")
            out[name] = qkv[name.rsplit(".", 2)[1][0]]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            layer = name.rsplit(".mlp.", 1)[0]
            gu = L.fused_gate_up(shapes[layer + ".mlp.gate_proj.weight"],
                                 shapes[layer + ".mlp.up_proj.weight"], engine,
                                 param=layer + ".gate_up_proj")
            out[name] = gu["gate" if "gate_proj" in name else "up"]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = [L.Target(r, b, name, 1, 0) for r, b in L.row_parallel(shape, engine)]
        else:
            out[name] = [L.Target(r, b, name, 0, 0) for r, b in L.replicated(shape, engine)]
    return shapes, out


def _engine_params(rank, engine, shapes):
    """This engine rank's empty local parameters, by name."""
    t = len(engine)
    kv_local = max(1, KV_HEADS // t)
    params = {}
    for name, shape in shapes.items():
        if name.endswith("q_proj.weight"):
            layer = name.rsplit(".self_attn.", 1)[0]
            params[layer + ".qkv_proj"] = torch.zeros(
                (HEADS // t + 2 * kv_local) * HEAD_DIM, HIDDEN)
        elif name.endswith("gate_proj.weight"):
            params[name.rsplit(".mlp.", 1)[0] + ".gate_up_proj"] = torch.zeros(2 * INTER // t,
                                                                              HIDDEN)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = torch.zeros(shape[0], shape[1] // t)
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            params[name] = torch.zeros(shape)
    return params


def _engine_forward(p, tokens, t, tp_group):
    """The TP engine's forward: column-parallel fused qkv and gate_up, row-parallel o and down
    followed by an all-reduce over the engine's ranks."""
    import torch.distributed as dist

    def reduce(x):
        dist.all_reduce(x, group=tp_group)
        return x

    heads, kv = HEADS // t, max(1, KV_HEADS // t)
    h = p["embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        pre = "layers.%d." % i
        qkv = p[pre + "qkv_proj"]
        q_w, k_w = qkv[: heads * HEAD_DIM], qkv[heads * HEAD_DIM: (heads + kv) * HEAD_DIM]
        v_w = qkv[(heads + kv) * HEAD_DIM:]
        x = _rms(h, p[pre + "input_layernorm.weight"])
        h = h + _attention(x, q_w, k_w, v_w, p[pre + "self_attn.o_proj.weight"], heads, kv,
                           reduce)
        gate_up = p[pre + "gate_up_proj"]
        x = _rms(h, p[pre + "post_attention_layernorm.weight"])
        h = h + _mlp(x, gate_up[: INTER // t], gate_up[INTER // t:],
                     p[pre + "mlp.down_proj.weight"], reduce)
    return _rms(h, p["norm.weight"]) @ p["lm_head.weight"].T


def case_fsdp_trainer_step_resharded_into_a_tp_engine(rank, world, group=None):
    """World 4 (Gloo): ranks 0-1 train a Llama-shaped model under FSDP2 (one optimizer step),
    then reshard every parameter into a TP 2 engine on ranks 2-3 (fused qkv_proj and
    gate_up_proj, row-parallel o and down, written in place). The engine's forward pass, with
    its all-reduces, gives the logits of the unsharded updated model."""
    if world != 4 or group is not None:
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    trainer, engine = [0, 1], [2, 3]
    mesh = DeviceMesh("cpu", torch.tensor(trainer))  # collective: every rank builds it
    tp_group = dist.new_group(engine)
    torch.manual_seed(0)
    model = _TinyLlama()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    shapes, targets = _engine_targets(engine)
    names = list(shapes)
    layouts = [TensorLayout(shapes[n], torch.float32,
                            L.placement_boxes(shapes[n], trainer, [Shard(0)]),
                            L.target_boxes(targets[n])) for n in names]
    reference = torch.empty(2, 12, VOCAB)
    sources, dests, params = [], [], {}
    if rank in trainer:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                          tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        state = model.state_dict()
        sources = [state[n].to_local() for n in names]
        full = shardgather.full_tensors(state, mesh.get_group(), timeout=T)
        unsharded = _TinyLlama()
        unsharded.load_state_dict(full)
        with torch.no_grad():
            reference = unsharded(tokens)
    else:
        params = _engine_params(rank, engine, shapes)
        dests = [v for n in names for v in L.local_views(
            [t for t in targets[n] if t.rank == rank], params)]
    plan = shardgather.ReshardPlan.for_group(layouts, None, timeout=T)
    plan.execute(sources, dests)
    dist.broadcast(reference, src=0)
    if rank in engine:
        with torch.no_grad():
            got = _engine_forward(params, tokens, len(engine), tp_group)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
        assert plan.bytes_received < sum(
            torch.Size(s).numel() * 4 for s in shapes.values()), "an engine rank got every byte"


def exit_case_source_killed_mid_reshard(rank, world):
    """Rank 0, a source of every destination's bytes, ends its process 20 ms into a reshard of
    192 MiB per rank (its sockets close, as after kill -9). Every other rank exchanges bytes with
    it, so every survivor must raise a CommunicationError, never hang: RemoteError at once where
    Gloo notices the closed connection, else CollectiveTimeout at the deadline (RELIABILITY's
    fault bound: within 2 x the deadline)."""
    import threading
    import time

    deadline = 5.0
    n = 48 << 20  # float32 elements of each rank's row
    layout = TensorLayout((world, n), torch.float32,
                          [(r, Box((r, 0), (1, n))) for r in range(world)],
                          [(r, Box((0, r * n // world), (world, (r + 1) * n // world - r * n // world)))
                           for r in range(world)])
    plan = shardgather.ReshardPlan.for_group([layout], None, timeout=deadline)
    src = [torch.full((1, n), float(rank))]
    dst = [torch.zeros(world, (rank + 1) * n // world - rank * n // world)]
    shardgather.foreach_all_gather([torch.ones(1)], timeout=deadline)  # everyone is here
    if rank == 0:
        threading.Thread(target=lambda: plan.execute(src, dst), daemon=True).start()
        time.sleep(0.02)
        return "exit"
    start = time.monotonic()
    try:
        plan.execute(src, dst)
    except shardgather.CommunicationError as e:
        elapsed = time.monotonic() - start
        assert elapsed < 2 * deadline, "raised after %.1f s: %s" % (elapsed, e)
        return None
    raise AssertionError("rank %d finished a reshard whose source 0 was killed" % rank)


CASES = [name for name in dir(sys.modules[__name__]) if name.startswith("case_")]
