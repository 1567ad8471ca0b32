"""Weight sync by deltas against the anchors' method (issue 27's bars).

    tools/netns-mpirun --hosts 8 --per-host 1 --rate 1gbit -- \\
        .venv/bin/python bench/python/bench_weight_sync.py            # 4 sources, TP 2 x 2
    ... bench_weight_sync.py --crossover                             # where dense wins
    .venv/bin/python bench/python/bench_weight_sync.py --kernel     # diff + encode, one core
    .venv/bin/python bench/python/bench_weight_sync.py --per-bucket # one rank, small buckets

(PYTHONPATH=build/ci/python in each.) Ranks 0-3 are the trainer (FSDP rows of every tensor),
ranks 4-7 the engine: two replicas of TP 2 (a column split of each tensor). The model: a stack
of Qwen3-8B-shaped projections (``--layers``), bf16. Each iteration is one RL step: the trainer
changes ``--density`` of each tensor's elements at random (the same step on every rank, so
that each destination can check what it holds), then both methods sync it, in turns:

  delta   shardgather.weight_sync.WeightSync (--mode staged, the default, or in_place): each
          source diffs its own shard with its snapshot, sends each destination the records of
          its boxes only;
  anchor  what verl / slime / NeMo-RL do, written over the same transport (the library's
          messages between ranks, round_call.h): each source diffs its shard with a snapshot and sends
          its sparse delta (int32 flat index + value, per tensor) to rank 0, which concatenates
          them and sends the whole delta to every destination; each destination applies the
          entries that fall in its boxes.

Both are checked bit for bit every iteration. Per iteration, the max over ranks of: the
transfer (the exchange of the delta's bytes alone, timed from a sync point of every rank, so
that a rank waiting for a slower encoder is not counted) and end to end (from the step's tensors to
the destinations holding them, diff and apply included). Prints medians, the ratios the bars
name (anchor / delta: transfer >= 1.5, end to end >= 2), and each destination's bytes received
against its changed bytes + index overhead (<= 1.1).
"""

import argparse
import json
import statistics
import time

import torch

import shardgather as sg
from shardgather.layouts import Box, TensorLayout
from shardgather.weight_sync import WeightSync

SOURCES, TP, REPLICAS = 4, 2, 2


def model(layers):
    h, kv, f = 4096, 8 * 128, 12288
    one = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    return [s for _ in range(layers) for s in one]


def split(n, parts):
    base, extra = divmod(n, parts)
    out, at = [], 0
    for p in range(parts):
        out.append((at, base + (p < extra)))
        at += base + (p < extra)
    return out


def layouts(shapes):
    out = []
    for shape in shapes:
        srcs = [(r, Box((o, 0), (n, shape[1]))) for r, (o, n) in
                enumerate(split(shape[0], SOURCES))]
        dsts = []
        for g in range(REPLICAS):
            for k, (o, n) in enumerate(split(shape[1], TP)):
                dsts.append((SOURCES + g * TP + k, Box((0, o), (shape[0], n))))
        out.append(TensorLayout(shape, torch.bfloat16, srcs, dsts))
    return out


def box_index(box):
    return tuple(slice(o, o + n) for o, n in zip(*box))


