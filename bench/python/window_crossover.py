"""Where the node-shared window starts to beat a torch Gloo group's own transport (the crossover
an "auto" plan now finds by measuring; docs/benchmarking.md).

For each size per rank (100 float32 tensors), on one Gloo group of spawned processes: the
group's own all_gather into a preallocated buffer (the limit), a plan over Gloo send/recv
("direct"), and a plan through the window with its header and barriers in the host mailbox
("shared, mailbox") or over Gloo ("shared, over Gloo"). Every plan is first checked byte for
byte against the limit's output. Ratios to the limit, medians.

    PYTHONPATH=build/ci/python .venv/bin/python bench/python/window_crossover.py
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import timed  # noqa: E402  (same turn-taking and GC handling)


def run(rank, world, init_file, sizes, iters):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    import shardgather

    mailbox = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", True, True)
    over_gloo = shardgather._C._process_group_communicator(dist.group.WORLD, "cpu", True, False)
    if rank == 0:
        print("# world %d, torch %s, Gloo on loopback, 100 f32 tensors per rank; x limit" % (
            world, torch.__version__))
        print("# %10s %10s %8s %16s %17s" % ("bytes/rank", "limit(ms)", "direct", "shared, mailbox",
                                             "shared, over Gloo"))
    for per_rank in sizes:
        params = [torch.randn(max(1, per_rank // 400)) for _ in range(100)]
        nbytes = sum(p.numel() * 4 for p in params)
        flat_in = torch.cat(params).view(torch.uint8)
        outs = list(torch.empty(nbytes * world, dtype=torch.uint8).chunk(world))
        direct = shardgather.AllGatherPlan.create(params, mailbox, strategy="direct")
        shared = shardgather.AllGatherPlan.create(params, mailbox, strategy="shared")
        shared_gloo = shardgather.AllGatherPlan.create(params, over_gloo, strategy="shared")
        methods = {
            "limit": lambda: dist.all_gather(outs, flat_in),
            "direct": lambda: direct.execute(params, mailbox),
            "shared, mailbox": lambda: shared.execute(params, mailbox),
            "shared, over Gloo": lambda: shared_gloo.execute(params, over_gloo),
        }
        # First executions create the windows; every plan must match the group's own gather.
        dist.all_gather(outs, flat_in)
        for name, fn in methods.items():
            if name != "limit":
                out = fn()
                for r in range(world):
                    got = torch.cat([out[i][r] for i in range(len(params))]).view(torch.uint8)
                    assert torch.equal(got, outs[r]), (name, per_rank, r)
        r = timed(methods, iters, 3)
        if rank == 0:
            limit = r["limit"][0]
            print("  %10d %10.3f %8.2f %16.2f %17.2f" % (
                nbytes, limit * 1e3, r["direct"][0] / limit, r["shared, mailbox"][0] / limit,
                r["shared, over Gloo"][0] / limit), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[1600, 16000, 131072, 524288, 2097152, 8388608])
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    mp.spawn(run, args=(args.world, tempfile.mktemp(prefix="sg-crossover-"), args.sizes,
                        args.iters), nprocs=args.world)


if __name__ == "__main__":
    main()
