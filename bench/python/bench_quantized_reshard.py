"""A quantized ReshardPlan against the bf16 plan of the same layouts: the weight-sync step of an
FP8 engine fed from an FSDP trainer (issue 39's before/after of the reshard's quantize stage).

    PYTHONPATH=build/ci/python mpirun -np 2 .venv/bin/python \\
        bench/python/bench_quantized_reshard.py --iters 7

The tensors are a Qwen3-8B decoder layer's seven matrices (hidden 4096, 32 query and 8
key/value heads of 128, MLP 12288), bf16. Sources: FSDP2's rows (torch.chunk along dim 0, so
the cuts of the 128 x 128 format fall inside blocks); destinations: tensor parallel over the
same ranks, q/k/v/gate/up split along dim 0 (column parallel), o/down along dim 1 (row
parallel). Each plan is made once and executed every step:
  bf16      the plain ReshardPlan, bf16 destinations;
  fp8       ReshardPlan(quantize="fp8_e4m3_128x128"), (data, scales) destinations;
  mxfp8     ReshardPlan(quantize="mxfp8");
  fp8-deq   the fp8 plan into bf16 destinations (dequantized on arrival).
Per call an MPI barrier (not timed), then the call; each iteration takes the max over ranks, the
methods in a shuffled order. The first call of every quantized method is checked bit for bit
against quantizing the full tensors here. Prints medians and each method / bf16.
"""

import argparse
import json
import os
import statistics
import sys

import torch

import shardgather as sg
from shardgather import quantized
from shardgather.layouts import Box, TensorLayout
from shardgather.quantization import dequantize, quantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quantized import time_methods  # noqa: E402  (its timing loop, shared)

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096),
          (12288, 4096), (4096, 12288)]
ROW_PARALLEL = {3, 6}  # o_proj and down_proj: split along dim 1


def split(shape, dim, world):
    out, at = [], 0
    for r, n in enumerate(sg.chunk_sizes(shape[dim], world)):
        offset, size = [0, 0], list(shape)
        offset[dim], size[dim] = at, n
        out.append((r, Box(tuple(offset), tuple(size))))
        at += n
    return out


def region(t, box):
    for d, (o, n) in enumerate(zip(box.offset, box.size)):
        t = t.narrow(d, o, n)
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args()
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    comm = sg.mpi_communicator(mpi)
    rank, world = comm.rank, comm.size
    g = torch.Generator().manual_seed(7)
    fulls = [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in SHAPES]
    layouts = [TensorLayout(s, torch.bfloat16, split(s, 0, world),
                            split(s, 1 if i in ROW_PARALLEL else 0, world))
               for i, s in enumerate(SHAPES)]
    sources = [region(f, t.sources[rank][1]).clone() for f, t in zip(fulls, layouts)]
    boxes = [t.destinations[rank][1] for t in layouts]

    def pairs(fmt):
        scale = torch.uint8 if fmt == "mxfp8" else torch.float32
        return [(torch.empty(b.size, dtype=torch.uint8),
                 torch.empty(quantized.scale_box(fmt, s, b).size, dtype=scale))
                for s, b in zip(SHAPES, boxes)]

    plans = {"bf16": sg.ReshardPlan(layouts, world, rank)}
    outs = {"bf16": [torch.empty(b.size, dtype=torch.bfloat16) for b in boxes]}
    for name, fmt in (("fp8", "fp8_e4m3_128x128"), ("mxfp8", "mxfp8")):
        plans[name] = sg.ReshardPlan(layouts, world, rank, quantize=fmt)
        outs[name] = pairs(fmt)
    plans["fp8-deq"] = plans["fp8"]
    outs["fp8-deq"] = [torch.empty(b.size, dtype=torch.bfloat16) for b in boxes]
    methods = {m: (lambda m=m: plans[m].execute(sources, outs[m], comm)) for m in plans}
    for m, fn in methods.items():  # warm-up, and the check
        fn()
    for i, (full, box) in enumerate(zip(fulls, boxes)):
        assert torch.equal(outs["bf16"][i], region(full, box))
        for m, fmt in (("fp8", "fp8_e4m3_128x128"), ("mxfp8", "mxfp8")):
            data, scales = quantize(full, fmt)
            assert torch.equal(outs[m][i][0], region(data.view(torch.uint8), box)), (m, i)
            sbox = quantized.scale_box(fmt, SHAPES[i], box)
            assert torch.equal(outs[m][i][1].view(torch.uint8),
                               region(scales, sbox).contiguous().view(torch.uint8)), (m, i)
            if m == "fp8":
                want = region(dequantize(data, scales, fmt, torch.bfloat16), box)
                assert torch.equal(outs["fp8-deq"][i].view(torch.int16),
                                   want.view(torch.int16)), i
    del fulls
    times = {m: [] for m in methods}
    time_methods(methods, times, args.iters, mpi)
    if rank != 0:
        return
    med = {m: statistics.median(v) for m, v in times.items()}
    ratios = {"%s/bf16" % m: med[m] / med["bf16"] for m in methods if m != "bf16"}
    if args.json:
        print(json.dumps({"world": world, "median_s": med, "all_s": times, "ratios": ratios}))
        return
    print("world %d, Qwen3-8B layer FSDP -> TP, %d timed calls each (max over ranks)"
          % (world, args.iters))
    for m in methods:
        print("  %-8s median %8.1f ms   (%s)" % (m, med[m] * 1e3,
                                                " ".join("%.0f" % (t * 1e3) for t in times[m])))
    for k, v in ratios.items():
        print("  %-14s %.3f" % (k, v))


if __name__ == "__main__":
    main()
