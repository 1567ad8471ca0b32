"""DTensor cases (shardgather.full_tensors and DTensor inputs), run on every rank of a spawned
Gloo group (see conftest.run_cases). Every result is compared bit for bit with
``t.full_tensor()`` of the same DTensor, one collective each."""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardgather

T = 30.0

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int8, torch.bool]


def make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(out, tensors):
    """out[i] against tensors[i].full_tensor() (or tensors[i] itself when it is no DTensor)."""
    assert len(out) == len(tensors), (len(out), len(tensors))
    for i, (a, t) in enumerate(zip(out, tensors)):
        if not isinstance(t, DTensor):
            assert a is t, "plain tensor %d must be passed through" % i
            continue
        b = t.full_tensor()
        assert type(a) is torch.Tensor, (i, type(a))
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(raw(a), raw(b)), "tensor %d differs from full_tensor()" % i


def sharded_list(mesh, placements_list, seed):
    """Full tensors of awkward shapes (rows not divisible by the mesh, fewer rows than ranks)
    distributed with each placement and dtype; the same on every rank (same seed)."""
    shapes = [(7, 5), (3, 11), (2,), (5, 1, 3), (13, 4), (1, 6)]
    out = []
    for k, placements in enumerate(placements_list):
        for j, (shape, dtype) in enumerate(zip(shapes, DTYPES)):
            ok = all(not isinstance(p, Shard) or p.dim < len(shape) for p in placements)
            if ok:
                full = make(shape, dtype, seed + 17 * k + j)
                out.append(distribute_tensor(full, mesh, placements))
    return out


def without_collectives(full, mesh, dim):
    """The Shard(dim) DTensor of `full` on a 1-D mesh built from this rank's chunk alone
    (distribute_tensor communicates, and would itself fail on layouts that differ by rank)."""
    rank = mesh.get_local_rank()
    chunks = list(torch.chunk(full, mesh.size(), dim))
    chunks += [full.narrow(dim, 0, 0)] * (mesh.size() - len(chunks))
    return DTensor.from_local(chunks[rank].contiguous(), mesh, [Shard(dim)], run_check=False,
                              shape=full.shape, stride=full.stride())


def case_one_dim_mesh(rank, world):
    """Shard(0), Shard(1), Shard(-1) and Replicate on a 1-D mesh, uneven and empty shards,
    mixed dtypes, plain tensors passed through; a list and a dict."""
    mesh = init_device_mesh("cpu", (world,))
    tensors = sharded_list(mesh, [[Shard(0)], [Shard(1)], [Shard(-1)], [Replicate()]], 1)
    plain = make((3,), torch.float32, rank)  # rank-local: returned as it is
    tensors = tensors[:3] + [plain] + tensors[3:]
    assert_bit_exact(shardgather.full_tensors(tensors, timeout=T), tensors)
    as_dict = {"p%d" % i: t for i, t in enumerate(tensors)}
    out = shardgather.full_tensors(as_dict, timeout=T)
    assert type(out) is dict and list(out) == list(as_dict), list(out)
    assert_bit_exact(list(out.values()), tensors)
    assert shardgather.full_tensors([], timeout=T) == []
    assert shardgather.full_tensors([plain], timeout=T)[0] is plain


def case_one_collective(rank, world):
    """The whole list is one unshard: one header and one payload exchange, whatever its length
    (full_tensor() costs one collective per tensor)."""
    mesh = init_device_mesh("cpu", (world,))
    tensors = sharded_list(mesh, [[Shard(0)], [Shard(1)]], 5)
    comm = shardgather.communicator(mesh.get_group())
    shardgather.full_tensors(tensors, timeout=T)  # builds the communicator
    before = comm.collectives_issued
    assert_bit_exact(shardgather.full_tensors(tensors, timeout=T), tensors)
    issued = comm.collectives_issued - before
    assert issued <= 2, "%d collectives for %d tensors" % (issued, len(tensors))


def case_two_dim_mesh(rank, world):
    """A 2 x (world/2) mesh: Shard on one mesh dim and Replicate on the other (both ways), the
    same tensor dim sharded over both mesh dims, and fully replicated."""
    if world % 2:
        return
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    placements = [[Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(0)],
                  [Replicate(), Replicate()], [Replicate(), Shard(0)]]
    tensors = sharded_list(mesh, placements, 9)
    assert_bit_exact(shardgather.full_tensors(tensors, timeout=T), tensors)


