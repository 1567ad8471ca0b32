"""Quantized unshards against the bf16 unshard of the same tensors (issue 26's bars).

    mpirun -np 2 .venv/bin/python bench/python/bench_quantized.py              # one host
    tools/netns-mpirun --hosts 2 --per-host 1 --rate 1gbit -- \\
        .venv/bin/python bench/python/bench_quantized.py                     # link-bound

    .venv/bin/python bench/python/bench_quantized.py --kernel               # the quantizer

(PYTHONPATH=build/ci/python in each.) The tensors are a Qwen3-8B decoder layer (hidden 4096,
32 query and 8 key/value heads of 128, MLP 12288; its 1-d norms travel plain), bf16, sharded along
dim 0 torch.chunk-style as FSDP2 shards them. Methods, every one returning what an FP8 engine
loads or what the trainer had:
  bf16          shardgather.unshard, the full bf16 tensors;
  fp8-on-send   unshard(quantize="fp8_e4m3_128x128"): each rank quantizes its rows, FP8 data
                and 128 x 128 scales cross the wire;
  mxfp8-on-send unshard(quantize="mxfp8");
  fp8-plan      UnshardPlan(quantize="fp8_e4m3_128x128") made once, executed every time (one
                call of a quantized ReshardPlan: header, the cut blocks' maxima, the payload);
  bf16+quantize the bf16 unshard, then every receiver quantizes the full tensors to 128 x 128
                FP8 itself (what a gather without quantized transfers costs an FP8 engine);
  bf16-stream, fp8-stream
                an unshard_stream of the layer in one bucket, without and with quantize,
                iterated every time (a weight sync every step: the steady state, where the
                stream reuses its buffers and the quantizer its FP8 staging);
  bf16-foreach, fp8-foreach
                foreach_all_gather of the shards (the shapes hint given), without and with
                quantize="fp8_e4m3_128x128": out[i][r], rank r's rows, FP8 with the scales of
                the blocks they touch (blocking on CPU tensors: composed in Python);
  fp8-foreach-started
                the same started (async_op=True) and waited for: an agreement and one call of
                a quantized AllGatherPlan made for the call, the route CUDA tensors take.
Per call: an MPI barrier (not timed), then the call; each iteration takes the max over ranks,
and the methods take turns in a shuffled order. Prints medians and the ratios the bars name:
fp8-on-send / bf16 (<= 0.60 link-bound, <= 1.10 on one host), bf16+quantize / fp8-on-send (>=
1.8 link-bound), fp8-stream / bf16-stream and fp8-foreach / bf16-foreach. The first call of
every method is checked: each FP8 and MXFP8 result bit for bit against the bf16 gather's full
tensors quantized here.
"""

import argparse
import json
import random
import statistics
import time

import torch

import shardgather as sg
from shardgather.quantization import quantize

FMT = "fp8_e4m3_128x128"


def qwen3_8b_layer():
    h, kv, f = 4096, 8 * 128, 12288
    return [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,), (128,), (128,)]


def kernel(iters):
    """The host quantizer alone, one core: the amax pass and the quantize pass over a 6144 x
    4096 tensor (half a Qwen3-8B gate_proj) per format and dtype, warm buffers (the data into a
    reused output), medians; SHARDGATHER_QUANTIZE_ISA=sse2 or avx2 caps the loops."""
    from shardgather import _shardgather as C

    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = (torch.randn(6144, 4096) * 0.02).to(dtype)
        out = torch.empty(x.shape, dtype=torch.uint8)
        out.fill_(0)
        for fmt in ("fp8_e4m3_128x128", "fp8_e4m3_1x128", "mxfp8"):
            fold, quant = [], []
            for _ in range(iters):
                t0 = time.perf_counter()
                amax = C._fold_amax(x, fmt, list(x.shape), [0, 0])
                t1 = time.perf_counter()
                C._quantize_box(x, fmt, list(x.shape), [0, 0], amax, out)
                t2 = time.perf_counter()
                fold.append(t1 - t0)
                quant.append(t2 - t1)
            f, q = statistics.median(fold), statistics.median(quant)
            print("  %-9s %-17s amax %6.1f ms  quantize %6.1f ms  (%.2f G elements/s)"
                  % (str(dtype).split(".")[1], fmt, f * 1e3, q * 1e3, x.numel() / q / 1e9))


