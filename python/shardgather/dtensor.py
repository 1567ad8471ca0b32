"""DTensors (torch.distributed.tensor) to full tensors in one collective.

``full_tensors`` does for a whole list (or state dict) what ``[t.full_tensor() for t in ...]``
does one tensor and one collective at a time. Each DTensor's layout (its mesh, placements and
global shape, the same on every rank) is turned into a :class:`ShardSpec`: per rank of the
mesh, how many rows along the sharded tensor dim it contributes. Replicas of a shard (ranks that
differ only on Replicate mesh dims) contribute nothing but the first, so every byte crosses the
wire once; the whole list is then one :func:`shardgather.unshard` over the mesh's ranks.
"""

from torch.distributed.tensor import DTensor, Replicate, Shard
import torch.distributed as dist

from ._groups import _setup_timeout, communicator
from ._ops import unshard
from ._shardgather import InvalidArgumentError, ShardSpec
from ._agree import Agreement, check_str, fail_call

# DTensor's own chunking of a dim (size, offset of chunk c of n): Shard's public static method
# since torch 2.11; torch 2.9 has it only as the private static one (an instance method in 2.11).
_shard_size_and_offset = getattr(Shard, "local_shard_size_and_offset", None) or \
    Shard._local_shard_size_and_offset

__all__ = ["full_tensors"]


class _Unsupported(ValueError):
    pass


def full_tensors(tensors, group=None, *, strategy="auto", timeout=None, quantize=None):
    """The full tensors of ``tensors`` (a list, or a dict returned as a dict with the same keys),
    bit-exact with ``t.full_tensor()`` for each DTensor, gathered in one collective over their
    mesh; plain tensors are passed through as they are. Collective over the mesh's ranks: every
    rank passes DTensors of the same layouts in the same order.

    Placements: ``Shard(d)`` and ``Replicate()`` on any mesh dims, a tensor sharded along one
    tensor dim (on one or several mesh dims), uneven and empty shards. ``Partial`` and strided
    sharding raise InvalidArgumentError. All DTensors must be on one mesh. ``group`` (a group
    over exactly the mesh's ranks) is needed only for an n-D mesh that spans part of the world;
    otherwise it is the mesh's own group, or the default group.

    The full tensors of sharded DTensors are new tensors sharing one buffer and never require
    grad; a DTensor replicated on every mesh dim returns its local tensor, as ``full_tensor()``
    does. Errors: as for
    :func:`shardgather.unshard`, on every rank: lists whose layouts differ across ranks raise
    MismatchError, an unsupported layout raises InvalidArgumentError.

    ``quantize`` (:mod:`shardgather.quantized`): a format name or ``Quantize`` for every tensor
    of 2 or more dims it can quantize, or a dict (by key; by index for a list) or a list of
    them. A quantized entry is ``(data, scales)`` (or the dequantized tensor), bit-identical to
    quantizing ``t.full_tensor()``: sharded DTensors are quantized on send, in one call of a
    quantized plan (``strategy`` then "auto" or "direct", as for :func:`shardgather.unshard`
    with ``quantize``), replicated and plain ones here.
    """
    is_dict = isinstance(tensors, dict)
    items = list(tensors.values()) if is_dict else list(tensors)
    where = [i for i, t in enumerate(items) if isinstance(t, DTensor)]
    if quantize is not None:
        return _full_quantized(tensors, items, where, group, strategy, timeout, quantize)
    out = list(items)
    if where:
        mesh = items[where[0]].device_mesh
        try:
            mesh_group = _mesh_group(mesh, group)
        except _Unsupported as e:  # the same on every rank of the mesh: nobody is waiting
            raise InvalidArgumentError("full_tensors: " + str(e)) from None
        comm = communicator(mesh_group, _setup_timeout(timeout))
        sharded = _agreed_layouts(comm, [items[i] for i in where], mesh, mesh_group,
                                  list(tensors.keys()) if is_dict else None, strategy, timeout)
        full = unshard([s for _, s, _ in sharded], [spec for _, _, spec in sharded], comm,
                       strategy=strategy, timeout=timeout)
        for (k, _, _), t in zip(sharded, full):
            out[where[k]] = t
        gathered = {where[k] for k, _, _ in sharded}
        for i in where:
            if i not in gathered:  # replicated: the local tensor is the full one
                out[i] = items[i].to_local()
    if is_dict:
        return dict(zip(tensors.keys(), out))
    return out


