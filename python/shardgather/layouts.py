"""Layouts for :class:`shardgather.ReshardPlan` (docs/reshard.md): per tensor, its global shape
and dtype and the boxes each rank holds (sources) and wants (destinations).

Pure Python (torch only, no compiled extension, no process group), so layouts can be built and
checked anywhere. Three kinds of helpers build the ``(rank, Box)`` lists:

* DTensor placements: :func:`placement_boxes` (the box of every rank of a device mesh, exactly
  as DTensor computes it) and :func:`dtensor_layout` (one DTensor layout to another);
* inference-engine tensor parallelism over a list of ranks: :func:`column_parallel`,
  :func:`row_parallel`, :func:`replicated`, :func:`vocab_parallel`, :func:`expert_boxes`;
* fused engine parameters, where a global tensor lands in a slice of a rank's parameter:
  :class:`Target`, :func:`fused_qkv`, :func:`fused_gate_up`, and :func:`local_views` to turn
  a rank's Targets into the views its reshard writes.
"""

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = [
    "VLLM_VOCAB_PADDING",
    "Box",
    "Target",
    "TensorLayout",
    "VocabShard",
    "column_parallel",
    "dtensor_layout",
    "expert_boxes",
    "expert_ranges",
    "fused_gate_up",
    "fused_qkv",
    "local_views",
    "placement_boxes",
    "replicated",
    "row_parallel",
    "target_boxes",
    "vocab_parallel",
]


class Box(NamedTuple):
    """An N-d box of a global tensor: the elements offset[d] <= x[d] < offset[d] + size[d].
    A 0-d tensor's box has no dims."""

    offset: tuple
    size: tuple


class Target(NamedTuple):
    """Where a box of a global tensor lands on a rank: in the rank's local parameter ``param``,
    as ``param.narrow(dim, start, box.size[dim])`` (full extent on the other dims). Fused
    engine parameters (QKV, gate_up) hold several global tensors this way."""

    rank: int
    box: Box
    param: str
    dim: int
    start: int


class VocabShard(NamedTuple):
    """One rank's part of a vocabulary-parallel [vocab, ...] tensor: ``box`` is the real rows it
    owns (possibly none), landing at local row ``start`` of its parameter, which has
    ``padded_rows`` rows (the padding rows exist only in the engine's parameter)."""

    rank: int
    box: Box
    start: int
    padded_rows: int

    def target(self, param="weight"):
        """This shard as a :class:`Target` in the rank's parameter ``param`` (dim 0)."""
        return Target(self.rank, self.box, param, 0, self.start)


@dataclass
class TensorLayout:
    """One tensor's two layouts: ``sources`` and ``destinations`` are lists of (rank, Box)."""

    shape: tuple
    dtype: torch.dtype
    sources: list = field(default_factory=list)
    destinations: list = field(default_factory=list)

    def validate(self):
        """ValueError naming the entry (side, index, rank, box) whose box does not fit the
        shape: a wrong number of dims, a negative offset or size, or an end past the shape."""
        for side in ("sources", "destinations"):
            for k, (rank, box) in enumerate(getattr(self, side)):
                offset, size = box
                if not len(offset) == len(self.shape) == len(size):
                    why = "has %d/%d dims for a %d-d tensor" % (len(offset), len(size),
                                                                 len(self.shape))
                elif not all(0 <= o and 0 <= n and o + n <= s
                             for o, n, s in zip(offset, size, self.shape)):
                    why = "does not fit"
                else:
                    continue
                raise ValueError("%s[%d] (rank %d): box %s %s shape %s"
                                 % (side, k, rank, tuple(box), why, tuple(self.shape)))


# ---------------------------------------------------------------------------------------------
# Small checks and box arithmetic shared by the helpers.