class Anchor:
    """Diff, gather the sparse delta to rank 0, send it whole to every destination."""

    def __init__(self, comm, lays, shards, wanted):
        self.comm, self.lays = comm, lays
        # receive buffers of the gather to rank 0 and of its sends, reused as the delta's
        self.recv = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self.snap = [s.clone() for _, s in shards]
        self.shards = shards  # [(tensor, view)] of this rank
        self.wanted = wanted  # [(tensor, box, tensor)] of this rank
        self.seconds = 0.0

    def sync(self):
        rank, world = self.comm.rank, self.comm.size
        parts = []
        for (t, view), snap in zip(self.shards, self.snap):
            changed = (view.view(torch.int16) != snap.view(torch.int16)).view(-1)
            at = changed.nonzero().view(-1)
            row0 = self.lays[t].sources[rank][1][0][0]
            flat = (at + row0 * view.shape[1]).to(torch.int32)
            vals = view.reshape(-1)[at]
            snap.view(-1)[at] = vals
            head = torch.tensor([t, at.numel()], dtype=torch.int32)
            pad = torch.zeros(2 * (at.numel() % 2), dtype=torch.uint8)  # 4-byte alignment
            parts += [head.view(torch.uint8), flat.view(torch.uint8), vals.view(torch.uint8), pad]
        mine = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        # one call of rounds, as a sync is; its opening is the sync point every rank is ready
        # at, as the delta's settle round
        call = sg._C._RoundCall(self.comm, "WeightSync::sync", "anchor", 120.0, 1)
        call.open("ready")
        t0 = time.perf_counter()
        got, _, self.recv[0] = call.messages({0: mine} if parts else {}, "gather", self.recv[0])
        if rank == 0:
            whole = torch.cat([got[s] for s in sorted(got)])
            out = {d: whole for d in range(SOURCES, world)}
        else:
            out = {}
        got, _, self.recv[1] = call.messages(out, "send", self.recv[1])
        self.seconds = time.perf_counter() - t0
        if rank >= SOURCES:
            self.apply(got[0])

    def apply(self, msg):
        at = 0
        by_tensor = {}
        for t, box, dst in self.wanted:
            by_tensor.setdefault(t, []).append((box, dst))
        while at < msg.numel():
            t, n = msg[at:at + 8].view(torch.int32).tolist()
            at += 8
            flat = msg[at:at + 4 * n].view(torch.int32).long()
            at += 4 * n
            vals = msg[at:at + 2 * n].view(torch.bfloat16)
            at += 2 * n + 2 * (n % 2)
            cols = self.lays[t].shape[1]
            rows, col = flat // cols, flat % cols
            for (off, size), dst in by_tensor.get(t, []):
                keep = (col >= off[1]) & (col < off[1] + size[1])
                dst[rows[keep], col[keep] - off[1]] = vals[keep]


def run(args):
    sg.mpi_init()
    comm = sg.mpi_communicator()
    rank, world = comm.rank, comm.size
    assert world == SOURCES + TP * REPLICAS, "needs %d ranks" % (SOURCES + TP * REPLICAS)
    shapes = model(args.layers)
    lays = layouts(shapes)
    probe = sg.ReshardPlan(lays, world, rank)
    engine = [torch.empty(n, dtype=torch.bfloat16) for _, _, n in probe.destination_boxes]
    ws = WeightSync(lays, comm, timeout=300.0, dense_ratio=args.dense_ratio, mode=args.mode,
                    destinations=engine if args.mode == "in_place" else None)
    ws._settle = True  # the transfer is timed from a sync point, as the anchor's
    g = torch.Generator().manual_seed(1)
    full = [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in shapes]
    shards = [(t, full[t][box_index((o, n))]) for t, o, n in ws.source_boxes]
    wanted = [(t, (o, n), torch.empty(n, dtype=torch.bfloat16)) for t, o, n in
              ws.destination_boxes]
    for (t, box, dst) in wanted:
        dst.copy_(full[t][box_index(box)])
    anchor = Anchor(comm, lays, shards, wanted)
    ws.sync(0, [v for _, v in shards])
    rows = {"delta": [], "anchor": [], "delta_x": [], "anchor_x": []}
    ratio = []
    for it in range(1, args.iters + 1):
        gen = torch.Generator().manual_seed(100 + it)
        for t in full:
            flat = t.view(-1)
            n = int(flat.numel() * args.density)
            at = torch.randint(flat.numel(), (n,), generator=gen)
            flat[at] = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
        order = ["delta", "anchor"] if it % 2 else ["anchor", "delta"]
        for method in order:
            comm.barrier()
            t0 = time.perf_counter()
            if method == "delta":
                stats = ws.sync(it, [v for _, v in shards])
                xfer = stats["exchange_seconds"]
            else:
                anchor.sync()
                xfer = anchor.seconds
            took = time.perf_counter() - t0
            rows[method].append(took)
            rows[method + "_x"].append(xfer)
        if rank >= SOURCES:
            with ws.read() as (_, tensors):
                for (t, box, dst), mine in zip(wanted, tensors):
                    want = full[t][box_index(box)]
                    assert torch.equal(mine.view(torch.int16), want.view(torch.int16))
                    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
            changed = stats["changed_received"]
            ideal = changed * (2 + 4)  # value + a 4-byte index per changed element
            ratio.append(stats["bytes_received"] / max(1, ideal))
        if args.verbose and rank in (0, SOURCES):
            print(rank, {k: round(v, 4) for k, v in stats.items() if k.endswith("seconds")},
                  flush=True)
    report(comm, rows, ratio, args)


