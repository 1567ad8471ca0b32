"""shardgather vs the seed's algorithm vs the group's own all-gather, on one Gloo group.

    PYTHONPATH=build/release/python .venv/bin/python bench/python/bench_torch.py --world 2
    mpirun -np 2 .venv/bin/python bench/python/bench_torch.py      # adds the MPI backend

Per preset and method: barrier (not timed), one call timed, the iteration's time is the max over
ranks; the methods take turns within each iteration, in an order shuffled every iteration, with
the objects from before timing frozen out of the cyclic GC. The table shows medians and the ratio to
the limit, the group's single all-gather of the same total bytes from one contiguous buffer into
a preallocated one.
"""

import argparse
import datetime
import gc
import json
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist


def preset_shapes(name, world):
    """Full shapes, dtype, sharded: llama-layer and single-64m are sharded along dim 0
    torch.chunk-style; tiny-1000 is every rank's own 1000 tensors (the same shapes on all)."""
    if name == "llama-layer":
        h, f = 4096, 11008
        full = [(h, h)] * 4 + [(f, h)] * 2 + [(h, f), (h,), (h,)]
        return full, torch.bfloat16, True
    if name == "tiny-1000":
        g = torch.Generator().manual_seed(20240601)
        return [(int(n),) for n in torch.randint(1, 257, (1000,), generator=g)], torch.float32, False
    if name == "single-64m":
        return [(32 * 1024 * 1024,)], torch.bfloat16, True
    raise ValueError(name)


def shard(shape, rank, world):
    rows = math.ceil(shape[0] / world)
    lo = min(rank * rows, shape[0])
    hi = min(lo + rows, shape[0])
    return (hi - lo,) + tuple(shape[1:])