def time_methods(methods, times, iters, mpi):
    """``iters`` rounds of every method in a shuffled order, each call after an MPI barrier (not
    timed); appends each call's time, the max over ranks, to ``times[method]``."""
    from mpi4py import MPI

    order = list(methods)
    rnd = random.Random(11)
    for _ in range(iters):
        rnd.shuffle(order)
        for m in order:
            mpi.Barrier()
            t0 = time.perf_counter()
            methods[m]()
            times[m].append(mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    p.add_argument("--kernel", action="store_true",
                   help="time the host quantizer alone, on one rank (no MPI)")
    args = p.parse_args()
    if args.kernel:
        return kernel(args.iters)
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    comm = sg.mpi_communicator(mpi)
    rank, world = comm.rank, comm.size
    shapes = qwen3_8b_layer()
    specs = [sg.ShardSpec(torch.bfloat16, s, 0) for s in shapes]
    g = torch.Generator().manual_seed(7)
    shards = []
    for s in specs:
        sizes = sg.chunk_sizes(s.full_shape[0], world)
        rows = (sizes[rank],) + tuple(s.full_shape[1:])
        shards.append((torch.randn(rows, generator=g) * 0.02).to(torch.bfloat16))

    def bf16_then_quantize():
        full = sg.unshard(shards, specs, comm)
        return [quantize(t, FMT) if t.dim() == 2 else t for t in full]

    streams = {fmt: sg.unshard_stream(shards, specs, comm, bucket_bytes=1 << 31, quantize=fmt)
               for fmt in (None, FMT)}

    def drain(stream):
        with stream:
            return [dict(b) for b in stream]

    fp8_plan = sg.UnshardPlan(specs, world, rank, quantize=FMT)
    hint = [[(sg.chunk_sizes(s.full_shape[0], world)[r],) + tuple(s.full_shape[1:])
             for s in specs] for r in range(world)]
    methods = {
        "bf16-foreach": lambda: sg.foreach_all_gather(shards, comm, shapes_across_group=hint),
        "fp8-foreach": lambda: sg.foreach_all_gather(shards, comm, shapes_across_group=hint,
                                                     quantize=FMT),
        "fp8-foreach-started": lambda: sg.foreach_all_gather(
            shards, comm, shapes_across_group=hint, quantize=FMT, async_op=True).wait(),
        "bf16": lambda: sg.unshard(shards, specs, comm),
        "fp8-plan": lambda: fp8_plan.execute(shards, comm),
        "fp8-on-send": lambda: sg.unshard(shards, specs, comm, quantize=FMT),
        "mxfp8-on-send": lambda: sg.unshard(shards, specs, comm, quantize="mxfp8"),
        "bf16+quantize": bf16_then_quantize,
        "bf16-stream": lambda: drain(streams[None]),
        "fp8-stream": lambda: drain(streams[FMT]),
    }
    times = {m: [] for m in methods}
    first = {m: fn() for m, fn in methods.items()}  # warm-up, and the results to compare
    full = first["bf16"]
    streamed = {k: v for b in first["fp8-stream"] for k, v in b.items()}
    for i, (t, fp8, mx, planned) in enumerate(zip(full, first["fp8-on-send"],
                                                  first["mxfp8-on-send"], first["fp8-plan"])):
        if t.dim() != 2:  # a single format leaves the 1-d norms plain
            assert torch.equal(fp8, t) and torch.equal(mx, t) and torch.equal(streamed[i], t)
            assert torch.equal(planned, t)
            continue
        for (data, scales), fmt in ((fp8, FMT), (mx, "mxfp8"), (planned, FMT),
                                    ((streamed[i], streamed["%d_scale_inv" % i]), FMT)):
            want = quantize(t, fmt)
            assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)), (i, fmt)
            assert torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8)), (i, fmt)
    for i, t in enumerate(full):  # the gather's rows: rank r's rows of the quantized tensor
        if t.dim() != 2:
            continue
        want = quantize(t, FMT)
        for method in ("fp8-foreach", "fp8-foreach-started"):
            at = 0
            for data, scales in first[method][i]:
                n = data.shape[0]
                assert torch.equal(data.view(torch.uint8),
                                   want[0][at:at + n].view(torch.uint8)), (i, method)
                assert torch.equal(scales, want[1][at // 128:-(-(at + n) // 128)]), (i, method)
                at += n
    del first, full, streamed
    time_methods(methods, times, args.iters, mpi)
    if rank != 0:
        return
    med = {m: statistics.median(v) for m, v in times.items()}
    ratios = {"fp8-on-send/bf16": med["fp8-on-send"] / med["bf16"],
              "fp8-plan/bf16": med["fp8-plan"] / med["bf16"],
              "fp8-plan/fp8-on-send": med["fp8-plan"] / med["fp8-on-send"],
              "mxfp8-on-send/bf16": med["mxfp8-on-send"] / med["bf16"],
              "bf16+quantize/fp8-on-send": med["bf16+quantize"] / med["fp8-on-send"],
              "fp8-stream/bf16-stream": med["fp8-stream"] / med["bf16-stream"],
              "fp8-foreach/bf16-foreach": med["fp8-foreach"] / med["bf16-foreach"],
              "fp8-foreach-started/fp8-foreach": med["fp8-foreach-started"] / med["fp8-foreach"]}
    if args.json:
        print(json.dumps({"world": world, "median_s": med, "all_s": times, "ratios": ratios}))
        return
    print("world %d, Qwen3-8B layer, %d timed calls each (max over ranks)" % (world, args.iters))
    for m in methods:
        print("  %-19s median %8.1f ms   (%s)" % (m, med[m] * 1e3,
                                                  " ".join("%.0f" % (t * 1e3) for t in times[m])))
    for k, v in ratios.items():
        print("  %-27s %.3f" % (k, v))


if __name__ == "__main__":
    main()