def report(comm, rows, ratio, args):
    """Max over ranks per iteration (one round of rows), medians."""
    keys = ["delta", "anchor", "delta_x", "anchor_x"]
    n = len(rows["delta"])
    mine = torch.tensor([v for k in keys for v in rows[k]] + [max(ratio) if ratio else 0.0],
                        dtype=torch.float64).view(torch.int64)
    call = sg._C._RoundCall(comm, "WeightSync::sync", "report", 120.0, mine.numel())
    call.open("report")
    table = call.rows(mine, "report")[:, :mine.numel()].contiguous().view(torch.float64)
    if comm.rank:
        return
    worst = table.max(dim=0).values
    med = {k: statistics.median(worst[i * n:(i + 1) * n].tolist()) for i, k in enumerate(keys)}
    out = {"density": args.density, "layers": args.layers, "iters": n, "mode": args.mode,
           "medians_s": med,
           "transfer_anchor_over_delta": med["anchor_x"] / med["delta_x"],
           "end_to_end_anchor_over_delta": med["anchor"] / med["delta"],
           "worst_bytes_over_changed_plus_index": float(worst[-1])}
    print(json.dumps(out, indent=1))


def kernel(args):
    """Diff + encode on one core: a 256 MiB bf16 buffer against its snapshot, random changes
    at each density, in buckets of 1 MiB as the sync encodes them; GB/s of the shard's bytes."""
    from shardgather import _shardgather as C

    n = 128 << 20
    before = (torch.randn(n) * 0.02).to(torch.bfloat16)
    bucket = (1 << 20) // 2
    out = torch.empty(C._delta_max_record_bytes(bucket, 2), dtype=torch.uint8)
    for density in (0.001, 0.01, 0.03, 0.1, 0.3):
        after = before.clone()
        k = int(n * density)
        after[torch.randint(n, (k,))] = 1.0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for at in range(0, n, bucket):
                C._delta_encode(before[at:at + bucket], after[at:at + bucket], out, 0,
                                args.dense_ratio)
            times.append(time.perf_counter() - t0)
        print("density %.3f: diff + encode %.2f GB/s" % (density,
                                                          2 * n / statistics.median(times) / 1e9))


def per_bucket(args):
    """One rank, source and destination of a 64 MiB bf16 tensor (the threads backend): median
    seconds of a steady-state sync at ``--density``, in buckets of 4 KiB (16k of them) and of
    1 MiB. What a bucket costs beyond its bytes shows as the difference."""
    shape = (4096, 8192)
    box = (0, Box((0, 0), shape))
    lays = [TensorLayout(shape, torch.bfloat16, [box], [box])]
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    comm = sg.ThreadGroup(1)[0]
    for chunk in (4 << 10, 1 << 20):
        ws = WeightSync(lays, comm, chunk_bytes=chunk, timeout=120.0,
                        dense_ratio=args.dense_ratio)
        ws.sync(0, [full])
        times, stats = [], []
        for version in range(1, args.iters + 1):
            at = torch.randint(full.numel(), (int(full.numel() * args.density),), generator=g)
            full.view(-1)[at] = torch.randn(at.numel(), generator=g).to(torch.bfloat16)
            began = time.perf_counter()
            stats.append(ws.sync(version, [full]))
            times.append(time.perf_counter() - began)
        print("chunk_bytes %7d: sync %.4f s (encode %.4f s, apply %.4f s; medians of %d)" % (
            chunk, statistics.median(times),
            statistics.median(st["encode_seconds"] for st in stats),
            statistics.median(st["apply_seconds"] for st in stats), args.iters))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dense-ratio", type=float, default=None)
    p.add_argument("--mode", choices=["staged", "in_place"], default="staged")
    p.add_argument("--kernel", action="store_true")
    p.add_argument("--per-bucket", action="store_true")
    p.add_argument("--verbose", action="store_true", help="per-phase seconds of ranks 0, 4")
    args = p.parse_args()
    if args.dense_ratio is None:
        from shardgather.weight_sync import DENSE_RATIO
        args.dense_ratio = DENSE_RATIO
    if args.kernel:
        kernel(args)
    elif args.per_bucket:
        per_bucket(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