def _is_int(x):
    """Whether ``x`` is an int (bool excluded), a torch/numpy integer scalar included."""
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _shape(shape):
    """``shape`` as a tuple of non-negative ints, or ValueError."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError("shape must be a sequence of ints, got %r" % (shape,)) from None
    if not all(_is_int(n) and n >= 0 for n in dims):
        raise ValueError("shape must be non-negative ints, got %r" % (dims,))
    return tuple(int(n) for n in dims)


def _ranks(ranks):
    """``ranks`` as a non-empty list of distinct non-negative ints, or ValueError."""
    out = list(ranks)
    if not out or not all(_is_int(r) and r >= 0 for r in out):
        raise ValueError("ranks must be a non-empty list of non-negative ints, got %r" % (out,))
    if len(set(out)) != len(out):
        raise ValueError("ranks must be distinct, got %r" % (out,))
    return [int(r) for r in out]


def _divide(n, parts, what):
    """n / parts when it divides evenly (as the engines' ``divide`` asserts), else ValueError."""
    if n % parts:
        raise ValueError("%s (%d) is not divisible by %d" % (what, n, parts))
    return n // parts


def _need_dims(shape, ndim, name):
    """ValueError unless ``shape`` has at least ``ndim`` dims (``name`` is the helper)."""
    if len(shape) < ndim:
        raise ValueError("%s needs a tensor of at least %d dims, got shape %s"
                         % (name, ndim, shape))


def _along(shape, dim, start, size):
    """The box of the whole ``shape`` except ``[start, start + size)`` along ``dim``."""
    offset = [0] * len(shape)
    sizes = list(shape)
    offset[dim], sizes[dim] = start, size
    return Box(tuple(offset), tuple(sizes))


def _whole(shape):
    """The box of the whole tensor."""
    return Box((0,) * len(shape), tuple(shape))


def _chunk(n, parts, index):
    """(start, size) of piece ``index`` of ``n`` split like torch.chunk: pieces of
    ceil(n / parts), the trailing ones smaller or empty; an empty piece starts at ``n``."""
    piece = -(-n // parts)
    start = min(index * piece, n)
    return start, min(n, start + piece) - start


def _balanced(n, parts, index):
    """(start, size) of piece ``index`` of ``n`` split like torch.tensor_split: the first
    ``n % parts`` pieces have one more element than the others."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


# ---------------------------------------------------------------------------------------------
# DTensor placements.


def _mesh_grid(mesh):
    """The mesh's global ranks as a CPU int64 tensor of >= 1 dims: from a DeviceMesh (its
    ``.mesh``), a torch tensor or a nested list; ValueError if malformed."""
    if not isinstance(mesh, (torch.Tensor, list, tuple)) and hasattr(mesh, "mesh"):
        mesh = mesh.mesh
    try:
        grid = torch.as_tensor(mesh)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError("mesh must be a DeviceMesh, a tensor or a nested list of ranks: %s"
                         % e) from None
    if grid.dim() < 1 or grid.numel() == 0 or grid.is_floating_point() or grid.is_complex() \
            or grid.dtype == torch.bool:
        raise ValueError("mesh must be a non-empty grid of integer ranks, got %r" % (mesh,))
    grid = grid.to("cpu", torch.int64)
    flat = grid.flatten().tolist()
    if min(flat) < 0 or len(set(flat)) != len(flat):
        raise ValueError("mesh ranks must be distinct and non-negative, got %s" % flat)
    return grid


def _shard_dims(placements, mesh_ndim, ndim):
    """Per mesh dim, the tensor dim it shards (negative dims normalised) or None (Replicate).
    ValueError for Partial (a partial sum is no box of the global tensor), _StridedShard (its
    rows are not contiguous), any other placement, or a wrong count or dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = list(placements)
    if len(placements) != mesh_ndim:
        raise ValueError("%d placements for a %d-d mesh" % (len(placements), mesh_ndim))
    dims = []
    for p in placements:
        if isinstance(p, Replicate):
            dims.append(None)
        elif isinstance(p, Shard) and not hasattr(p, "split_factor"):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError("%r shards dim %d of a %d-d tensor" % (p, p.dim, ndim))
            dims.append(d)
        elif isinstance(p, Partial):
            raise ValueError("%r: a Partial placement holds partial values, not a box of the "
                             "global tensor; redistribute it to Replicate or Shard first" % (p,))
        else:
            raise ValueError("placement %r is not supported (only Shard and Replicate)" % (p,))
    return dims


def _dtensor_box(shape, mesh_shape, dims, coord):
    """The box DTensor gives the rank at mesh coordinate ``coord``: mesh dims shard their
    tensor dim left to right, each splitting the piece the previous ones left (torch.chunk
    style). As torch's compute_local_shape_and_global_offset, an empty piece's offset along
    its dim is the global size of that dim (also for a later mesh dim splitting it again)."""
    offset, size = [0] * len(shape), list(shape)
    for mesh_dim, d in enumerate(dims):
        if d is None:
            continue
        start, size[d] = _chunk(size[d], mesh_shape[mesh_dim], coord[mesh_dim])
        offset[d] = offset[d] + start if size[d] else shape[d]
    return Box(tuple(offset), tuple(size))


def placement_boxes(shape, mesh, placements):
    """The (rank, Box) each rank of ``mesh`` holds of a DTensor of global ``shape`` with
    ``placements`` (one Shard(d) or Replicate() per mesh dim), in the mesh's row-major order.

    ``mesh``: a DeviceMesh (only its ``.mesh`` tensor of global ranks is read, no process group
    is needed), or a torch tensor / nested list of global ranks with any number of dims. The
    boxes equal what torch's ``compute_local_shape_and_global_offset`` returns on each rank
    (uneven and empty shards, a tensor dim sharded by several mesh dims), so a reshard reads
    and writes exactly the local tensors DTensor holds.
    """
    shape = _shape(shape)
    grid = _mesh_grid(mesh)
    dims = _shard_dims(placements, grid.dim(), len(shape))
    coords = itertools.product(*(range(n) for n in grid.shape))
    return [(rank, _dtensor_box(shape, tuple(grid.shape), dims, coord))
            for coord, rank in zip(coords, grid.flatten().tolist())]


def dtensor_layout(shape, dtype, src_mesh, src_placements, dst_mesh, dst_placements):
    """The :class:`TensorLayout` resharding a DTensor of global ``shape`` and ``dtype`` from
    (``src_mesh``, ``src_placements``) to (``dst_mesh``, ``dst_placements``); see
    :func:`placement_boxes`. The meshes may hold different ranks."""
    layout = TensorLayout(_shape(shape), dtype, placement_boxes(shape, src_mesh, src_placements),
                          placement_boxes(shape, dst_mesh, dst_placements))
    layout.validate()
    return layout


# ---------------------------------------------------------------------------------------------
# Inference-engine tensor parallelism over ``ranks`` (t = len(ranks); rank index i = position).
# nn.Linear weights are [out_features, in_features].


def _split_dim(shape, ranks, dim, what):
    """Rank i gets the i-th of t equal pieces of ``dim`` (ValueError if it does not divide)."""
    piece = _divide(shape[dim], len(ranks), what)
    return [(r, _along(shape, dim, i * piece, piece)) for i, r in enumerate(ranks)]


def column_parallel(shape, ranks):
    """(rank, Box) of a column-parallel layer's weight [out, in] or bias [out]: dim 0 in t
    equal pieces, as vLLM's ColumnParallelLinear (ValueError if t does not divide it)."""
    shape, ranks = _shape(shape), _ranks(ranks)
    _need_dims(shape, 1, "column_parallel")
    return _split_dim(shape, ranks, 0, "column_parallel: dim 0 of %s" % (shape,))


def row_parallel(shape, ranks):
    """(rank, Box) of a row-parallel layer's weight [out, in]: dim 1 in t equal pieces, as
    vLLM's RowParallelLinear. A 1-D tensor (its bias, added after the all-reduce) is
    replicated: every rank gets the whole."""
    shape, ranks = _shape(shape), _ranks(ranks)
    if len(shape) == 1:
        return replicated(shape, ranks)
    _need_dims(shape, 2, "row_parallel")
    return _split_dim(shape, ranks, 1, "row_parallel: dim 1 of %s" % (shape,))


def replicated(shape, ranks):
    """(rank, Box): every rank gets the whole tensor (norms, replicated biases)."""
    shape = _shape(shape)
    return [(r, _whole(shape)) for r in _ranks(ranks)]


# vLLM's DEFAULT_VOCAB_PADDING_SIZE: VocabParallelEmbedding and ParallelLMHead pad the
# vocabulary to a multiple of it before splitting it over the TP ranks.
VLLM_VOCAB_PADDING = 64


def vocab_parallel(shape, ranks, pad_to=VLLM_VOCAB_PADDING, *, per_rank=False):
    """Per rank (in ``ranks`` order: rank ``ranks[i]`` is TP index i) a :class:`VocabShard` of
    an embedding or lm_head [vocab, hidden] split along dim 0 as vLLM's VocabParallelEmbedding
    / ParallelLMHead does.

    The vocabulary is padded to ``vocab_padded``: a multiple of ``pad_to`` (by default 64,
    vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` and ``pad_vocab_size``); with ``pad_to=None`` only
    to a multiple of t; with ``per_rank=True`` to a multiple of ``pad_to * t``, as Megatron-LM's
    make_vocab_size_divisible_by. Every rank's parameter has ``vocab_padded / t`` rows
    (ValueError if t does not divide it, as vLLM's ``divide`` asserts), and rank i owns the
    real rows of [i * rows, (i + 1) * rows): its box (empty past the vocabulary) lands at local
    row 0. The rest of its parameter is padding, outside the global tensor: no box covers it,
    so a reshard or a weight sync never writes it (it keeps what the engine put there).
    """
    shape, ranks = _shape(shape), _ranks(ranks)
    _need_dims(shape, 1, "vocab_parallel")
    if pad_to is not None and not (_is_int(pad_to) and pad_to > 0):
        raise ValueError("pad_to must be a positive int or None, got %r" % (pad_to,))
    t, vocab = len(ranks), shape[0]
    multiple = t if pad_to is None else int(pad_to) * (t if per_rank else 1)
    padded = -(-vocab // multiple) * multiple
    rows = _divide(padded, t, "vocab_parallel: the padded vocabulary")
    return [VocabShard(r, _along(shape, 0, min(i * rows, vocab),
                                 max(0, min(vocab - i * rows, rows))), 0, rows)
            for i, r in enumerate(ranks)]


def expert_ranges(num_experts, ranks, split="chunk"):
    """(rank, first_expert, count) per rank: contiguous expert ranges. ``split="chunk"``:
    torch.chunk's pieces (ceil(E / t) each, trailing ranks fewer or none); ``"balanced"``:
    vLLM's default "linear" expert placement (the first E % t ranks get one more)."""
    if not (_is_int(num_experts) and num_experts >= 0):
        raise ValueError("num_experts must be a non-negative int, got %r" % (num_experts,))
    pieces = {"chunk": _chunk, "balanced": _balanced}
    if split not in pieces:
        raise ValueError("split must be 'chunk' or 'balanced', got %r" % (split,))
    ranks = _ranks(ranks)
    return [(r,) + pieces[split](int(num_experts), len(ranks), i) for i, r in enumerate(ranks)]


def expert_boxes(shape, ranks, dim=0, split="chunk"):
    """(rank, Box) of a stacked experts tensor (the experts along ``dim``, 0 by default: [E,
    ...]): each rank the experts of :func:`expert_ranges`, whole."""
    shape = _shape(shape)
    _need_dims(shape, 1, "expert_boxes")
    if not (_is_int(dim) and -len(shape) <= dim < len(shape)):
        raise ValueError("dim %r out of range for shape %s" % (dim, shape))
    dim = int(dim) % len(shape)
    return [(r, _along(shape, dim, first, count))
            for r, first, count in expert_ranges(shape[dim], ranks, split)]


# ---------------------------------------------------------------------------------------------
# Fused parameters: several global tensors stacked along dim 0 of each rank's parameter.


def _stacked(param, ranks, parts):
    """{name: [Target]} for ``parts``, a list of (name, shape, rows, source_index) stacked in
    that order along dim 0 of each rank's ``param``: rank i's piece of ``name`` is rows
    [source_index(i) * rows, + rows) of its global tensor."""
    out = {name: [] for name, _, _, _ in parts}
    for i, r in enumerate(ranks):
        start = 0
        for name, shape, rows, source_index in parts:
            box = _along(shape, 0, source_index(i) * rows, rows)
            out[name].append(Target(r, box, param, 0, start))
            start += rows
    return out


def _same_trailing(shapes, names, what):
    """ValueError unless the shapes have >= 1 dim and the same dims after the first."""
    shapes = [_shape(s) for s in shapes]
    for s in shapes:
        _need_dims(s, 1, what)
    if len({s[1:] for s in shapes}) != 1:
        raise ValueError("%s: %s shapes %s differ past dim 0" % (what, "/".join(names), shapes))
    return shapes


def fused_qkv(q_shape, k_shape, v_shape, num_heads, num_kv_heads, head_dim, ranks,
              param="qkv_proj"):
    """{"q", "k", "v": [Target]} of vLLM's QKVParallelLinear: rank i's local ``param`` is
    [(q_local + 2 * kv_local) * head_dim, hidden] (or the bias, 1-D), its query heads first,
    then its key heads, then its value heads.

    q_local = num_heads / t. With num_kv_heads > t, the kv heads are split: kv_local =
    num_kv_heads / t, rank i gets kv heads [i * kv_local, + kv_local). With num_kv_heads <= t
    (vLLM's rule ``tp_size >= total_num_kv_heads``) they are replicated: kv_local = 1 and rank
    i gets kv head i // (t / num_kv_heads) (vLLM's ``tp_rank // num_kv_head_replicas``), so
    t / num_kv_heads consecutive ranks share one. Every division must be exact (ValueError).
    """
    ranks = _ranks(ranks)
    q_shape, k_shape, v_shape = _same_trailing((q_shape, k_shape, v_shape), "qkv", "fused_qkv")
    t = len(ranks)
    if not all(_is_int(n) and n > 0 for n in (num_heads, num_kv_heads, head_dim)):
        raise ValueError("fused_qkv: num_heads, num_kv_heads and head_dim must be positive "
                         "ints, got %r" % ((num_heads, num_kv_heads, head_dim),))
    for name, shape, heads in (("q", q_shape, num_heads), ("k", k_shape, num_kv_heads),
                               ("v", v_shape, num_kv_heads)):
        if shape[0] != heads * head_dim:
            raise ValueError("fused_qkv: %s has %d rows, not %d heads x head_dim %d"
                             % (name, shape[0], heads, head_dim))
    q_rows = _divide(num_heads, t, "fused_qkv: num_heads") * head_dim
    if num_kv_heads > t:
        kv_heads, kv_index = _divide(num_kv_heads, t, "fused_qkv: num_kv_heads"), lambda i: i
    else:
        replicas = _divide(t, num_kv_heads, "fused_qkv: the TP degree (kv heads replicated)")
        kv_heads, kv_index = 1, lambda i: i // replicas
    kv_rows = kv_heads * head_dim
    return _stacked(param, ranks, [("q", q_shape, q_rows, lambda i: i),
                                   ("k", k_shape, kv_rows, kv_index),
                                   ("v", v_shape, kv_rows, kv_index)])


def fused_gate_up(gate_shape, up_shape, ranks, param="gate_up_proj"):
    """{"gate", "up": [Target]} of vLLM's MergedColumnParallelLinear: rank i's local
    ``param`` is [gate_rows / t + up_rows / t, hidden], its gate rows first, then its up rows
    (each the i-th of t equal pieces; ValueError if t does not divide)."""
    ranks = _ranks(ranks)
    gate_shape, up_shape = _same_trailing((gate_shape, up_shape), "gate/up", "fused_gate_up")
    t = len(ranks)
    return _stacked(param, ranks, [
        ("gate", gate_shape, _divide(gate_shape[0], t, "fused_gate_up: gate rows"), lambda i: i),
        ("up", up_shape, _divide(up_shape[0], t, "fused_gate_up: up rows"), lambda i: i)])


def target_boxes(targets):
    """The (rank, Box) destination entries of a list of :class:`Target` (or
    :class:`VocabShard`), for a :class:`TensorLayout`."""
    return [(t.rank, t.box) for t in targets]


def local_views(targets, params):
    """The views one rank's reshard writes: for each :class:`Target` (all of one rank),
    ``params[t.param].narrow(t.dim, t.start, t.box.size[t.dim])``, checked to have the box's
    shape. ``params`` maps a parameter name to that rank's local tensor. ValueError names the
    target that does not fit."""
    targets = list(targets)
    if len({t.rank for t in targets}) > 1:
        raise ValueError("local_views takes one rank's targets, got ranks %s"
                         % sorted({t.rank for t in targets}))
    return [_view(t, params) for t in targets]


def _view(target, params):
    """One Target's view (see :func:`local_views`), or ValueError naming it."""
    if target.param not in params:
        raise ValueError("%r: no parameter %r" % (target, target.param))
    param, size = params[target.param], tuple(target.box.size)
    ok = 0 <= target.dim < param.dim() == len(size) and target.start >= 0 \
        and target.start + size[target.dim] <= param.shape[target.dim]
    view = param.narrow(target.dim, target.start, size[target.dim]) if ok else None
    if view is None or tuple(view.shape) != size:
        raise ValueError("%r does not fit parameter %r of shape %s"
                         % (target, target.param, tuple(param.shape)))
    return view