def as_dtensors(params, full_shapes, world):
    """params as Shard(0) DTensors on a 1-D mesh over the world group, built without
    communication: a sharded preset's full shapes, or (tiny-1000: every rank's own tensors) the
    rank-major concatenation of the ranks' tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for i, p in enumerate(params):
        shape = tuple(full_shapes[i]) if full_shapes else (p.shape[0] * world,) + tuple(p.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        out.append(DTensor.from_local(p, mesh, [Shard(0)], run_check=False, shape=shape,
                                      stride=stride))
    return out


def seed_algorithm(params, world, shapes=None):
    """The seed's algorithm in plain PyTorch: flatten copy-in, one all-gather of the flat buffer,
    split and view (gathering numels and pickled shapes when no hint is given)."""
    numels = [p.numel() for p in params]
    dtype = params[0].dtype
    flat_in = torch.empty(sum(numels), dtype=dtype)
    torch._foreach_copy_(list(torch.split(flat_in, numels)), [p.flatten() for p in params]) if hasattr(
        torch, "_foreach_copy_"
    ) else [d.copy_(p.flatten()) for d, p in zip(torch.split(flat_in, numels), params)]
    if shapes is None:
        counts = torch.tensor(numels, dtype=torch.int64)
        all_counts = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts)
        all_shapes = [None] * world
        dist.all_gather_object(all_shapes, [tuple(p.shape) for p in params])
    else:
        all_shapes = shapes
        all_counts = [torch.tensor([math.prod(s) for s in row]) for row in shapes]
    total = int(sum(int(c.sum()) for c in all_counts))
    flat_out = torch.empty(total, dtype=dtype)
    dist.all_gather_into_tensor(flat_out.view(torch.uint8), flat_in.view(torch.uint8))
    splits = torch.split(flat_out, [int(x) for c in all_counts for x in c])
    n = len(params)
    return [[splits[r * n + i].view(all_shapes[r][i]) for r in range(world)] for i in range(n)]


def timed(methods, iters, warmup):
    """{name: (median, min)} seconds. The methods take turns within every iteration, so a noisy
    phase of a shared machine hits all of them alike and the ratios stay comparable; the order
    is shuffled every iteration (the same on every rank), so no method always runs right after
    a heavy one (the seed's fresh buffers, a one-shot call's 2000 tensors). The objects alive
    before timing (torch's own, the inputs) are frozen out of the cyclic GC: a collection that
    one method's garbage triggers inside another's call then costs that call a pass over the
    young objects, not over the whole interpreter (about 100k objects after importing torch; a
    full pass over them took 32 ms here, against a 1 ms gather)."""
    times = {name: [] for name in methods}
    order = list(methods.items())
    gc.collect()
    gc.freeze()
    for k in range(warmup + iters):
        random.Random(k).shuffle(order)
        for name, fn in order:
            dist.barrier()
            start = time.perf_counter()
            out = fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            del out
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if k >= warmup:
                times[name].append(float(elapsed))
    gc.unfreeze()
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def run(rank, world, args, mpi_comm_factory):
    import shardgather

    rows = []
    for preset in args.presets:
        full, dtype, sharded = preset_shapes(preset, world)
        local = (lambda s, r: shard(s, r, world)) if sharded else (lambda s, r: tuple(s))
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(local(s, rank), generator=g).to(dtype) for s in full]
        hint = [[local(s, r) for s in full] for r in range(world)]
        per_rank_bytes = sum(p.numel() * p.element_size() for p in params)
        iters = args.iters or (5 if per_rank_bytes > (64 << 20) else 20)
        flat_in = torch.empty(per_rank_bytes, dtype=torch.uint8)
        flat_out = torch.empty(per_rank_bytes * world, dtype=torch.uint8)
        outs = list(flat_out.chunk(world))
        # What any call returning new tensors pays on top of the limit: one tensor object per
        # (rank, tensor), made here by splitting the limit's output.
        elsize = params[0].element_size()
        split_sizes = [math.prod(s) * elsize for r in range(world) for s in hint[r]]
        # Plans: built once, executed every iteration into the plan's reused buffer (the views
        # and result lists are cached too). "auto" is what a caller gets: on one host at >= 1 MiB
        # per rank it gathers through the node-shared window (the group carries only the
        # pre-flight and barriers). "direct" moves the bytes over the group itself: Gloo
        # send/recv straight into place, or, on the "allgather path" communicator, the group's
        # allgather (padded, staged, Gloo's own flat copy).
        plan = shardgather.AllGatherPlan.create(params, None, hint)
        direct = shardgather.AllGatherPlan.create(params, None, hint, strategy="direct")
        direct_nopf = shardgather.AllGatherPlan.create(params, None, hint, strategy="direct",
                                                       preflight=False)
        allgather_comm = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", False)
        # The pre-flight header over the group itself (what a group spanning hosts gets) rather
        # than through the host mailbox the default communicator uses on one host.
        no_mailbox_comm = shardgather._C._process_group_communicator(
            dist.group.WORLD, "cpu", True, False)
        plan.execute(params)
        dtensors = as_dtensors(params, full if sharded else None, world)
        methods = {
            "limit (group all_gather, prealloc)": lambda: dist.all_gather_into_tensor(flat_out,
                                                                                      flat_in),
            "limit + split into new tensors": lambda: (dist.all_gather_into_tensor(flat_out,
                                                                                   flat_in),
                                                      flat_out.split(split_sizes)),
            "group all_gather (list of outputs)": lambda: dist.all_gather(outs, flat_in),
            "plan auto (%s)" % plan.last_stats["strategy"]: lambda: plan.execute(params),
            "plan direct (Gloo send/recv)": lambda: direct.execute(params),
            "plan direct, preflight off": lambda: direct_nopf.execute(params),
            "plan direct, header over Gloo": lambda: direct.execute(params, no_mailbox_comm),
            "plan direct, group allgather": lambda: direct.execute(params, allgather_comm),
            "shardgather (hint)": lambda: shardgather.foreach_all_gather(params, None, hint),
            "shardgather (no hint)": lambda: shardgather.foreach_all_gather(params),
            "shardgather (hint, preflight off)": lambda: shardgather.foreach_all_gather(
                params, None, hint, preflight=False
            ),
            "seed algorithm (shapes)": lambda: seed_algorithm(params, world, hint),
            "seed algorithm (no shapes)": lambda: seed_algorithm(params, world),
        }
        # DTensors (Shard(0) on a 1-D mesh of the group): one full_tensors call against one
        # full_tensor() per tensor, what a caller without shardgather writes.
        methods["full_tensors (DTensor list, one call)"] = lambda: shardgather.full_tensors(dtensors)
        methods["full_tensor() loop (DTensor)"] = lambda: [t.full_tensor() for t in dtensors]
        if mpi_comm_factory is not None:
            comm = mpi_comm_factory()
            mpi_plan = shardgather.AllGatherPlan.create(params, comm, hint)
            mpi_plan.execute(params, comm)
            methods["plan auto (%s), MPI backend" % mpi_plan.last_stats["strategy"]] = (
                lambda: mpi_plan.execute(params, comm)
            )
            methods["shardgather MPI backend (hint)"] = lambda: shardgather.foreach_all_gather(
                params, comm, hint
            )
        if args.methods:
            methods = {k: v for k, v in methods.items()
                       if k.startswith("limit") or any(m in k for m in args.methods)}
        # Correctness first: every shardgather method must equal the seed's algorithm bit for
        # bit (each result is checked before the next call can overwrite a plan's buffer).
        b, out = seed_algorithm(params, world, hint), None
        for x, y in zip(shardgather.full_tensors(dtensors), [t.full_tensor() for t in dtensors]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "full_tensors"
        for name, fn in methods.items():
            if name.startswith(("limit", "seed", "group", "full_tensor")):
                continue
            out = fn()
            assert len(out) == len(b), name
            for x, y in zip(out, b):
                assert len(x) == len(y) == world, name
                for u, v in zip(x, y):
                    assert torch.equal(u.view(torch.uint8), v.view(torch.uint8)), name
        del b, out
        results = timed(methods, iters, 1)
        limit = results["limit (group all_gather, prealloc)"][0]
        for name, (med, best) in results.items():
            rows.append(
                {
                    "preset": preset,
                    "method": name,
                    "tensors": len(params),
                    "bytes_per_rank": per_rank_bytes,
                    "median_ms": med * 1e3,
                    "min_ms": best * 1e3,
                    "ratio_to_limit": med / limit,
                    "iters": iters,
                }
            )
    if rank == 0:
        print("# shardgather Python benchmark: world %d, torch %s, Gloo on loopback" % (world, torch.__version__))
        print("# %-12s %-38s %8s %12s %11s %11s %8s" % ("preset", "method", "tensors", "bytes/rank", "median(ms)", "min(ms)", "x limit"))
        for r in rows:
            print("  %-12s %-38s %8d %12d %11.2f %11.2f %8.2f" % (r["preset"], r["method"], r["tensors"], r["bytes_per_rank"], r["median_ms"], r["min_ms"], r["ratio_to_limit"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"schema_version": 1, "world": world, "torch": torch.__version__, "rows": rows}, f, indent=1)
    # Every rank leaves together and the group is torn down before the interpreter: a fast
    # rank's exit may otherwise close the connection under a peer still in its last collective.
    dist.barrier()
    dist.destroy_process_group()


def spawned(rank, world, args, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    run(rank, world, args, None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--presets", nargs="+", default=["llama-layer", "tiny-1000", "single-64m"])
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--json", default="")
    parser.add_argument("--methods", nargs="*", default=[],
                        help="only the methods whose name contains one of these (and the limit)")
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "OMPI_COMM_WORLD_SIZE" in os.environ:  # under mpirun: Gloo and MPI in the same run
        from mpi4py import MPI

        import shardgather

        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % args.port, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        run(rank, world, args, lambda: shardgather.mpi_communicator(MPI.COMM_WORLD))
        return
    import tempfile

    import torch.multiprocessing as mp

    init_file = tempfile.mktemp(prefix="sg-bench-")
    mp.spawn(spawned, args=(args.world, args, init_file), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