def _full_quantized(tensors, items, where, group, strategy, timeout, quantize):
    """full_tensors with ``quantize``: one agreement (keys, specs, quantize specs, strategy),
    then one call of a quantized UnshardPlan made for the call over the sharded DTensors (FP8
    on send in the plan's quantize stage, the cut blocks' maxima in the same call); replicated
    and plain tensors are quantized here."""
    from . import quantized
    from ._ops import UnshardPlan

    keys = list(tensors.keys()) if isinstance(tensors, dict) else list(range(len(items)))
    if not where:
        raise InvalidArgumentError("full_tensors: quantize needs DTensors (a list of plain "
                                   "tensors has no group to agree over)")
    mesh = items[where[0]].device_mesh
    try:
        mesh_group = _mesh_group(mesh, group)
    except _Unsupported as e:
        raise InvalidArgumentError("full_tensors: " + str(e)) from None
    comm = communicator(mesh_group, _setup_timeout(timeout))
    agreement = Agreement("full_tensors")
    agreement.capture(lambda: check_str("strategy", strategy))
    agreement.capture(lambda: quantized.check_keywords(timeout=timeout))
    if isinstance(strategy, str) and strategy not in ("auto", "direct"):
        agreement.fail(InvalidArgumentError, "full_tensors: with quantize, strategy is \"auto\" "
                       "or \"direct\" (a quantized plan moves as one personal exchange), got %r"
                       % strategy)
    per_item, sharded = [], []

    def plan():
        described = [quantized.Described(t.dtype, t.shape) for t in items]
        per_item.extend(quantized.resolve(quantize, described,
                                          keys if isinstance(tensors, dict) else None))
        agreement.quantize = [None if q is None else quantized._text(q) for q in per_item]
        for i, q in enumerate(per_item):
            if q is not None and items[i].device.type != "cpu":
                raise InvalidArgumentError("full_tensors: quantize runs on CPU tensors (the "
                                           "host quantizer); %r is on %s" % (keys[i],
                                                                            items[i].device))
        sharded.extend(_layouts([items[i] for i in where], mesh, mesh_group))
        agreement.specs = [spec for _, _, spec in sharded]
        made = UnshardPlan(agreement.specs, comm.size, comm.rank, strategy=strategy,
                           timeout=timeout, _stage="full_tensors(quantize): payload",
                           quantize=[per_item[where[k]] for k, _, _ in sharded])
        made._built()  # its argument error, raised here, is the agreement's
        return made

    made = agreement.capture(plan)
    agreement.names = keys if isinstance(tensors, dict) else None
    agreement.run(comm, _setup_timeout(timeout))
    out = list(items)
    got = made.execute([sh for _, sh, _ in sharded], comm)
    for (k, _, _), t in zip(sharded, got):
        out[where[k]] = t
    gathered = {where[k] for k, _, _ in sharded}
    for i, t in enumerate(items):
        if i in gathered:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        out[i] = local if per_item[i] is None else quantized.quantize_here(local, per_item[i])
    return dict(zip(keys, out)) if isinstance(tensors, dict) else out


def _agreed_layouts(comm, dtensors, mesh, mesh_group, names, strategy, timeout):
    """_layouts(), with a failure on any rank raised on every rank. For a dict the ranks also
    agree on its keys, in order (one small collective): the same layouts under other keys would
    gather one parameter's rows into another's."""
    agreement = Agreement("full_tensors")
    agreement.capture(lambda: check_str("strategy", strategy))
    sharded = agreement.capture(lambda: _layouts(dtensors, mesh, mesh_group))
    if names is not None:
        agreement.names = names
        agreement.specs = [spec for _, _, spec in sharded] if sharded is not None else None
        agreement.run(comm, _setup_timeout(timeout))
    elif agreement.error is not None:  # the peers are in the unshard call: they raise it too
        cls, message = agreement.error
        fail_call(comm, "unshard", cls, "full_tensors: " + message,
                  timeout=_setup_timeout(timeout))
    return sharded


