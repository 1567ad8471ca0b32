"""GPU tests of the Python drop-in (tools/device-check runs them on a machine with one GPU).

- an NCCL group at world 1: CUDA tensors in, CUDA tensors out, on the current stream;
- stream semantics at NCCL world 1 (c10d's): a blocking call returns with its work still queued
  behind a long kernel on the current stream and reads its inputs after that kernel; a started
  call on a side stream is ordered into the current stream by Work.wait(); under
  set_device_wait("host") the call returns only after the stream ran it;
- a Gloo group at world 2 (two processes on one GPU: NCCL refuses two ranks on one device), with
  CUDA tensors: foreach_all_gather with and without the shapes hint, both forms of an uneven
  device gather (per-rank broadcasts, padded all-gather), a transposed input, a side stream, and
  unshard along dims 0, 1 and the last, bit-exact against the shards' source tensors;
- a reshard on the device at both (row shards into a fused parameter's columns, a transposed
  source, one part and many), bit-exact;
- a quantized reshard on the device at both (each FP8 format; the rows cut inside blocks at world
  2; destinations as (data, scales) and as float32 / bfloat16 values), bit-identical to the same
  plan on CPU tensors;
- one-shot quantized unshard and foreach_all_gather on CUDA tensors, blocking and started, the
  bytes of the same calls on CPU tensors;
- a quantized unshard_stream of CUDA shards (one bucket and one per tensor, two iterations), the
  bytes of the same stream over CPU shards;
- a weight sync with CUDA sources into in-place CUDA destinations (through host memory) at both,
  every version bit-exact in the destination tensors themselves.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardgather as sg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _init(backend, rank, world, store_path):
    dist.init_process_group(backend, init_method="file://" + store_path, rank=rank,
                            world_size=world)


def _shards(rank, world):
    torch.manual_seed(100 + rank)
    a = torch.randn(rank + 2, 3, device="cuda")
    b = torch.randn(3, 5 * (rank + 1), device="cuda").t()  # transposed: strided input
    c = torch.randint(-100, 100, (7,), dtype=torch.int8, device="cuda")
    return [a, b, c]


def _check_gather(out, world, rank_tensors):
    for i in range(3):
        for r in range(world):
            got = out[i][r]
            assert got.is_cuda
            assert torch.equal(got.cpu(), rank_tensors[r][i].cpu()), (i, r)


def _check_unshard(rank, world):
    group = dist.group.WORLD
    for dim in (0, 1, 2):
        full_shape = [6, 10, 4 * world - 1]
        torch.manual_seed(7 + dim)
        full = torch.randn(*full_shape, device="cuda")
        sizes = sg.chunk_sizes(full_shape[dim], world)
        local = torch.split(full, sizes, dim=dim)[rank].contiguous()
        spec = sg.ShardSpec(torch.float32, full_shape, dim)
        (got,) = sg.unshard([local], [spec], group)
        assert got.is_cuda and torch.equal(got.cpu(), full.cpu()), dim


def _check_reshard(rank, world):
    """FSDP-style row shards to column shards landing in a fused parameter's columns, and a
    transposed source, in one part and in many (a 64-byte bucket), bit-exact on the device."""
    from shardgather.layouts import Box, TensorLayout

    group = dist.group.WORLD
    torch.manual_seed(11)
    full = torch.randn(12, 10 * world, device="cuda")
    other = torch.randint(-9, 9, (6 * world, 5), dtype=torch.int32, device="cuda")
    rows = [(r, Box((r * 12 // world, 0), (12 // world, 10 * world))) for r in range(world)]
    cols = [(r, Box((0, 10 * r), (12, 10))) for r in range(world)]
    layouts = [TensorLayout(tuple(full.shape), torch.float32, rows, cols),
               TensorLayout(tuple(other.shape), torch.int32,
                            [(r, Box((6 * r, 0), (6, 5))) for r in range(world)],
                            [(r, Box((0, 0), (6 * world, 5))) for r in range(world)])]
    mine_rows = full[rank * 12 // world:(rank + 1) * 12 // world]
    mine_other = other[6 * rank:6 * rank + 6].t().contiguous().t()  # transposed storage
    for bucket in (None, 64):
        plan = sg.ReshardPlan.for_group(layouts, group, device_bucket_bytes=bucket)
        assert bucket is None or world == 1 or plan.device_parts > 1, plan.device_parts
        fused = torch.full((12, 16), -1.0, device="cuda")  # columns 3..12 are this rank's
        gathered = torch.zeros(6 * world, 5, dtype=torch.int32, device="cuda")
        plan.execute([mine_rows, mine_other], [fused[:, 3:13], gathered], group)
        torch.cuda.synchronize()
        assert torch.equal(fused[:, 3:13].cpu(), full[:, 10 * rank:10 * rank + 10].cpu()), bucket
        assert torch.equal(fused[:, :3].cpu(), torch.full((12, 3), -1.0)), "written outside"
        assert torch.equal(fused[:, 13:].cpu(), torch.full((12, 3), -1.0)), "written outside"
        assert torch.equal(gathered.cpu(), other.cpu()), bucket
    # Rank 0 alone holds and wants a tensor: the other ranks have no tensors and name the device.
    alone = TensorLayout((5, 3), torch.float32, [(0, Box((0, 0), (5, 3)))],
                         [(0, Box((0, 0), (5, 3)))])
    plan = sg.ReshardPlan.for_group([alone], group)
    src = [full[:5, :3]] if rank == 0 else []
    dst = [torch.zeros(5, 3, device="cuda")] if rank == 0 else []
    out = plan.execute(src, dst, group, device="cuda")
    torch.cuda.synchronize()
    assert rank != 0 or torch.equal(out[0].cpu(), full[:5, :3].cpu())


def _check_quantized_reshard(rank, world):
    """The quantize stage's kernels: the same plan's call on CUDA tensors gives the bytes of its
    call on CPU tensors (which the CPU suites hold to quantizing the whole tensor)."""
    from shardgather.layouts import Box, TensorLayout
    from shardgather.quantized import scale_box

    group = dist.group.WORLD
    cases = [("fp8_e4m3_128x128", torch.float32, (300, 256)),
             ("fp8_e4m3_1x128", torch.bfloat16, (200, 384)),
             ("mxfp8", torch.float16, (96, 256))]
    for k, (fmt, dtype, shape) in enumerate(cases):
        torch.manual_seed(5)
        full = (torch.randn(shape) * torch.logspace(-4, 4, shape[0]).unsqueeze(1)).to(dtype)
        full[7, 9] = float("nan")
        cuts = [0, 100, shape[0]] if world == 2 else [0, shape[0]]
        rows = [(r, Box((cuts[r], 0), (cuts[r + 1] - cuts[r], shape[1]))) for r in range(world)]
        want = Box((0, 0), (shape[0] // 2 + 3, shape[1]))
        layout = TensorLayout(shape, dtype, rows,
                              [(r, Box((0, 0), shape) if r == 0 else want)
                               for r in range(world)])
        plan = sg.ReshardPlan.for_group([layout], group, quantize=fmt)
        mine = full[cuts[rank]:cuts[rank + 1]]
        box = Box((0, 0), shape) if rank == 0 else want
        results = []
        for device in ("cpu", "cuda"):
            scales = scale_box(fmt, shape, box).size
            sdtype = torch.float8_e8m0fnu if fmt == "mxfp8" else torch.float32
            out = [torch.empty(box.size, dtype=torch.float32, device=device),
                   (torch.empty(box.size, dtype=torch.float8_e4m3fn, device=device),
                    torch.empty(scales, dtype=sdtype, device=device)),
                   torch.empty(box.size, dtype=torch.bfloat16, device=device)]
            dest = out[0] if rank == 0 else out[1 + k % 2]
            src = mine.to(device)
            if device == "cuda" and src.dim() == 2:
                src = src.t().contiguous().t()  # strided: the kernel reads any view
            got = plan.execute([src], [dest], group)
            torch.cuda.synchronize()
            parts = got[0] if isinstance(got[0], tuple) else (got[0],)
            results.append([p.cpu().view(torch.uint8) for p in parts])
        assert all(torch.equal(a, b) for a, b in zip(*results)), (fmt, rank)


def _check_one_shot_quantized(rank, world):
    """unshard(quantize=...) and foreach_all_gather(quantize=...) on CUDA tensors (one-shot
    quantized plans: the quantize stage's kernels), sync and started: the bytes of the same
    calls on CPU tensors."""
    group = dist.group.WORLD
    torch.manual_seed(9)
    full = torch.randn(300, 256, dtype=torch.bfloat16) * 3
    spec = sg.ShardSpec(full.dtype, full.shape, 0)
    sizes = sg.chunk_sizes(300, world)
    mine = full[sum(sizes[:rank]):sum(sizes[:rank + 1])]
    hint = [[(n, 256)] for n in sizes]
    for fmt in ("fp8_e4m3_128x128", "mxfp8"):
        results = []
        for device, async_op in (("cpu", False), ("cuda", False), ("cuda", True)):
            src = mine.to(device)
            got = sg.unshard([src], [spec], group, quantize=fmt, async_op=async_op)
            every = sg.foreach_all_gather([src], group, hint, quantize=fmt, async_op=async_op)
            if async_op:
                got, every = got.wait(), every.wait()
            torch.cuda.synchronize()
            parts = list(got[0]) + [x for pair in every[0] for x in pair]
            assert all(p.device.type == device for p in parts), (fmt, device)
            results.append([p.cpu().view(torch.uint8) for p in parts])
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other)), (fmt, rank)


def _check_quantized_stream(rank, world):
    """unshard_stream(quantize=...) of CUDA shards (each bucket a quantized plan's call, its
    buffers device memory): every bucket, on each of two iterations (the shards change between
    them), has the bytes of the same stream over CPU shards."""
    group = dist.group.WORLD
    torch.manual_seed(11)
    full = {"q.weight": torch.randn(300, 256, dtype=torch.bfloat16),
            "norm": torch.randn(64, dtype=torch.bfloat16),
            "up.weight": torch.randn(192, 128, dtype=torch.float32)}
    specs = {k: sg.ShardSpec(t.dtype, t.shape, 0) for k, t in full.items()}
    formats = {"q.weight": "fp8_e4m3_128x128", "up.weight": "mxfp8"}

    def mine(device):
        out = {}
        for k, t in full.items():
            sizes = sg.chunk_sizes(t.shape[0], world)
            out[k] = t[sum(sizes[:rank]):sum(sizes[:rank + 1])].to(device, copy=True)
        return out

    for bucket_bytes in (1, 1 << 30):
        got = {}
        for device in ("cpu", "cuda"):
            shards = mine(device)
            stream = sg.unshard_stream(shards, specs, group, bucket_bytes=bucket_bytes,
                                       copy=True, quantize=formats)
            got[device] = []
            for _ in range(2):
                with stream:
                    for bucket in stream:
                        torch.cuda.synchronize()
                        assert all(t.device.type == device for t in bucket.values())
                        got[device].append({k: t.cpu().view(torch.uint8)
                                            for k, t in bucket.items()})
                for t in shards.values():
                    t.mul_(-2)
        assert len(got["cpu"]) == len(got["cuda"])
        for a, b in zip(got["cpu"], got["cuda"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (rank, a)


def _check_weight_sync(rank, world, device="cuda"):
    """WeightSync with CUDA sources and in-place CUDA destinations: each version lands bit-exact
    in the destination tensors themselves (the records applied on the host mirrors)."""
    from shardgather.layouts import Box, TensorLayout

    shape = (64, 48)
    rows = [(r, Box((r * 64 // world, 0), (64 // world, 48))) for r in range(world)]
    layout = TensorLayout(shape, torch.float32, rows, [(r, Box((0, 0), shape))
                                                       for r in range(world)])
    dest = torch.full(shape, -1.0, device=device)
    ws = sg.WeightSync([layout], dist.group.WORLD, mode="in_place", destinations=[dest])
    torch.manual_seed(3)
    full = torch.randn(shape, device=device)
    for version in range(4):
        if version:
            full[version * 5, :7] += 1.0  # a delta: a few elements of one row
        ws.sync(version, [full[rank * 64 // world:(rank + 1) * 64 // world]])
        with ws.read() as (held, tensors):
            assert held == version and tensors[0] is dest
            assert torch.equal(dest.cpu(), full.cpu()), (rank, version)


def _gloo_worker(rank, world, store_path, errors):
    try:
        torch.cuda.set_device(0)
        # Both forms of an uneven device gather (SHARDGATHER_DEVICE_GATHER is read once per
        # process; the hook sets the same request, alike on both ranks), then the rule.
        _init("gloo", rank, world, store_path)
        mine = _shards(rank, world)
        every = [_shards(r, world) for r in range(world)]
        hint = [[tuple(t.shape) for t in every[r]] for r in range(world)]
        for form in ("broadcast", "padded", "auto"):
            sg._C._set_device_gather(form)
            _check_gather(sg.foreach_all_gather(mine, None, hint), world, every)
        _check_gather(sg.foreach_all_gather(mine), world, every)  # shapes gathered first
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = sg.foreach_all_gather(mine, None, hint)
        stream.synchronize()
        _check_gather(out, world, every)
        _check_unshard(rank, world)
        _check_reshard(rank, world)
        _check_quantized_reshard(rank, world)
        _check_one_shot_quantized(rank, world)
        _check_quantized_stream(rank, world)
        _check_weight_sync(rank, world)
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test
        errors.put("rank %d: %r" % (rank, e))
        raise


def test_gloo_world2_cuda_tensors():
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        errors = ctx.Queue()
        procs = [ctx.Process(target=_gloo_worker, args=(r, 2, os.path.join(d, "store"), errors))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        assert not msgs, msgs
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_nccl_world1():
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        _init("nccl", 0, 1, os.path.join(d, "store"))
        try:
            mine = _shards(0, 1)
            _check_gather(sg.foreach_all_gather(mine, None, [[tuple(t.shape) for t in mine]]), 1,
                          [mine])
            _check_unshard(0, 1)
            _check_reshard(0, 1)
            _check_quantized_reshard(0, 1)
            _check_one_shot_quantized(0, 1)
            _check_quantized_stream(0, 1)
        finally:
            dist.destroy_process_group()


# About half a second of a spinning kernel on an H200: far longer than enqueueing a call.
_SPIN_CYCLES = 1_000_000_000


def test_nccl_world1_calls_are_stream_ordered():
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        _init("nccl", 0, 1, os.path.join(d, "store"))
        try:
            a = torch.zeros(1 << 20, device="cuda")
            hint = [[tuple(a.shape)]]
            sg.foreach_all_gather([a], None, hint)  # NCCL's communicator is made here
            torch.cuda.synchronize()
            current = torch.cuda.current_stream()
            torch.cuda._sleep(_SPIN_CYCLES)
            a.fill_(3.0)  # after the spin, on the current stream
            (out,) = sg.foreach_all_gather([a], None, hint)
            assert not current.query(), "the call waited for the GPU"
            assert torch.equal(out[0].cpu(), torch.full_like(a, 3.0).cpu())

            # Started on a side stream (ordered after the inputs' writes, as c10d requires),
            # waited on the current stream: results read there without a synchronisation.
            b = torch.full((1 << 20,), 5.0, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                torch.cuda._sleep(_SPIN_CYCLES)
                work = sg.foreach_all_gather([b], None, hint, async_op=True)
            (got,) = work.wait()
            assert torch.equal(got[0].cpu(), b.cpu())

            sg.set_device_wait("host")
            try:
                torch.cuda._sleep(_SPIN_CYCLES)
                sg.foreach_all_gather([a], None, hint)
                assert current.query(), "host mode returned before the GPU ran the call"
            finally:
                sg.set_device_wait("stream")
            assert sg.device_wait() == "stream"
        finally:
            dist.destroy_process_group()


def test_cuda_results_are_on_the_inputs_device_and_host_calls_unchanged():
    with tempfile.TemporaryDirectory() as d:
        _init("gloo", 0, 1, os.path.join(d, "store"))
        try:
            (out,) = sg.foreach_all_gather([torch.arange(5.0)])
            assert not out[0].is_cuda and torch.equal(out[0], torch.arange(5.0))
            (dev,) = sg.foreach_all_gather([torch.arange(5.0, device="cuda")], None, [[(5,)]])
            assert dev[0].device == torch.device("cuda", 0)
        finally:
            dist.destroy_process_group()
