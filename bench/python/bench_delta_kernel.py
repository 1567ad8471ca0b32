"""The delta kernels on one core: _delta_encode, _delta_apply and _delta_checksum over one bucket.

    PYTHONPATH=build/ci/python .venv/bin/python bench/python/bench_delta_kernel.py [--mib 256]

The bucket is a bf16 tensor of --mib MiB of random bits. Each case changes a fraction of its
elements (random positions, or runs of 64 for "clustered") by flipping bits, so every picked
element differs. Times are the median of --iters calls after one warm-up; GB/s is the bucket's
bytes (n * 2) over that time, whatever the record's size. The encode bar: >= 1 GB/s per core at
1% random density (the diff and the record together). encode runs with dense_ratio 0.5.
apply writes the record into a copy of `before` (the same elements each time: it is idempotent)
and includes its read-back checksum.
"""

import argparse
import statistics
import time

import torch

from shardgather import _C

ENCODINGS = {0: "none", 1: "dense", 2: "pairs", 3: "runs"}


def median_seconds(fn, iters):
    fn()  # warm-up: page faults, the encoder's scratch
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def changed_copy(before, density, clustered, g):
    after = before.clone()
    bits = after.view(torch.int16)
    n = bits.numel()
    if clustered:
        run = 64
        starts = torch.randint(0, n // run, (max(1, int(n * density) // run),), generator=g) * run
        idx = (starts[:, None] + torch.arange(run)[None, :]).reshape(-1)
    else:
        idx = torch.nonzero(torch.rand(n, generator=g) < density).reshape(-1)
    bits[idx] ^= torch.randint(1, 1 << 15, idx.shape, generator=g, dtype=torch.int16)
    return after


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bucket size in MiB (bf16)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    n = args.mib * (1 << 20) // 2
    nbytes = n * 2
    before = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=g)
    before = before.view(torch.bfloat16)
    out = torch.empty(_C._delta_max_record_bytes(n, 2), dtype=torch.uint8)
    out.fill_(0)  # touch the pages once
    print("# delta kernels: %d MiB bf16 bucket (%d elements), median of %d, seed %d, one thread"
          % (args.mib, n, args.iters, args.seed))

    t = median_seconds(lambda: _C._delta_checksum(before, 0, n), args.iters)
    print("# checksum  %8.2f GB/s" % (nbytes / t / 1e9))

    print("%-16s %-6s %12s %8s %12s %12s %9s" % ("case", "enc", "record(B)", "ratio",
                                                 "encode GB/s", "apply GB/s", "check"))
    cases = [("random", d) for d in (0.001, 0.01, 0.03, 0.1, 0.3)] + [("clustered", 0.01)]
    for kind, density in cases:
        after = changed_copy(before, density, kind == "clustered", g)
        result = {}

        def encode():
            result["r"] = _C._delta_encode(before, after, out, 7, 0.5)

        t_enc = median_seconds(encode, args.iters)
        record_bytes, encoding, _ = result["r"]
        dst = before.clone()
        record = out[:record_bytes]
        t_apply = median_seconds(lambda: _C._delta_apply(record, dst, 0, n), args.iters)
        _, ok, _, _ = _C._delta_apply(record, dst, 0, n)
        same = torch.equal(dst.view(torch.int16), after.view(torch.int16))
        print("%-16s %-6s %12d %8.4f %12.2f %12.2f %9s"
              % ("%s %g" % (kind, density), ENCODINGS[encoding], record_bytes,
                 record_bytes / nbytes, nbytes / t_enc / 1e9, nbytes / t_apply / 1e9,
                 "ok" if ok and same else "WRONG"))


if __name__ == "__main__":
    main()