def case_fully_shard_state_dict(rank, world):
    """The state dict of a small model sharded by FSDP2's fully_shard (CPU, Gloo): every entry
    is a DTensor; full_tensors of the whole dict equals full_tensor() of each entry."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3),
                                torch.nn.LayerNorm(3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values()), {k: type(v) for k, v in state.items()}
    out = shardgather.full_tensors(state, timeout=T)
    assert list(out) == list(state)
    assert_bit_exact(list(out.values()), list(state.values()))
    reference = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(),
                                    torch.nn.Linear(7, 3), torch.nn.LayerNorm(3))
    reference.load_state_dict(out)  # the full state dict loads into an unsharded model


def case_dtensor_inputs(rank, world):
    """foreach_all_gather and unshard take DTensors for their local shards."""
    mesh = init_device_mesh("cpu", (world,))
    tensors = sharded_list(mesh, [[Shard(0)]], 3)
    locals_ = [t.to_local() for t in tensors]
    a = shardgather.foreach_all_gather(tensors, mesh.get_group(), timeout=T)
    b = shardgather.foreach_all_gather(locals_, mesh.get_group(), timeout=T)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert u.shape == v.shape and torch.equal(raw(u), raw(v))
    hint = [[tuple(u.shape) for u in row] for row in zip(*b)]
    plan = shardgather.AllGatherPlan.create(tensors, mesh.get_group(), hint, timeout=T)
    for x, y in zip(plan.execute(tensors, mesh.get_group()), b):
        for u, v in zip(x, y):
            assert u.shape == v.shape and torch.equal(raw(u), raw(v))
    specs = [shardgather.ShardSpec(t.dtype, tuple(t.shape), 0) for t in tensors]
    full = shardgather.unshard(tensors, specs, mesh.get_group(), timeout=T)
    assert_bit_exact(full, tensors)


def case_mesh_over_some_ranks(rank, world):
    """An n-D mesh over part of the world: full_tensors needs group= (a group over exactly its
    ranks, made by the program like any group) and refuses, on every rank of the mesh, without
    it or with a group over other ranks; the other ranks take no part."""
    if world < 4:
        return
    mesh = DeviceMesh("cpu", [[0, 1]])  # every rank builds it: its sub-groups are world-collective
    pair = dist.new_group([0, 1])
    others = dist.new_group([1, 2])
    if rank > 1:
        return
    full = make((5, 3), torch.float32, 4)
    local = torch.chunk(full, 2)[rank].contiguous()
    t = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                           shape=full.shape, stride=full.stride())
    out = shardgather.full_tensors([t], pair, timeout=T)
    assert torch.equal(out[0], full), (out[0], full)
    _expect_everywhere(shardgather.InvalidArgumentError,
                       lambda: shardgather.full_tensors([t], timeout=T), "pass group=")
    _expect_everywhere(shardgather.InvalidArgumentError,
                       lambda: shardgather.full_tensors([t], others, timeout=T), "[1, 2]")


def _expect_everywhere(cls, fn, *needles):
    try:
        fn()
    except cls as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return
    raise AssertionError("expected %s on every rank" % cls.__name__)


def case_layouts_differ_across_ranks(rank, world):
    """A list that differs across ranks is one clear error on every rank, within the deadline:
    the count, a global shape, a placement."""
    if world < 2:
        return
    mesh = init_device_mesh("cpu", (world,))
    base = sharded_list(mesh, [[Shard(0)]], 11)
    shorter = base[:-1] if rank == 1 else base
    _expect_everywhere(shardgather.MismatchError,
                       lambda: shardgather.full_tensors(shorter, timeout=T))
    other = without_collectives(make((9 if rank == 1 else 8, 2), torch.float32, 0), mesh, 0)
    _expect_everywhere(shardgather.MismatchError,
                       lambda: shardgather.full_tensors(base + [other], timeout=T))
    full = make((8, 6), torch.float32, 1)
    odd = without_collectives(full, mesh, 1 if rank == 1 else 0)
    _expect_everywhere(shardgather.MismatchError,
                       lambda: shardgather.full_tensors(base + [odd], timeout=T))
    # The communicator is fine afterwards.
    assert_bit_exact(shardgather.full_tensors(base, timeout=T), base)


def case_unsupported_layouts(rank, world):
    """Partial, a layout on one rank only, and a mesh whose ranks do not ascend are
    InvalidArgumentError on every rank (the failing rank tells its peers)."""
    mesh = init_device_mesh("cpu", (world,))
    base = sharded_list(mesh, [[Shard(0)]], 13)
    partial = DTensor.from_local(make((4, 2), torch.float32, rank), mesh, [Partial()])
    _expect_everywhere(shardgather.InvalidArgumentError,
                       lambda: shardgather.full_tensors(base + [partial], timeout=T),
                       "Partial", "tensor %d" % len(base))
    if world > 1:
        mixed = [partial] if rank == 0 else [base[0]]
        _expect_everywhere(shardgather.InvalidArgumentError,
                           lambda: shardgather.full_tensors(mixed, timeout=T), "Partial")
        backwards = DeviceMesh("cpu", list(reversed(range(world))))
        t = distribute_tensor(make((6, 2), torch.float32, 2), backwards, [Shard(0)])
        _expect_everywhere(shardgather.InvalidArgumentError,
                           lambda: shardgather.full_tensors([t], timeout=T), "rank order")
    assert_bit_exact(shardgather.full_tensors(base, timeout=T), base)


def case_meshes_differ_across_ranks(rank, world):
    """DTensors on meshes that differ across ranks ([0, 1, ...] on rank 0, reversed on the
    others; torch gives both 1-D world meshes the default group): the ranks with the reversed
    mesh find its shards out of rank order and tell rank 0, which raises the same error at once
    instead of gathering a wrong order or waiting."""
    if world < 2:
        return
    forward = DeviceMesh("cpu", list(range(world)))
    backward = DeviceMesh("cpu", list(reversed(range(world))))
    mesh = forward if rank == 0 else backward
    t = DTensor.from_local(make((2, 3), torch.float32, rank), mesh, [Shard(0)], run_check=False,
                           shape=(2 * world, 3), stride=(3, 1))
    start = time.monotonic()
    _expect_everywhere(shardgather.InvalidArgumentError,
                       lambda: shardgather.full_tensors([t], timeout=T), "rank order")
    assert time.monotonic() - start < 5.0, time.monotonic() - start


CASES = [name for name in dir(sys.modules[__name__]) if name.startswith("case_")]
