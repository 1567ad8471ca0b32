"""Per-call cost on one device: shardgather's one-shot gather and plan against the seed's method.

    PYTHONPATH=build/device/python python bench/python/bench_device_call.py --backend nccl --world 1
    PYTHONPATH=build/device/python python bench/python/bench_device_call.py --backend gloo --world 2
    PYTHONPATH=build/ci/python .venv/bin/python bench/python/bench_device_call.py --device cpu \\
        --backend gloo --world 2 --iters 3 --presets tiny-1000          # the plumbing, on a CPU

Every rank's tensors are on the same device (cuda:0: NCCL refuses two ranks on one GPU, so NCCL
runs at world 1 and Gloo at world 2). Methods, each checked bit for bit against the seed's first:
  seed      copy-in to one flat buffer, all_gather_into_tensor, split and view (shapes known);
  one-shot  shardgather.foreach_all_gather with the shapes hint;
  plan      AllGatherPlan.execute (built once, its output buffer reused).
Per call: a barrier and a device sync (not timed), then `host` = until the call returns (what the
CPU pays: for a stream-ordered call, the enqueue) and `total` = until the device has finished
too; each iteration takes the max over ranks, and the methods take turns in a shuffled order.
With --bars (tools/device-check): the one-shot gather and the plan >= 3x faster than the seed on
tiny-1000 and >= 1.0x on llama-layer (total, medians), and on NCCL the plan's host time <= 50 us
(Gloo runs its collective on the host, so there the host waits for it).
"""

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import preset_shapes, shard  # noqa: E402  (the presets every bench shares)

BARS = {"tiny-1000": 3.0, "llama-layer": 1.0}
HOST_BAR_US = 50.0


def seed_method(params, hint):
    """The seed's algorithm with the shapes known: flat copy-in, one all-gather, split, view."""
    numels = [p.numel() for p in params]
    flat_in = torch.empty(sum(numels), dtype=params[0].dtype, device=params[0].device)
    torch._foreach_copy_(list(torch.split(flat_in, numels)), [p.reshape(-1) for p in params])
    world = len(hint)
    widest = max(sum(math.prod(s) for s in row) for row in hint)
    if widest != sum(numels):
        raise ValueError("the seed's method needs every rank to hold as many elements")
    flat_out = torch.empty(widest * world, dtype=flat_in.dtype, device=flat_in.device)
    dist.all_gather_into_tensor(flat_out, flat_in)
    splits = torch.split(flat_out, [math.prod(s) for row in hint for s in row])
    n = len(params)
    return [[splits[r * n + i].view(hint[r][i]) for r in range(world)] for i in range(n)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device if dist.get_backend() == "nccl"
                     else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(methods, iters, device):
    """{name: {"host": [...], "total": [...]}} in seconds, max over ranks per iteration."""
    times = {name: {"host": [], "total": []} for name in methods}
    order = list(methods.items())
    for k in range(1 + iters):  # the first round warms up
        random.Random(k).shuffle(order)
        for name, fn in order:
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            out = fn()
            host = time.perf_counter() - start
            sync(device)
            total = time.perf_counter() - start
            del out
            host, total = max_over_ranks([host, total], device)
            if k > 0:
                times[name]["host"].append(host)
                times[name]["total"].append(total)
    return times


def check_same(name, got, want):
    assert len(got) == len(want), name
    for x, y in zip(got, want):
        for u, v in zip(x, y):
            assert torch.equal(u.view(torch.uint8), v.view(torch.uint8)), name


def run_preset(preset, rank, world, device, iters):
    import shardgather

    full, dtype, sharded = preset_shapes(preset, world)
    # Every rank holds as many elements (the seed's all-gather needs it): dim-0 shards of sizes
    # that divide evenly, or tiny-1000's same shapes on every rank.
    local = (lambda s: shard(s, rank, world)) if sharded else tuple
    g = torch.Generator().manual_seed(rank)
    params = [torch.randn(local(s), generator=g).to(dtype).to(device) for s in full]
    hint = [[shard(s, r, world) if sharded else tuple(s) for s in full] for r in range(world)]
    plan = shardgather.AllGatherPlan.create(params, None, hint)
    methods = {
        "seed": lambda: seed_method(params, hint),
        "one-shot": lambda: shardgather.foreach_all_gather(params, None, hint),
        "plan": lambda: plan.execute(params),
    }
    want = seed_method(params, hint)
    for name in ("one-shot", "plan"):
        got = methods[name]()
        sync(device)
        check_same(name, got, want)
    del want
    per_rank = sum(p.numel() * p.element_size() for p in params)
    times = timed(methods, iters or (5 if per_rank > (64 << 20) else 30), device)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    row = {"preset": preset, "tensors": len(params), "bytes_per_rank": per_rank,
           "iters": len(times["seed"]["total"])}
    for name, m in med.items():
        row[name + "_total_ms"] = m["total"] * 1e3
        row[name + "_host_us"] = m["host"] * 1e6
    row["one_shot_speedup"] = med["seed"]["total"] / med["one-shot"]["total"]
    row["plan_speedup"] = med["seed"]["total"] / med["plan"]["total"]
    return row


def bars_missed(row, backend):
    missed = []
    need = BARS.get(row["preset"])
    for key in ("one_shot_speedup", "plan_speedup"):
        if need is not None and row[key] < need:
            missed.append("%s %.2fx < %.1fx" % (key, row[key], need))
    # Gloo runs a collective of CUDA tensors on the host (it stages them), so only a device
    # transport's call can return at enqueue: the host bar is NCCL's.
    if backend == "nccl" and row["plan_host_us"] > HOST_BAR_US:
        missed.append("plan host %.1f us > %.0f us" % (row["plan_host_us"], HOST_BAR_US))
    return missed


def worker(rank, world, args, init_file):
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    rows = [run_preset(p, rank, world, device, args.iters) for p in args.presets]
    if rank == 0:
        missed = 0
        for row in rows:
            row.update(backend=args.backend, world=world, device=str(device),
                       torch=torch.__version__)
            bad = bars_missed(row, args.backend) if args.bars else []
            missed += len(bad)
            print("%-12s %s world %d: seed %.3f ms | one-shot %.3f ms (%.2fx), host %.0f us | "
                  "plan %.3f ms (%.2fx), host %.0f us%s" % (
                      row["preset"], args.backend, world, row["seed_total_ms"],
                      row["one-shot_total_ms"], row["one_shot_speedup"], row["one-shot_host_us"],
                      row["plan_total_ms"], row["plan_speedup"], row["plan_host_us"],
                      ("  [bars MISSED: %s]" % "; ".join(bad)) if bad else
                      ("  [bars met]" if args.bars else "")))
        if args.json:
            with open(args.json, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        if missed:
            print("bars missed: %d" % missed)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and args.bars and any(bars_missed(r, args.backend) for r in rows):
        sys.exit(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--presets", nargs="+", default=["tiny-1000", "llama-layer"])
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--json", default="", help="append one JSON object per preset")
    parser.add_argument("--bars", action="store_true", help="exit 1 when a bar is missed")
    args = parser.parse_args()
    if args.backend == "nccl" and (args.device != "cuda" or args.world != 1):
        parser.error("NCCL runs here at world 1 on cuda (two ranks cannot share one GPU)")
    torch.set_num_threads(1)
    import torch.multiprocessing as mp

    init_file = tempfile.mktemp(prefix="sg-devcall-")
    mp.spawn(worker, args=(args.world, args, init_file), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
