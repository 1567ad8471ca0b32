"""Whole-model streaming unshard and safetensors export, against xtuner's bucketed method.

Gloo (spawned ranks):   .venv/bin/python bench/python/bench_export.py --backend gloo --world 2
MPI (under mpirun):     mpirun -np 2 .venv/bin/python bench/python/bench_export.py --backend mpi

The model is Llama-2-7B-shaped in its structure (32 layers of q/k/v/o, gate/up/down, two norms;
embeddings and lm_head) at hidden 2880 / ffn 7744, so that it is about 6.8 GB in bf16 and two
ranks' shards plus the buckets fit this 24 GiB machine. Every parameter is sharded torch.chunk
style along dim 0 on every rank (as xtuner's method needs).

Cases, each on warm shards, one after another on the same group, the whole list --repeat times
(the first pass also pays this VM's first touch of fresh memory: the table shows medians):
  limit       the backend's own equal-size all-gather (Gloo: all_gather_into_tensor; MPI:
              MPI_Allgather) of the same bytes, one bucket at a time into one reused buffer
  transport   unshard_stream, prefetch 0, nothing done with a bucket: the gathers alone, serial
  stream      unshard_stream, prefetch 1, nothing done with a bucket (weight sync to nowhere)
              (both: one stream object per bucket size, run again every pass, so its buffers
              are warm after the first pass, as in a weight sync every step)
  export      save_safetensors to dst 0 in --out (a tmpfs: the point is the gather), prefetch 1,
              of a stream kept across passes like the others (fresh files every pass)
  export_p0   the same with prefetch 0: the disk writes not overlapped with the gathers
  export_writers  save_safetensors(..., writers=--writers): each file to one writer rank by a
              reshard, written by it (the same files, byte for byte)
  xtuner      xtuner's method: pad every shard to ceil(dim0 / world) rows, one foreach per
              --xtuner-bucket-mib of padded bytes (Gloo: xtuner's own, the seed's algorithm; MPI:
              shardgather's), torch.cat per parameter, trim, serial
For each: the median total time (of the slowest rank, over the passes), the per-bucket median,
and the largest peak extra RSS of each rank (VmHWM after the case
minus VmRSS before it; the peak is reset through /proc/self/clear_refs before each case).
Prints a table and writes one JSON record per (case, bucket size) to --json.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# Before torch allocates: large tensors on huge pages, so that making 3+ GB of shards per rank
# does not cost a minute of first-touch page faults on this machine.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_torch's seed_algorithm
MIB = 1 << 20


def model_specs(layers, hidden, ffn, vocab):
    """(name, full shape, dtype) in state-dict order."""
    out = [("model.embed_tokens.weight", (vocab, hidden), torch.bfloat16)]
    for i in range(layers):
        p = "model.layers.%d." % i
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + "self_attn.%s.weight" % proj, (hidden, hidden), torch.bfloat16))
        out.append((p + "mlp.gate_proj.weight", (ffn, hidden), torch.bfloat16))
        out.append((p + "mlp.up_proj.weight", (ffn, hidden), torch.bfloat16))
        out.append((p + "mlp.down_proj.weight", (hidden, ffn), torch.bfloat16))
        out.append((p + "input_layernorm.weight", (hidden,), torch.bfloat16))
        out.append((p + "post_attention_layernorm.weight", (hidden,), torch.bfloat16))
    out.append(("model.norm.weight", (hidden,), torch.bfloat16))
    out.append(("lm_head.weight", (vocab, hidden), torch.bfloat16))
    return out


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measured(barrier, fn):
    """(seconds, peak extra RSS in bytes, per-bucket seconds) of fn() on this rank."""
    barrier()
    before = status_kib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    buckets = fn()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM") - before
    barrier()
    return seconds, peak * 1024, buckets


def run_stream(sg, state, specs, group, bucket, prefetch, streams):
    """One whole stream, the buckets consumed by nothing. The stream object is kept and run
    again on the next pass (as a weight sync every step would): warm buffers."""
    key = (bucket, prefetch)
    if key not in streams:
        streams[key] = sg.unshard_stream(state, specs, group, bucket_bytes=bucket,
                                         prefetch=prefetch, timeout=600)
    s = streams[key]
    times, t = [], time.perf_counter()
    with s:
        for _ in s:
            now = time.perf_counter()
            times.append(now - t)
            t = now
    return times


def run_export(sg, state, specs, group, bucket, prefetch, out, rank, streams, writers=1):
    """save_safetensors of a stream kept across passes (warm buckets), into a fresh directory,
    by one writer (dst) or ``writers`` ranks."""
    from shardgather.export import save_safetensors

    key = ("export", bucket, prefetch)
    if key not in streams:
        streams[key] = sg.unshard_stream(state, specs, group, bucket_bytes=bucket,
                                         prefetch=prefetch, dst=0, timeout=600)
    target = os.path.join(out, "export-%d" % os.getpid()) if rank == 0 else out
    try:
        save_safetensors(streams[key], target, dst=0, progress=False, writers=writers)
    finally:
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
    return []


_LIMIT_BUFFERS = {}


def run_limit(backend, total, bucket, world):
    """The same bytes through the backend's own all-gather, bucket by bucket, into one buffer
    (kept across passes, as the streams' are)."""
    per_rank = bucket // world
    if bucket not in _LIMIT_BUFFERS:
        _LIMIT_BUFFERS[bucket] = (torch.ones(per_rank, dtype=torch.uint8),
                                  torch.empty(per_rank * world, dtype=torch.uint8))
    send, recv = _LIMIT_BUFFERS[bucket]
    rounds = -(-total // per_rank)
    times, t = [], time.perf_counter()
    for _ in range(rounds):
        if backend == "mpi":
            from mpi4py import MPI

            MPI.COMM_WORLD.Allgather(send.numpy(), recv.numpy())
        else:
            dist.all_gather_into_tensor(recv, send)
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def run_xtuner(sg, named, state, group, world, bucket, backend):
    """Pad to ceil(dim0 / world), one foreach per bucket of padded bytes, cat, trim, serial. The
    foreach is xtuner's own (the seed's algorithm, bench_torch.seed_algorithm) on Gloo; on MPI,
    which has no torch group, shardgather's foreach_all_gather on the same communicator."""
    from bench_torch import seed_algorithm

    times, t = [], time.perf_counter()
    names = list(state)
    k = 0
    while k < len(names):
        chunk, used = [], 0
        while k < len(names):
            shape, dtype = named[names[k]]
            rows = -(-shape[0] // world)
            padded = rows * world * (shape[1] if len(shape) > 1 else 1) * dtype.itemsize
            if chunk and used + padded > bucket:
                break
            chunk.append(names[k])
            used += padded
            k += 1
        padded = []
        for n in chunk:
            shape, _ = named[n]
            rows = -(-shape[0] // world)
            local = state[n]
            if local.shape[0] < rows:
                local = torch.cat([local, local.new_zeros((rows - local.shape[0],) + shape[1:])])
            padded.append(local)
        if backend == "mpi":
            gathered = sg.foreach_all_gather(padded, group, timeout=600)
        else:
            gathered = seed_algorithm(padded, world)
        full = [torch.cat(per_rank)[:named[n][0][0]] for n, per_rank in zip(chunk, gathered)]
        del gathered, padded, full
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def body(rank, world, args, group, barrier):
    import shardgather as sg

    named_list = model_specs(args.layers, args.hidden, args.ffn, args.vocab)
    named = {n: (shape, dt) for n, shape, dt in named_list}
    specs = {n: sg.ShardSpec(dt, shape, 0) for n, shape, dt in named_list}
    state = {}
    for n, shape, dt in named_list:
        rows = sg.chunk_sizes(shape[0], world)[rank]
        state[n] = torch.full((rows,) + tuple(shape[1:]), float(rank + 1), dtype=dt)
    total = sum(s.numel() * s.element_size() for s in state.values())
    full_bytes = sum(torch.Size(shape).numel() * dt.itemsize for _, shape, dt in named_list)
    if rank == 0:
        print("# %d parameters, %.2f GB full, %.2f GB of shards on rank 0, backend %s, world %d"
              % (len(named_list), full_bytes / 1e9, total / 1e9, args.backend, world), flush=True)
    streams = {}  # (bucket, prefetch) -> the stream that pass after pass reruns
    # Phases, each run --repeat times in turn and then let go of what it keeps (the streams, the
    # limit's buffers), so that two ranks' shards, the kept buffers and the exported files in
    # the tmpfs never need more than this machine's memory at once.
    phases = []
    for bucket_mib in args.bucket_mib:
        bucket = bucket_mib * MIB
        # Default arguments bind this bucket size now: the cases run after the loop.
        phases.append([
            ("limit", bucket_mib, lambda b=bucket: run_limit(args.backend, total, b, world)),
            ("transport", bucket_mib,
             lambda b=bucket: run_stream(sg, state, specs, group, b, 0, streams)),
            ("stream", bucket_mib,
             lambda b=bucket: run_stream(sg, state, specs, group, b, 1, streams))])
    phases.append([])
    for bucket_mib in args.bucket_mib:
        bucket = bucket_mib * MIB
        phases[-1] += [
            ("export", bucket_mib,
             lambda b=bucket: run_export(sg, state, specs, group, b, 1, args.out, rank, streams)),
            ("export_p0", bucket_mib,
             lambda b=bucket: run_export(sg, state, specs, group, b, 0, args.out, rank,
                                         streams)),
            ("export_writers", bucket_mib,
             lambda b=bucket: run_export(sg, state, specs, group, b, 1, args.out, rank, streams,
                                         min(args.writers, world)))]
    phases.append([])
    if args.xtuner_bucket_mib:
        bucket = args.xtuner_bucket_mib * MIB
        phases[-1].append(("xtuner", args.xtuner_bucket_mib,
                          lambda b=bucket: run_xtuner(sg, named, state, group, world, b,
                                                      args.backend)))
    records = []
    for phase in phases:
        plan = [case for case in phase if case[0] in args.cases]
        first = len(records)
        for rep in range(args.repeat):
            for k, (name, bucket_mib, fn) in enumerate(plan):
                seconds, peak, buckets = measured(barrier, fn)
                if rep == 0:
                    records.append(dict(case=name, bucket_mib=bucket_mib, seconds=[], peak=[],
                                        buckets=[]))
                rec = records[first + k]
                rec["seconds"].append(seconds)
                rec["peak"].append(peak)
                rec["buckets"].extend(buckets)
        streams.clear()
        _LIMIT_BUFFERS.clear()
        gc.collect()
        if rank == 0 and plan:
            print("# %s: %d passes done" % (", ".join(sorted({c[0] for c in plan})), args.repeat),
                  flush=True)
    return records


def report(all_ranks, args, world):
    """Rank 0: one row per (case, bucket), the slowest rank's time, every rank's peak."""
    rows = []
    for k, rec in enumerate(all_ranks[0]):
        passes = len(rec["seconds"])
        slowest = [max(r[k]["seconds"][p] for r in all_ranks) for p in range(passes)]
        seconds = statistics.median(slowest)
        peaks = [max(r[k]["peak"]) for r in all_ranks]
        per_bucket = statistics.median(rec["buckets"]) if rec["buckets"] else None
        rows.append(dict(backend=args.backend, world=world, case=rec["case"],
                         bucket_mib=rec["bucket_mib"], seconds=round(seconds, 3),
                         seconds_each_pass=[round(x, 3) for x in slowest],
                         bucket_median_s=None if per_bucket is None else round(per_bucket, 4),
                         buckets=len(rec["buckets"]) // passes or None,
                         peak_extra_mib=[round(p / MIB) for p in peaks]))
    print("# %s, world %d: median seconds of the slowest rank over %d passes; x limit, x "
          "transport: that time over theirs (same bucket size; for xtuner the smallest)"
          % (args.backend, world, args.repeat))
    print("%-10s %7s %9s %8s %8s %8s  %s" % ("case", "bucket", "seconds", "x limit", "x transp",
                                             "bucket_s", "peak extra RSS per rank (MiB)"))

    def ratio(row, case):
        size = row["bucket_mib"] if row["case"] != "xtuner" else min(args.bucket_mib)
        ref = [r for r in rows if r["case"] == case and r["bucket_mib"] == size]
        return row["seconds"] / ref[0]["seconds"] if ref else float("nan")

    for row in rows:
        print("%-10s %6dM %9.3f %8.2f %8.2f %8s  %s" % (
            row["case"], row["bucket_mib"], row["seconds"], ratio(row, "limit"),
            ratio(row, "transport"),
            "-" if row["bucket_median_s"] is None else "%.3f" % row["bucket_median_s"],
            row["peak_extra_mib"]))
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--world", type=int, default=2, help="Gloo only (MPI: mpirun -np)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--ffn", type=int, default=7744)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mib", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--xtuner-bucket-mib", type=int, default=2048,
                   help="0: skip xtuner's method (its own default is 4096)")
    p.add_argument("--cases", type=lambda v: v.split(","),
                   default="limit,transport,stream,export,export_p0,export_writers,xtuner"
                   .split(","),
                   help="comma-separated subset of the cases (default: all)")
    p.add_argument("--repeat", type=int, default=3, help="passes over every case (median)")
    p.add_argument("--writers", type=int, default=4,
                   help="export_writers: writer ranks (at most the world size)")
    p.add_argument("--out", default="/dev/shm", help="where export writes (then deletes)")
    p.add_argument("--json", default=None, help="append one JSON record per row here")
    return p.parse_args()


def gloo_rank(rank, world, args, init_file, queue):
    import datetime

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    records = body(rank, world, args, None, dist.barrier)
    queue.put((rank, records))
    dist.barrier()
    os._exit(0)


def main():
    args = parse()
    if args.backend == "mpi":
        from mpi4py import MPI

        import shardgather as sg

        comm = sg.mpi_communicator(MPI.COMM_WORLD)
        records = body(comm.rank, comm.size, args, comm, MPI.COMM_WORLD.Barrier)
        gathered = MPI.COMM_WORLD.gather(records, root=0)
        if comm.rank == 0:
            report(gathered, args, comm.size)
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="sg-bench-export-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=gloo_rank, args=(r, args.world, args, init_file, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    got = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    report([got[r] for r in range(args.world)], args, args.world)


if __name__ == "__main__":
    sys.exit(main())
