"""shardgather.layouts on its own (no group, no compiled extension): boxes that fit and boxes
that do not, DTensor placements against torch's own computation, and the inference-engine
helpers against independent constructions of what each engine rank's parameter holds."""

import importlib.util
import itertools
import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def _load_layouts():
    """shardgather.layouts from the package when it imports (a built tree), else the module
    file by path: it is pure Python, and the package's __init__ needs the extension."""
    try:
        import shardgather.layouts as module
        return module
    except ImportError:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                            "python", "shardgather", "layouts.py")
        spec = importlib.util.spec_from_file_location("_shardgather_layouts", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
        return module


L = _load_layouts()
Box, TensorLayout, Target = L.Box, L.TensorLayout, L.Target


# ---------------------------------------------------------------------------------------------
# TensorLayout.validate


def test_a_layout_whose_boxes_fit_validates():
    TensorLayout((4, 2), torch.float32, [(0, Box((0, 0), (4, 2)))],
                 [(1, Box((2, 1), (2, 1))), (2, Box((4, 0), (0, 2)))]).validate()


@pytest.mark.parametrize("box", [Box((0, 0), (5, 2)), Box((0,), (4,)), Box((-1, 0), (1, 2))])
def test_a_box_that_does_not_fit_is_named(box):
    with pytest.raises(ValueError, match=r"destinations\[0\] \(rank 3\)"):
        TensorLayout((4, 2), torch.float32, [], [(3, box)]).validate()


def test_a_box_with_the_wrong_number_of_dims_says_so():
    with pytest.raises(ValueError, match=r"sources\[1\] \(rank 7\).*1/1 dims for a 2-d"):
        TensorLayout((4, 2), torch.float32,
                     [(0, Box((0, 0), (4, 2))), (7, Box((0,), (4,)))], []).validate()


def test_a_0d_tensor_has_an_empty_box():
    TensorLayout((), torch.float32, [(0, Box((), ()))], [(1, Box((), ()))]).validate()


# ---------------------------------------------------------------------------------------------
# placement_boxes against torch's compute_local_shape_and_global_offset


class _RankOfMesh:
    """A stand-in for a DeviceMesh as seen from one of its ranks: exactly what torch's
    compute_local_shape_and_global_offset reads (``_is_current_rank_part_of_mesh``,
    ``shape``, ``_sym_get_coordinate``), with no process group behind it."""

    def __init__(self, grid, rank):
        self.shape = tuple(grid.shape)
        self._coordinate = _coordinate_of(grid, rank)

    def _is_current_rank_part_of_mesh(self):
        return True

    def _sym_get_coordinate(self, index):
        return self._coordinate[index]


def _coordinate_of(grid, rank):
    """The rank's mesh coordinate as DeviceMesh computes it (its own static helper when this
    torch has one, else the position of the rank in the grid)."""
    from torch.distributed.device_mesh import DeviceMesh

    helper = getattr(DeviceMesh, "_compute_coordinates_from_mesh", None)
    if helper is not None:
        return tuple(helper(grid, rank))
    return tuple(int(x) for x in (grid == rank).nonzero()[0])


def _torch_box(shape, grid, rank, placements):
    """The Box torch gives ``rank``'s local tensor."""
    size, offset = compute_local_shape_and_global_offset(shape, _RankOfMesh(grid, rank),
                                                         placements)
    return Box(tuple(offset), tuple(size))


def _random_case(rnd):
    """(shape, grid of global ranks, placements): 1-3 mesh dims of 1-4 ranks (shuffled,
    offset), a 0-3 dim tensor of 0-9 per dim, each mesh dim Shard of a random dim or
    Replicate."""
    mesh_shape = [rnd.randint(1, 4) for _ in range(rnd.randint(1, 3))]
    n = 1
    for m in mesh_shape:
        n *= m
    ranks = list(range(n))
    rnd.shuffle(ranks)
    grid = torch.tensor(ranks).add(rnd.choice((0, 3))).reshape(mesh_shape)
    shape = tuple(rnd.randint(0, 9) for _ in range(rnd.randint(0, 3)))
    placements = [Shard(rnd.randrange(len(shape))) if shape and rnd.random() < 0.7
                  else Replicate() for _ in mesh_shape]
    return shape, grid, placements


def test_placement_boxes_equal_torchs_on_every_rank_of_random_meshes():
    rnd = random.Random(20240611)
    seen = set()
    for _ in range(600):
        shape, grid, placements = _random_case(rnd)
        boxes = L.placement_boxes(shape, grid, placements)
        assert [r for r, _ in boxes] == grid.flatten().tolist()  # row-major order
        for rank, box in boxes:
            assert box == _torch_box(shape, grid, rank, placements), (shape, grid, placements)
        seen |= _kinds(shape, grid, placements, boxes)
    # The random cases exercised every kind the brief names.
    assert seen >= {"1-d mesh", "2-d mesh", "3-d mesh", "same dim twice", "uneven", "empty",
                    "replicate", "two dims sharded"}


def _kinds(shape, grid, placements, boxes):
    """The kinds of case one random case covers (for the coverage check)."""
    kinds = {"%d-d mesh" % grid.dim()}
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    if len(dims) != len(set(dims)):
        kinds.add("same dim twice")
    if len(set(dims)) > 1:
        kinds.add("two dims sharded")
    if any(isinstance(p, Replicate) for p in placements):
        kinds.add("replicate")
    sizes = {box.size for _, box in boxes}
    if len(sizes) > 1:
        kinds.add("uneven")
    if any(0 in box.size for _, box in boxes) and 0 not in shape:
        kinds.add("empty")
    return kinds


def test_the_boxes_of_a_mesh_cover_the_tensor_replication_times():
    rnd = random.Random(7)
    for _ in range(300):
        shape, grid, placements = _random_case(rnd)
        count = torch.zeros(shape, dtype=torch.int64)
        for _, box in L.placement_boxes(shape, grid, placements):
            _region(count, box).add_(1)
        replication = 1
        for m, p in zip(grid.shape, placements):
            replication *= m if isinstance(p, Replicate) else 1
        assert bool((count == replication).all()), (shape, grid, placements)


def _region(tensor, box):
    """The view of ``tensor`` that ``box`` covers."""
    for d, (o, n) in enumerate(zip(box.offset, box.size)):
        tensor = tensor.narrow(d, min(o, tensor.shape[d]), n)
    return tensor


def test_torchs_docstring_example_and_nested_empty_shards():
    # torch's docstring: [2, 5] on a 2 x 2 mesh with (Shard(1), Shard(1)).
    assert L.placement_boxes((2, 5), [[0, 1], [2, 3]], [Shard(1), Shard(1)]) == [
        (0, Box((0, 0), (2, 2))), (1, Box((0, 2), (2, 1))),
        (2, Box((0, 3), (2, 1))), (3, Box((0, 4), (2, 1)))]
    # [4] on 2 x 3, dim 0 twice: the second split leaves rank (0, 2) empty, at offset 4.
    boxes = dict(L.placement_boxes((4,), [[0, 1, 2], [3, 4, 5]], [Shard(0), Shard(0)]))
    assert boxes[2] == Box((4,), (0,)) and boxes[4] == Box((3,), (1,))


def test_placement_boxes_take_a_device_mesh_like_a_tensor_or_a_list():
    grid = torch.tensor([[4, 5], [6, 7]], dtype=torch.int32)
    mesh = SimpleNamespace(mesh=grid)  # what placement_boxes reads of a DeviceMesh
    expected = L.placement_boxes((6, 3), grid.tolist(), [Replicate(), Shard(0)])
    assert L.placement_boxes((6, 3), mesh, [Replicate(), Shard(0)]) == expected
    assert L.placement_boxes((6, 3), grid, [Replicate(), Shard(-2)]) == expected


@pytest.mark.parametrize("mesh,placements,match", [
    ([0, 1], [Partial()], "Partial"),
    ([0, 1], [Shard(0), Shard(0)], "2 placements for a 1-d mesh"),
    ([0, 1], [Shard(2)], "shards dim 2"),
    ([0, 0], [Shard(0)], "distinct"),
    ([[0, 1], [2]], [Shard(0)], "mesh"),
    ([0.0, 1.0], [Shard(0)], "integer"),
])
def test_placement_boxes_refuse_what_is_no_box(mesh, placements, match):
    with pytest.raises(ValueError, match=match):
        L.placement_boxes((4, 2), mesh, placements)


def test_dtensor_layout_holds_both_meshes_boxes():
    layout = L.dtensor_layout((10, 4), torch.bfloat16, [0, 1, 2], [Shard(0)],
                              [[3, 4], [5, 6]], [Shard(1), Shard(0)])
    assert layout.shape == (10, 4) and layout.dtype == torch.bfloat16
    assert layout.sources == L.placement_boxes((10, 4), [0, 1, 2], [Shard(0)])
    assert layout.destinations[3] == (6, Box((5, 2), (5, 2)))


# ---------------------------------------------------------------------------------------------
# Engine helpers: plain tensor parallelism


def test_column_row_and_replicated():
    assert L.column_parallel((8, 6), [2, 5]) == [(2, Box((0, 0), (4, 6))),
                                                 (5, Box((4, 0), (4, 6)))]
    assert L.column_parallel((8,), [0, 1]) == [(0, Box((0,), (4,))), (1, Box((4,), (4,)))]
    assert L.row_parallel((8, 6), [0, 1, 2]) == [
        (r, Box((0, 2 * r), (8, 2))) for r in range(3)]
    assert L.row_parallel((8,), [0, 1]) == L.replicated((8,), [0, 1]) == [
        (0, Box((0,), (8,))), (1, Box((0,), (8,)))]
    with pytest.raises(ValueError, match="not divisible by 3"):
        L.column_parallel((8, 6), [0, 1, 2])
    with pytest.raises(ValueError, match="distinct"):
        L.replicated((8,), [1, 1])


@pytest.mark.parametrize("pad_to,per_rank,rows", [(None, False, 25), (64, False, 32),
                                                  (64, True, 64), (10, False, 25)])
def test_vocab_parallel_lands_the_real_rows_in_zero_padded_parameters(pad_to, per_rank, rows):
    vocab, hidden, ranks = 100, 8, [0, 1, 2, 3]
    weight = torch.randn(vocab, hidden)
    shards = L.vocab_parallel((vocab, hidden), ranks, pad_to, per_rank=per_rank)
    assert {s.padded_rows for s in shards} == {rows} and {s.start for s in shards} == {0}
    padded = torch.cat([weight, torch.zeros(rows * len(ranks) - vocab, hidden)])
    for shard, expected in zip(shards, padded.chunk(len(ranks))):
        param = torch.zeros(rows, hidden)
        (view,) = L.local_views([shard.target()], {"weight": param})
        view.copy_(_region(weight, shard.box))
        assert torch.equal(param, expected)


def test_vocab_parallel_pads_to_64_by_default_as_vllm():
    # vLLM: pad_vocab_size(1003, 64) = 1024 rows, 512 per rank at TP 2; the last rank's tail
    # rows (1003..1023) are padding no box covers.
    shards = L.vocab_parallel((1003, 8), [4, 5])
    assert L.VLLM_VOCAB_PADDING == 64
    assert [(s.rank, s.box, s.start, s.padded_rows) for s in shards] == [
        (4, Box((0, 0), (512, 8)), 0, 512), (5, Box((512, 0), (491, 8)), 0, 512)]
    assert L.vocab_parallel((100, 8), [0, 1, 2, 3]) == L.vocab_parallel((100, 8), [0, 1, 2, 3],
                                                                        64)
    with pytest.raises(ValueError, match="padded vocabulary"):
        L.vocab_parallel((1003, 8), [0, 1, 2])  # 1024 rows over 3 ranks: vLLM refuses too


def test_vocab_parallel_refuses_what_vllm_refuses():
    with pytest.raises(ValueError, match="padded vocabulary"):
        L.vocab_parallel((100, 8), [0, 1, 2], pad_to=64)  # 128 rows over 3 ranks


def test_expert_ranges_chunk_like_torch_or_balance_like_vllm():
    for experts, t in itertools.product(range(10), range(1, 6)):
        ranks = list(range(10, 10 + t))
        pieces = list(torch.arange(experts).chunk(t)) if experts else []
        sizes = [len(p) for p in pieces] + [0] * (t - len(pieces))
        assert [c for _, _, c in L.expert_ranges(experts, ranks)] == sizes
        balanced = [len(p) for p in torch.arange(experts).tensor_split(t)]
        got = L.expert_ranges(experts, ranks, split="balanced")
        assert [c for _, _, c in got] == balanced
        for split in ("chunk", "balanced"):
            covered = [e for _, f, c in L.expert_ranges(experts, ranks, split)
                       for e in range(f, f + c)]
            assert covered == list(range(experts))
    assert L.expert_boxes((5, 4, 3), [0, 1, 2]) == [
        (0, Box((0, 0, 0), (2, 4, 3))), (1, Box((2, 0, 0), (2, 4, 3))),
        (2, Box((4, 0, 0), (1, 4, 3)))]
    assert L.expert_boxes((4, 5), [0, 1], dim=-1, split="balanced")[1] == (1, Box((0, 3), (4, 2)))


# ---------------------------------------------------------------------------------------------
# Engine helpers: fused QKV and gate_up, on Llama-like sizes

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 2, 8


def _expected_qkv(q, k, v, t, i):
    """What vLLM's fused qkv parameter of TP rank i holds, built independently of the module:
    its chunk of query heads, then its key heads, then its value heads; with fewer kv heads
    than ranks, each kv head repeated for t / kv consecutive ranks."""
    def heads(x, n):
        return x.reshape(n, HEAD_DIM, *x.shape[1:])

    def kv_part(x):
        if KV_HEADS >= t:
            return heads(x, KV_HEADS).chunk(t)[i]
        return heads(x, KV_HEADS).repeat_interleave(t // KV_HEADS, dim=0)[i:i + 1]

    parts = [heads(q, HEADS).chunk(t)[i], kv_part(k), kv_part(v)]
    return torch.cat([p.reshape(-1, *q.shape[1:]) for p in parts])


def _fill(targets_by_name, globals_by_name, rank, local_rows, trailing):
    """Rank ``rank``'s zero-initialised fused parameter with every target copied in."""
    param = torch.zeros(local_rows, *trailing)
    mine = [(name, t) for name, ts in targets_by_name.items() for t in ts if t.rank == rank]
    views = L.local_views([t for _, t in mine], {mine[0][1].param: param})
    for (name, target), view in zip(mine, views):
        view.copy_(_region(globals_by_name[name], target.box))
    return param


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_builds_each_ranks_vllm_parameter(t, bias):
    trailing = () if bias else (HIDDEN,)
    q = torch.randn(HEADS * HEAD_DIM, *trailing)
    k = torch.randn(KV_HEADS * HEAD_DIM, *trailing)
    v = torch.randn(KV_HEADS * HEAD_DIM, *trailing)
    ranks = [3 + 2 * i for i in range(t)]  # global ranks need not be 0..t-1
    targets = L.fused_qkv(q.shape, k.shape, v.shape, HEADS, KV_HEADS, HEAD_DIM, ranks)
    local_rows = (HEADS // t + 2 * max(1, KV_HEADS // t)) * HEAD_DIM
    for i, rank in enumerate(ranks):
        param = _fill(targets, {"q": q, "k": k, "v": v}, rank, local_rows, trailing)
        assert torch.equal(param, _expected_qkv(q, k, v, t, i)), (t, i)
    layout = TensorLayout(tuple(k.shape), k.dtype, L.replicated(k.shape, [0]),
                          L.target_boxes(targets["k"]))
    layout.validate()
    if t > KV_HEADS:  # replicated kv heads: t / kv ranks want the same box
        assert len({box for _, box in layout.destinations}) == KV_HEADS


@pytest.mark.parametrize("heads,kv,t,match", [
    (8, 2, 3, "num_heads"), (6, 3, 2, "num_kv_heads"), (12, 3, 4, "replicated"),
])
def test_fused_qkv_refuses_what_vllm_cannot_split(heads, kv, t, match):
    with pytest.raises(ValueError, match=match):
        L.fused_qkv((heads * 4, 16), (kv * 4, 16), (kv * 4, 16), heads, kv, 4, list(range(t)))


def test_fused_qkv_checks_the_shapes_against_the_heads():
    with pytest.raises(ValueError, match="k has 8 rows"):
        L.fused_qkv((64, 64), (8, 64), (16, 64), HEADS, KV_HEADS, HEAD_DIM, [0, 1])
    with pytest.raises(ValueError, match="differ past dim 0"):
        L.fused_qkv((64, 64), (16, 32), (16, 64), HEADS, KV_HEADS, HEAD_DIM, [0, 1])


@pytest.mark.parametrize("t", [1, 2, 4])
def test_fused_gate_up_builds_each_ranks_vllm_parameter(t):
    inter = 32
    gate, up = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN)
    ranks = list(range(t))
    targets = L.fused_gate_up(gate.shape, up.shape, ranks)
    assert {x.param for ts in targets.values() for x in ts} == {"gate_up_proj"}
    for i in ranks:
        param = _fill(targets, {"gate": gate, "up": up}, i, 2 * inter // t, (HIDDEN,))
        assert torch.equal(param, torch.cat([gate.chunk(t)[i], up.chunk(t)[i]]))


# ---------------------------------------------------------------------------------------------
# local_views


def test_local_views_are_views_of_the_parameters():
    param = torch.zeros(6, 4)
    target = Target(0, Box((0, 0), (2, 4)), "p", 0, 3)
    (view,) = L.local_views([target], {"p": param})
    view.fill_(1)
    assert param[3:5].eq(1).all() and param[:3].eq(0).all() and param[5:].eq(0).all()


@pytest.mark.parametrize("target,match", [
    (Target(0, Box((0, 0), (2, 4)), "p", 0, 5), "does not fit"),   # past the end
    (Target(0, Box((0, 0), (2, 3)), "p", 0, 0), "does not fit"),   # wrong width
    (Target(0, Box((0,), (2,)), "p", 0, 0), "does not fit"),        # wrong dims
    (Target(0, Box((0, 0), (2, 4)), "q", 0, 0), "no parameter 'q'"),
])
def test_local_views_name_the_target_that_does_not_fit(target, match):
    with pytest.raises(ValueError, match=match):
        L.local_views([target], {"p": torch.zeros(6, 4)})


def test_local_views_take_one_ranks_targets():
    box = Box((0, 0), (1, 4))
    with pytest.raises(ValueError, match="one rank"):
        L.local_views([Target(0, box, "p", 0, 0), Target(1, box, "p", 0, 1)],
                      {"p": torch.zeros(6, 4)})