def _mesh_group(mesh, group):
    """A group over exactly the mesh's ranks: `group` if given (checked), else the mesh's own
    for a 1-D mesh, else the default group when the mesh spans every rank. No group is created
    here: creating one on some ranks only would shift torch's group numbering on those ranks
    and mismatch every group the program creates afterwards."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    if group is not None:
        have = sorted(dist.get_process_group_ranks(group))
        if have != ranks:
            raise _Unsupported("group= holds ranks %s but the mesh holds %s" % (have, ranks))
        return group
    if mesh.ndim == 1:
        return mesh.get_group()
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    raise _Unsupported("the %d-D mesh %s spans ranks %s, not every rank: pass group=, a group "
                       "over exactly those ranks" % (mesh.ndim, mesh, ranks))


def _coordinates(mesh):
    """(global rank, mesh coordinate) for every rank of the mesh, in mesh order."""
    shape = list(mesh.mesh.shape)
    for flat, g in enumerate(mesh.mesh.flatten().tolist()):
        coord, rest = [], flat
        for n in reversed(shape):
            coord.append(rest % n)
            rest //= n
        yield g, coord[::-1]


def _layouts(dtensors, mesh, group):
    """For every sharded DTensor: its index in ``dtensors``, this rank's shard and its ShardSpec
    (per-rank sizes along the sharded dim, in group-rank order)."""
    world = dist.get_world_size(group)
    ranks = [(dist.get_group_rank(group, g), coord) for g, coord in _coordinates(mesh)]
    me = dist.get_group_rank(group, dist.get_rank())
    sharded = []
    sizes_of = {}  # (placements, rows) -> per-rank sizes: most parameters share a few layouts
    for i, t in enumerate(dtensors):
        if t.device_mesh is not mesh and t.device_mesh != mesh:
            raise _Unsupported("tensor %d is on mesh %s, tensor 0 on %s: all DTensors must be "
                               "on one mesh" % (i, t.device_mesh, mesh))
        dim = _shard_dim(i, t)
        if dim is None:
            continue  # replicated everywhere: its local tensor is its full tensor
        key = (t.placements, t.shape[dim])
        sizes = sizes_of.get(key)
        if sizes is None:
            sizes = sizes_of[key] = _sizes(i, t.placements, ranks, mesh, t.shape[dim], world)
        local = t.to_local()
        sharded.append((i, local if sizes[me] else local.narrow(dim, 0, 0),
                        ShardSpec(t.dtype, tuple(t.shape), dim, sizes)))
    return sharded


def _shard_dim(i, t):
    """The one tensor dim the placements shard (None: all Replicate)."""
    dims = set()
    for p in t.placements:
        if type(p) is Shard:
            dims.add(p.dim if p.dim >= 0 else p.dim + t.ndim)
        elif not isinstance(p, Replicate):
            raise _Unsupported("tensor %d has placement %s (%s): only Shard(d) and Replicate() "
                               "can be gathered" % (i, type(p).__name__, p))
    if len(dims) > 1:
        raise _Unsupported("tensor %d is sharded along dims %s (placements %s): only one "
                           "tensor dim may be sharded" % (i, sorted(dims), t.placements))
    return dims.pop() if dims else None


def _first_replica(placements, coord):
    """Whether this coordinate is the first of its shard's replicas (0 on every Replicate dim)."""
    return all(c == 0 for p, c in zip(placements, coord) if not isinstance(p, Shard))


def _block(placements, coord, full, mesh):
    """(offset, rows) of a coordinate's block along the sharded dim, nested as DTensor does."""
    offset, rows = 0, full
    for m, (p, c) in enumerate(zip(placements, coord)):
        if isinstance(p, Shard):
            rows, start = _shard_size_and_offset(rows, mesh.size(m), c)
            offset += start
    return offset, rows


def _sizes(i, placements, ranks, mesh, full, world):
    """Per group rank, the rows it sends: its block's for the first replica of each shard, 0 for
    the others. unshard concatenates in group-rank order, so the blocks must come in that order
    too (true for every mesh whose ranks ascend along its sharded dims, the usual layouts)."""
    sizes = [0] * world
    at = 0
    for r, coord in sorted(ranks, key=lambda rc: rc[0]):
        if not _first_replica(placements, coord):
            continue
        offset, rows = _block(placements, coord, full, mesh)
        if rows and offset != at:
            raise _Unsupported("tensor %d: the mesh %s holds its shards out of rank order "
                               "(group rank %d has rows %d.. where %d.. comes next)"
                               % (i, mesh, r, offset, at))
        at += rows
        sizes[r] = rows
    return sizes
