"""What a whole-model stream keeps in memory after it ran: the process's resident memory after
``--runs`` runs of ``unshard_stream`` over ``--params`` bf16 ``--dim`` x ``--dim`` parameters,
row-sharded over ``--world`` ranks on the threads backend (every rank in this process), less the
resident memory before the streams were built. Plain and quantized (``--quantize``), so that
the quantized stream's extra memory is its FP8 staging: one bucket's share of this rank's
shards since its buckets take turns with one (docs/quantization.md), the whole of them before.
Also prints the median time of a run after the first (rank 0's), as a check that sharing the
staging costs nothing.

    PYTHONPATH=build/ci/python .venv/bin/python bench/python/bench_stream_memory.py
"""

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch

import shardgather


def resident_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held_after_runs(args, quantize):
    """(MiB resident after the runs, more than before the streams were built; rank 0's median
    seconds per run after the first)."""
    dim, world = args.dim, args.world
    group = shardgather.ThreadGroup(world)
    shards = [[torch.randn(dim // world, dim).to(torch.bfloat16) for _ in range(args.params)]
              for _ in range(world)]
    specs = [shardgather.ShardSpec(torch.bfloat16, (dim, dim), 0) for _ in range(args.params)]
    streams, errors, seconds = [None] * world, [], []
    before = resident_mib()

    def rank(r):
        try:
            streams[r] = shardgather.unshard_stream(
                shards[r], specs, group[r], bucket_bytes=args.bucket_mib << 20, quantize=quantize)
            for _ in range(args.runs):
                t0 = time.perf_counter()
                for _bucket in streams[r]:
                    pass
                if r == 0:
                    seconds.append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: B902 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return resident_mib() - before, statistics.median(seconds[1:] or seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=int, default=64)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--bucket-mib", type=int, default=4)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--quantize", default="fp8_e4m3_128x128")
    parser.add_argument("--one", choices=("plain", "quantized"),
                        help="measure this one only (each is measured in a process of its own)")
    args = parser.parse_args()
    if args.one:
        held, run = held_after_runs(args, args.quantize if args.one == "quantized" else None)
        print("%-18s resident after %d runs: +%.1f MiB; a run after the first: %.1f ms"
              % ("plain" if args.one == "plain" else args.quantize, args.runs, held, run * 1e3))
        return
    fp8 = args.params * args.dim * args.dim / 2**20
    print("the ranks' shards together, in FP8: %.1f MiB" % fp8)
    for one in ("plain", "quantized"):
        subprocess.run([sys.executable] + sys.argv + ["--one", one], check=True)


if __name__ == "__main__":
    main()
