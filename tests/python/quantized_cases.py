"""Quantized unshards (shardgather.quantized): each check takes (rank, world, group) and runs on
the threads backend, MPI and Gloo groups. Every rank builds the same full tensors from a seed,
sends its shard quantized, and compares what it receives bit for bit with the references run
on the full tensor: the FP8 block formula in torch and
torch.testing._internal.common_quantized.to_mxfp (test_quantize.py ties the host quantizer
to the same two)."""

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file
from torch.testing._internal.common_quantized import to_mxfp

import shardgather
from shardgather import Quantize, ShardSpec
from conftest import on_default_group
from test_quantize import _fp8_reference, _values

T = 30.0  # per-call deadline: a broken case fails instead of hanging the harness
BLOCKS = {"fp8_e4m3_128x128": (128, 128), "fp8_e4m3_1x128": (1, 128)}


def _same_bits(a, b):
    """Equal bytes (a NaN equal to the same NaN), dtype and shape alike."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(bits), b.view(bits))


def reference(full, fmt):
    """(data, scales) of the full tensor by the named reference."""
    if fmt == "mxfp8":
        scales, data = to_mxfp(full.float() if full.dtype == torch.float16 else full,
                               block_size=32, format="mxfp8")
        return data, scales
    return _fp8_reference(full, *BLOCKS[fmt])


def _cuts(n, world, seed):
    """Uneven sizes along a dim of n rows: cuts inside blocks, on block edges, empty shards."""
    g = torch.Generator().manual_seed(seed)
    if world == 1:
        return [n]
    points = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    if seed % 3 == 0 and world > 2:  # a cut on a block edge
        points[0] = min(n, 128)
        points.sort()
    edges = [0] + points + [n]
    return [edges[r + 1] - edges[r] for r in range(world)]


def _case_tensors(world):
    """(name, full tensor, ShardSpec, quantize spec) of a mixed list."""
    out = []
    shapes = [
        ("fp8_e4m3_128x128", (300, 260), 0), ("fp8_e4m3_128x128", (257, 400), 1),
        ("fp8_e4m3_128x128", (5, 7), 0), ("fp8_e4m3_128x128", (128, 256), 0),
        ("fp8_e4m3_1x128", (6, 300), 1), ("fp8_e4m3_1x128", (3, 4, 200), 1),
        ("fp8_e4m3_1x128", (2, 129), 0),
        ("mxfp8", (9, 160), 1), ("mxfp8", (40, 96), 0), ("mxfp8", (2, 3, 64), 2),
        ("mxfp8", (64,), 0),
    ]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    for k, (fmt, shape, dim) in enumerate(shapes):
        dtype = dtypes[k % 3]
        # NaN and Inf specials everywhere but in 128 x 128 blocks, where one NaN would make
        # every block NaN and hide a wrong amax exchange; those get sparse specials instead.
        block128 = fmt == "fp8_e4m3_128x128"
        full = _values(shape, dtype, seed=100 + k, specials=k % 2 == 0 and not block128,
                       scale=[1.0, 1e-6, 3e3][k % 3])
        if k == 0:  # one NaN block, one Inf block, values that saturate, elsewhere finite
            full[3, 7] = float("nan")
            full[200, 140] = float("-inf")
            full[150, 20] = 1e30
        if k == 3:  # a zero block and an infinity
            full[:, 128:] = 0.0
            full[5, 5] = float("inf")
        spec = ShardSpec(dtype, shape, dim, _cuts(shape[dim], world, seed=k))
        out.append(("q%d" % k, full, spec, fmt))
        if k % 4 == 1:  # plain tensors between the quantized ones
            plain = torch.arange(12 * world, dtype=torch.int32).reshape(4 * world, 3)
            out.append(("p%d" % k, plain, ShardSpec(torch.int32, plain.shape, 0), None))
    return out


def _shard(full, spec, rank, world):
    sizes = list(spec.sizes) or shardgather.chunk_sizes(full.shape[spec.shard_dim], world)
    return full.narrow(spec.shard_dim, sum(sizes[:rank]), sizes[rank]).clone()


def check_unshard_bit_exact(rank, world, group):
    """Raw outputs (data, scales) and dequantized ones, against the references."""
    cases = _case_tensors(world)
    shards = [_shard(full, spec, rank, world) for _, full, spec, _ in cases]
    specs = [spec for _, _, spec, _ in cases]
    raw = shardgather.unshard(shards, specs, group, timeout=T,
                              quantize=[fmt for _, _, _, fmt in cases])
    for (name, full, _, fmt), got in zip(cases, raw):
        if fmt is None:
            assert torch.equal(got, full), name
            continue
        data, scales = got
        want_data, want_scales = reference(full, fmt)
        assert data.dtype == torch.float8_e4m3fn, name
        _same_bits(data, want_data)
        _same_bits(scales, want_scales)
    out = torch.float32 if world % 2 else torch.bfloat16
    deq = shardgather.unshard(shards, specs, group, timeout=T,
                              quantize={i: Quantize(fmt, out) for i, (_, _, _, fmt)
                                        in enumerate(cases) if fmt})
    for (name, full, _, fmt), got in zip(cases, deq):
        if fmt is None:
            assert torch.equal(got, full), name
            continue
        data, scales = reference(full, fmt)
        want = shardgather.quantization.dequantize(data, scales, fmt, out)
        assert got.dtype == out, name
        _same_bits(got, want)


def check_one_spec_for_every_tensor(rank, world, group):
    """A single format quantizes every tensor it applies to; the others travel as they are."""
    w = _values((256, 192), torch.bfloat16, seed=7)
    norm = _values((192,), torch.bfloat16, seed=8)
    ids = torch.arange(5 * world, dtype=torch.int64)
    specs = [ShardSpec(w.dtype, w.shape, 0), ShardSpec(norm.dtype, norm.shape, 0),
             ShardSpec(ids.dtype, ids.shape, 0)]
    fulls = [w, norm, ids]
    shards = [_shard(f, s, rank, world) for f, s in zip(fulls, specs)]
    got = shardgather.unshard(shards, specs, group, timeout=T, quantize="fp8_e4m3_128x128")
    data, scales = got[0]
    want_data, want_scales = reference(w, "fp8_e4m3_128x128")
    _same_bits(data, want_data)
    _same_bits(scales, want_scales)
    assert torch.equal(got[1], norm) and torch.equal(got[2], ids)


def check_gather_to_one_rank(rank, world, group):
    """dst=0: rank 0 gets the quantized tensors, the others only send."""
    full = _values((300, 256), torch.float32, seed=9, specials=True)
    spec = ShardSpec(full.dtype, full.shape, 0, _cuts(300, world, seed=4))
    got = shardgather.unshard([_shard(full, spec, rank, world)], [spec], group, timeout=T,
                              dst=0, quantize="mxfp8")
    if rank != 0:
        assert got == [], got
        return
    want_data, want_scales = reference(full, "mxfp8")
    _same_bits(got[0][0], want_data)
    _same_bits(got[0][1], want_scales)


def check_padded_shards(rank, world, group):
    """FSDP's padded shards: only the real rows are quantized and sent."""
    full = _values((130, 256), torch.bfloat16, seed=11)
    sizes = shardgather.chunk_sizes(130, world)
    padded = max(sizes)
    spec = ShardSpec(full.dtype, full.shape, 0, sizes, padded)
    shard = torch.full((padded, 256), float("nan"), dtype=full.dtype)
    shard[:sizes[rank]] = _shard(full, spec, rank, world)
    got = shardgather.unshard([shard], [spec], group, timeout=T, quantize="fp8_e4m3_128x128")
    want_data, want_scales = reference(full, "fp8_e4m3_128x128")
    _same_bits(got[0][0], want_data)
    _same_bits(got[0][1], want_scales)


def _raises_everywhere(cls, text, call):
    try:
        call()
    except cls as e:
        assert text in str(e), str(e)
    else:
        raise AssertionError("no %s" % cls.__name__)


def check_disagreement(rank, world, group):
    """RELIABILITY 2.8b: a quantize spec that differs on one rank, or is bad on one rank, raises
    the same class on every rank before anything moves; the group works afterwards."""
    full = _values((256, 128), torch.bfloat16, seed=12)
    spec = ShardSpec(full.dtype, full.shape, 0)
    shard = _shard(full, spec, rank, world)
    last = world - 1
    other = "mxfp8" if rank == last else "fp8_e4m3_128x128"
    if world > 1:
        _raises_everywhere(shardgather.MismatchError, "quantize spec of tensor 0 differs",
                           lambda: shardgather.unshard([shard], [spec], group, timeout=T,
                                                       quantize=[other]))
        out = torch.float32 if rank == last else None
        _raises_everywhere(shardgather.MismatchError, "dequantized to torch.float32",
                           lambda: shardgather.unshard(
                               [shard], [spec], group, timeout=T,
                               quantize=[Quantize("mxfp8", out)]))
        plain = None if rank == last else ["mxfp8"]
        _raises_everywhere(shardgather.MismatchError, "none",
                           lambda: shardgather.unshard([shard], [spec], group, timeout=T,
                                                       quantize=plain or [None]))
        # quantize=None on one rank takes the plain call: its header meets the others'
        # agreement, and every rank raises MismatchError (the operations differ).
        _raises_everywhere(shardgather.MismatchError, "differs",
                           lambda: shardgather.unshard([shard], [spec], group, timeout=T,
                                                       quantize=plain))
        _raises_everywhere(shardgather.InvalidTypeError, "timeout must be a number",
                           lambda: shardgather.unshard([shard], [spec], group, quantize="mxfp8",
                                                       timeout="3" if rank == last else T))
    bad = "fp8_e5m2" if rank == last else "mxfp8"
    _raises_everywhere(shardgather.InvalidArgumentError, "rank %d: quantize[0]: unknown" % last,
                       lambda: shardgather.unshard([shard], [spec], group, timeout=T,
                                                   quantize=[bad]))
    one_d = ShardSpec(torch.bfloat16, (world * 4,), 0)
    _raises_everywhere(shardgather.InvalidArgumentError, "blocks need 2 dims",
                       lambda: shardgather.unshard([torch.ones(4, dtype=torch.bfloat16)],
                                                   [one_d], group, timeout=T,
                                                   quantize=["fp8_e4m3_128x128"]))
    wrong = shard if rank != last else shard[:, :64]
    # named in the unshard's words (the shard and its spec), not its reshard's
    _raises_everywhere(shardgather.InvalidArgumentError,
                       ", 64], rank %d should pass dim 1 = 128 (full [256, 128]" % last,
                       lambda: shardgather.unshard([wrong], [spec], group, timeout=T,
                                                   quantize="mxfp8"))
    got = shardgather.unshard([shard], [spec], group, timeout=T, quantize="mxfp8")
    _same_bits(got[0][0], reference(full, "mxfp8")[0])


def check_bytes_on_the_wire(rank, world, group):
    """What the ranks hand to the payload is exactly data + scales: 1 + 1/32 bytes per element
    for MXFP8, 1 + 4/16384 for 128 x 128 (whole blocks), summed over every rank's sends."""
    from shardgather import quantized

    comm = shardgather.communicator(group)
    for fmt, shape, per_element in (("mxfp8", (256, 1024), 1.03125),
                                    ("fp8_e4m3_128x128", (512, 1024), 1 + 4 / 16384)):
        full = _values(shape, torch.bfloat16, seed=13)
        spec = ShardSpec(full.dtype, shape, 0, _cuts(shape[0], world, seed=5))
        _, sent = quantized.encode([_shard(full, spec, rank, world)], [spec], comm, fmt,
                                      timeout=T)
        mine = torch.tensor([sum(t.nbytes for t in sent)], dtype=torch.int64)
        every = shardgather.foreach_all_gather([mine], comm, timeout=T)[0]
        assert sum(int(x) for x in every) == shape[0] * shape[1] * per_element, (fmt, every)


def _model(world, rank, scale=1.0):
    """A small model's state dict of shards, its specs and its full tensors."""
    shapes = {"layers.0.q.weight": ((300, 256), 0), "layers.0.norm.weight": ((256,), 0),
              "layers.0.up.weight": ((200, 160), 1), "layers.0.down.weight": ((160, 200), 0),
              "embed.weight": ((100, 64), 0)}
    full, specs, state = {}, {}, {}
    for k, (name, (shape, dim)) in enumerate(shapes.items()):
        full[name] = _values(shape, torch.bfloat16, seed=200 + k, specials=k == 2,
                             scale=scale)
        specs[name] = ShardSpec(torch.bfloat16, shape, dim, _cuts(shape[dim], world, seed=k))
        state[name] = _shard(full[name], specs[name], rank, world)
    return state, specs, full


def _check_quantized_dict(got, full, formats):
    """got: every name of a quantized stream or checkpoint; full: the tensors; formats: which
    are quantized, in which format."""
    want_names = []
    for name, t in full.items():
        fmt = formats.get(name)
        if fmt is None:
            assert torch.equal(got[name], t), name
            want_names.append(name)
            continue
        data, scales = reference(t, fmt)
        scale_name = name + ("_scale" if fmt == "mxfp8" else "_scale_inv")
        _same_bits(got[name], data)
        _same_bits(got[scale_name], scales)
        want_names += [name, scale_name]
    assert list(got) == want_names, (list(got), want_names)


def check_stream_quantized(rank, world, group):
    """A stream of a state dict with quantize by name: the data and scales of every quantized
    tensor, small buckets (data and scales in different ones), again after the shards change
    (each iteration quantizes their current values)."""
    state, specs, full = _model(world, rank)
    formats = {"layers.0.q.weight": "fp8_e4m3_128x128", "layers.0.up.weight": "mxfp8",
               "layers.0.down.weight": "fp8_e4m3_1x128"}
    stream = shardgather.unshard_stream(state, specs, group, bucket_bytes=20000, copy=True,
                                        timeout=T, quantize=formats)
    for step in range(2):
        got = {}
        with stream:
            for bucket in stream:
                got.update(bucket)
        _check_quantized_dict(got, full, formats)
        for name in state:  # a training step
            state[name].mul_(-3.0)
            full[name].mul_(-3.0)
    other = "mxfp8" if rank == world - 1 and world > 1 else "fp8_e4m3_128x128"
    if world > 1:
        _raises_everywhere(shardgather.MismatchError, "quantize spec of tensor 0 differs",
                           lambda: shardgather.unshard_stream(
                               state, specs, group, timeout=T,
                               quantize={"layers.0.q.weight": other}))
    _raises_everywhere(shardgather.InvalidArgumentError, "dequantize is for unshard",
                       lambda: shardgather.unshard_stream(
                           state, specs, group, timeout=T,
                           quantize=Quantize("mxfp8", torch.float32)))


def check_export_fp8(rank, world, group):
    """save_safetensors(quantize=): F8_E4M3 weights and F32 weight_scale_inv, bit-identical to
    the reference on the full tensors; the 1-d norm stays bf16; the index names the config."""
    from shardgather.export import save_safetensors

    state, specs, full = _model(world, rank, scale=0.05)
    out = tempfile.mkdtemp(prefix="sg-fp8-export-")
    try:
        index = save_safetensors(state, out, specs, group, progress=False, timeout=T,
                                 bucket_bytes=50000, quantize="fp8_e4m3_128x128")
        if rank != 0:
            assert index is None
            return
        with open(index) as f:
            meta = json.load(f)
        assert meta["metadata"]["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}, meta
        got = {}
        for name in sorted(set(meta["weight_map"].values())):
            got.update(load_file(os.path.join(out, name)))
        got = {k: got[k] for k in meta["weight_map"]}
        formats = {k: "fp8_e4m3_128x128" for k, t in full.items() if t.dim() == 2}
        _check_quantized_dict(got, full, formats)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def check_export_fp8_has_one_writer(rank, world, group):
    """An FP8 export has one writer: writers=2 with quantize= raises InvalidArgumentError on
    every rank, from the export's own stream and from one made beforehand (still usable
    afterwards); a quantize= that quantizes nothing is a plain export, which may have several
    writers either way (the direct path refused it, as if it quantized)."""
    from shardgather.export import save_safetensors

    if world < 2:
        return
    state, specs, full = _model(world, rank, scale=0.05)
    dirs = [tempfile.mkdtemp(prefix="sg-fp8-writers-") for _ in range(3)]
    fmt = "fp8_e4m3_128x128"
    try:
        _raises_everywhere(shardgather.InvalidArgumentError, "an FP8 export has one writer",
                           lambda: save_safetensors(state, dirs[0], specs, group,
                                                    progress=False, timeout=T, writers=2,
                                                    quantize=fmt))
        made = shardgather.unshard_stream(state, specs, group, dst=0, timeout=T, quantize=fmt)
        _raises_everywhere(shardgather.InvalidArgumentError, "an FP8 export has one writer",
                           lambda: save_safetensors(made, dirs[0], dst=0, progress=False,
                                                    timeout=T, writers=2))
        save_safetensors(made, dirs[0], dst=0, progress=False, timeout=T)
        indexes = [save_safetensors(state, dirs[1], specs, group, progress=False, timeout=T,
                                    writers=2, quantize={})]
        plain = shardgather.unshard_stream(state, specs, group, dst=0, timeout=T, quantize={})
        indexes.append(save_safetensors(plain, dirs[2], dst=0, progress=False, timeout=T,
                                        writers=2))
        if rank != 0:
            return
        for out, index in zip(dirs[1:], indexes):
            with open(index) as f:
                meta = json.load(f)
            assert "quantization_config" not in meta["metadata"], meta
            got = {}
            for name in sorted(set(meta["weight_map"].values())):
                got.update(load_file(os.path.join(out, name)))
            assert sorted(got) == sorted(full), sorted(got)
            for name, t in full.items():
                _same_bits(got[name], t)  # NaNs too
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def check_export_mxfp8_names_what_a_loader_reads(rank, world, group):
    """save_safetensors(quantize=) in MXFP8 for the matrices it can quantize: each is ``w``
    (F8_E4M3) and ``w_scale`` (E8M0), bit-identical to the reference, and the index's
    quantization_config is the one vLLM reads for MXFP8 checkpoints (``quant_method:
    "mxfp8"``), naming the modules whose matrices stay in bf16 (``ignored_layers``)."""
    from shardgather.export import save_safetensors

    state, specs, full = _model(world, rank, scale=0.05)
    formats = {"layers.0.q.weight": "mxfp8", "layers.0.up.weight": "mxfp8"}
    out = tempfile.mkdtemp(prefix="sg-mxfp8-export-")
    try:
        index = save_safetensors(state, out, specs, group, progress=False, timeout=T,
                                 bucket_bytes=50000, quantize=formats)
        if rank != 0:
            assert index is None
            return
        with open(index) as f:
            meta = json.load(f)
        plain = ["embed", "layers.0.down"]  # their matrices stay bf16; the norm is 1-d
        assert meta["metadata"]["quantization_config"] == {
            "quant_method": "mxfp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "ignored_layers": plain,
            "modules_to_not_convert": plain}, meta
        got = {}
        for name in sorted(set(meta["weight_map"].values())):
            got.update(load_file(os.path.join(out, name)))
        got = {k: got[k] for k in meta["weight_map"]}
        assert got["layers.0.q.weight_scale"].dtype == torch.float8_e8m0fnu
        _check_quantized_dict(got, full, formats)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def case_full_tensors_quantized(rank, world):
    """full_tensors(quantize=) on a state dict sharded by FSDP2 (cuts inside 128-row blocks),
    on a 1-D mesh with Shard(1) (cuts along the last dim) and a replicated DTensor: bit-exact
    with quantizing each full_tensor(); a 1-d bias and the norm travel plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 130),
                                torch.nn.LayerNorm(130))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    state = model.state_dict()
    fmt = "fp8_e4m3_128x128"
    comm = shardgather.communicator(mesh.get_group())
    calls = comm.calls_issued
    got = shardgather.full_tensors(state, timeout=T, quantize=fmt)
    # Its agreement, then one call of the quantized plan (header, cut blocks' maxima, payload).
    assert comm.calls_issued - calls == 2, (rank, comm.calls_issued - calls)
    assert list(got) == list(state)
    for name, t in state.items():
        full = t.full_tensor()
        if full.dim() != 2:
            assert torch.equal(got[name], full), name
            continue
        data, scales = reference(full, fmt)
        _same_bits(got[name][0], data)
        _same_bits(got[name][1], scales)
    g = torch.Generator().manual_seed(3)
    whole = [torch.randn(40, 96, generator=g), torch.randn(64, 96, generator=g)]
    tensors = [distribute_tensor(whole[0], mesh, [Shard(1)]),
               distribute_tensor(whole[1], mesh, [Replicate()])]
    got = shardgather.full_tensors(tensors, timeout=T,
                                   quantize=[Quantize("mxfp8", torch.bfloat16), "mxfp8"])
    want = shardgather.quantization.dequantize(*reference(whole[0], "mxfp8"), "mxfp8",
                                               torch.bfloat16)
    _same_bits(got[0], want)
    data, scales = reference(whole[1], "mxfp8")
    _same_bits(got[1][0], data)
    _same_bits(got[1][1], scales)




def _region(t, box):
    for d, (o, n) in enumerate(zip(box[0], box[1])):
        t = t.narrow(d, o, n)
    return t


def check_reshard_quantized(rank, world, group):
    """reshard(quantize=) from FSDP rows (cuts inside blocks) to column- and row-parallel TP
    boxes (uneven), and from a last-dim split to rows: every destination's FP8 bytes and the
    scales of
    the blocks its box touches equal the reference's, raw in place or dequantized into a view
    of a larger (fused) tensor whose other bytes stay as they were."""
    from shardgather import quantized
    from shardgather.layouts import Box, TensorLayout

    fulls = [_values((300, 256), torch.bfloat16, seed=21),
             _values((200, 192), torch.float32, seed=22, specials=True),
             _values((96, 160), torch.bfloat16, seed=23, specials=True),
             _values((260, 300), torch.float32, seed=24)]
    fulls[0][7, 9] = float("nan")  # one NaN block; the others finite, so a wrong amax shows
    fmts = ["fp8_e4m3_128x128", "mxfp8", "fp8_e4m3_1x128", "fp8_e4m3_128x128"]
    dequantized = [False, False, True, True]
    ranks = list(range(world))

    def rows(shape, sizes):
        at, out = 0, []
        for r, n in enumerate(sizes):
            out.append((r, Box((at, 0), (n, shape[1]))))
            at += n
        return out

    def cols(shape, sizes):
        at, out = 0, []
        for r, n in enumerate(sizes):
            out.append((r, Box((0, at), (shape[0], n))))
            at += n
        return out

    layouts = [
        TensorLayout(fulls[0].shape, fulls[0].dtype,
                     # rank 0 also lists an empty box: it sends nothing for it
                     [(0, Box((0, 0), (0, 256)))] + rows(fulls[0].shape, _cuts(300, world, 31)),
                     rows(fulls[0].shape, _cuts(300, world, 35))),  # column-parallel
        TensorLayout(fulls[1].shape, fulls[1].dtype, cols(fulls[1].shape, _cuts(192, world, 32)),
                     rows(fulls[1].shape, _cuts(200, world, 36))),
        TensorLayout(fulls[2].shape, fulls[2].dtype, cols(fulls[2].shape, _cuts(160, world, 33)),
                     rows(fulls[2].shape, _cuts(96, world, 34))),
        TensorLayout(fulls[3].shape, fulls[3].dtype, cols(fulls[3].shape, _cuts(300, world, 37)),
                     cols(fulls[3].shape, _cuts(300, world, 38))),  # row-parallel
    ]
    plain = torch.arange(6 * world, dtype=torch.int64).reshape(2 * world, 3)
    layouts.insert(1, TensorLayout(plain.shape, plain.dtype, rows(plain.shape, [2] * world),
                                   [(r, Box((0, 0), tuple(plain.shape))) for r in ranks]))
    fulls.insert(1, plain)
    fmts.insert(1, None)
    dequantized.insert(1, None)
    sources, destinations, checks = [], [], []
    for i, layout in enumerate(layouts):
        for r, box in layout.sources:
            if r == rank:
                sources.append(_region(fulls[i], box).clone())
        for r, box in layout.destinations:
            if r != rank:
                continue
            size = tuple(box[1])
            if fmts[i] is None:
                dest = torch.zeros(size, dtype=plain.dtype)
            elif dequantized[i]:  # into the middle rows of a larger bf16 parameter
                fused = torch.full((size[0] + 4,) + size[1:], 7.0, dtype=torch.bfloat16)
                dest = fused.narrow(0, 2, size[0])
            else:
                sbox = quantized.scale_box(fmts[i], layout.shape, box)
                dest = (torch.empty(size, dtype=torch.float8_e4m3fn),
                        torch.empty(sbox.size, dtype=torch.float8_e8m0fnu if fmts[i] == "mxfp8"
                                    else torch.float32))
            destinations.append(dest)
            checks.append((i, box, dest, fused if dequantized[i] else None))
    out = shardgather.reshard(sources, destinations, layouts, group, timeout=T,
                              quantize=fmts)
    assert len(out) == len(destinations)
    for i, box, dest, fused in checks:
        if fmts[i] is None:
            assert torch.equal(dest, _region(fulls[i], box))
            continue
        data, scales = reference(fulls[i], fmts[i])
        if fused is None:
            _same_bits(dest[0], _region(data, box))
            _same_bits(dest[1], _region(scales, quantized.scale_box(fmts[i], fulls[i].shape,
                                                                    box)))
            continue
        want = _region(shardgather.quantization.dequantize(data, scales, fmts[i],
                                                           torch.bfloat16), box)
        _same_bits(dest, want)
        assert torch.all(fused[:2] == 7.0) and torch.all(fused[-2:] == 7.0)
    # Sources that do not split one dim are refused on every rank.
    # Sources that do not split one dim into disjoint pieces are refused on every rank:
    # replicas, and a piece inside pieces that already tile the dim.
    replicas = [(r, Box((0, 0), tuple(fulls[0].shape))) for r in ranks]
    inside = rows(fulls[0].shape, [128, 172] + [0] * (world - 2)) + [
        (world - 1, Box((150, 0), (50, 256)))]
    for held in ([replicas] if world > 1 else []) + ([inside] if world > 2 else []):
        bad = TensorLayout(fulls[0].shape, fulls[0].dtype, held, [(0, Box((0, 0), (128, 128)))])
        mine = [_region(fulls[0], box).clone() for r, box in held if r == rank]
        _raises_everywhere(shardgather.InvalidArgumentError, "split one dim",
                           lambda: shardgather.reshard(
                               mine, [] if rank else [torch.empty(128, 128)],
                               [bad], group, timeout=T, quantize="fp8_e4m3_128x128"))




def check_pass_through(rank, world, group):
    """FP8 data held already (an FP8-trained model's shard: its data rows and the scales of
    every block they touch) travels as it is, beside a tensor quantized on send; scales that
    differ from a peer's for a block both hold, or of the wrong shape, raise on every rank."""
    from shardgather import quantized

    fmt = "fp8_e4m3_128x128"
    held = _values((300, 256), torch.bfloat16, seed=41)  # finite scales: x2 changes them
    other = _values((260, 128), torch.float32, seed=42)
    specs = [ShardSpec(held.dtype, held.shape, 0, _cuts(300, world, 43)),
             ShardSpec(other.dtype, other.shape, 0, _cuts(260, world, 44))]
    data, scales = reference(held, fmt)
    lo = sum(specs[0].sizes[:rank])
    n = specs[0].sizes[rank]
    k0, k1 = lo // 128, -(-(lo + n) // 128)
    given = (data[lo:lo + n], scales[k0:k1].clone())
    shards = [given, _shard(other, specs[1], rank, world)]
    got = shardgather.unshard(shards, specs, group, timeout=T, quantize=fmt)
    _same_bits(got[0][0], data)
    _same_bits(got[0][1], scales)
    want = reference(other, fmt)
    _same_bits(got[1][0], want[0])
    _same_bits(got[1][1], want[1])
    # The last rank with rows that share a block with another rank perturbs its copy.
    sharing = [r for r in range(world)
               if quantized._from_spec(0, quantized.Quantize(fmt), specs[0], world).cut_slabs(r)]
    if sharing:
        bad = given[1].clone()
        if rank == sharing[-1]:
            bad.mul_(2.0)
        _raises_everywhere(shardgather.InvalidArgumentError,
                           "given scales of a block shared with rank",
                           lambda: shardgather.unshard([(given[0], bad), shards[1]], specs,
                                                       group, timeout=T, quantize=fmt))
    # A tensor of 4 rows: ranks past the fourth hold none (FSDP's chunks of a small tensor).
    small = _values((4, 256), torch.bfloat16, seed=45)
    sdata, sscales = reference(small, fmt)
    sizes = shardgather.chunk_sizes(4, world)
    at = sum(sizes[:rank])
    pair = (sdata[at:at + sizes[rank]], sscales if sizes[rank] else sscales[:0])
    got = shardgather.unshard([pair], [ShardSpec(small.dtype, small.shape, 0)], group,
                              timeout=T, quantize=fmt)
    _same_bits(got[0][0], sdata)
    _same_bits(got[0][1], sscales)
    victim = max(r for r in range(world) if specs[0].sizes[r])
    wrong = (given[0], given[1][:0]) if rank == victim else given
    _raises_everywhere(shardgather.InvalidArgumentError, "passed through",
                       lambda: shardgather.unshard([wrong, shards[1]], specs, group, timeout=T,
                                                   quantize=fmt))
    got = shardgather.unshard(shards, specs, group, timeout=T, quantize=fmt)
    _same_bits(got[0][0], data)




def check_foreach_quantized(rank, world, group):
    """foreach_all_gather(quantize=): each index's tensors are one tensor's rows (cuts inside
    128-row blocks, ranks with none); out[i][r] is rank r's FP8 rows and the scales of the
    blocks they touch, or those rows dequantized; with and without the shapes hint, beside
    plain tensors of other shapes on every rank."""
    fulls = [_values((300, 256), torch.bfloat16, seed=51),
             _values((90, 64), torch.float32, seed=52, specials=True)]
    fulls[0][11, 3] = float("nan")
    cuts = [_cuts(300, world, 53), _cuts(90, world, 54)]
    fmts = ["fp8_e4m3_128x128", "mxfp8"]

    def rows(i, r):
        lo = sum(cuts[i][:r])
        return fulls[i][lo:lo + cuts[i][r]]

    def ragged(r):
        return torch.arange(r + 2, dtype=torch.int32)

    params = [rows(0, rank).clone(), ragged(rank), rows(1, rank).clone()]
    hint = [[tuple(rows(0, r).shape), tuple(ragged(r).shape), tuple(rows(1, r).shape)]
            for r in range(world)]
    for shapes in (hint, None):
        got = shardgather.foreach_all_gather(params, group, shapes_across_group=shapes,
                                             timeout=T, quantize=[fmts[0], None, fmts[1]])
        for r in range(world):
            assert torch.equal(got[1][r], ragged(r))
        for k, i in ((0, 0), (2, 1)):
            data, scales = reference(fulls[i], fmts[i])
            block = 128 if i == 0 else 1
            for r in range(world):
                lo, n = sum(cuts[i][:r]), cuts[i][r]
                _same_bits(got[k][r][0], data[lo:lo + n])
                if n:
                    _same_bits(got[k][r][1],
                               scales[lo // block:-(-(lo + n) // block)])
    deq = shardgather.foreach_all_gather(params, group, timeout=T,
                                         quantize={0: Quantize(fmts[0], torch.float32)})
    want = shardgather.quantization.dequantize(*reference(fulls[0], fmts[0]), fmts[0],
                                               torch.float32)
    for r in range(world):
        lo = sum(cuts[0][:r])
        _same_bits(deq[0][r], want[lo:lo + cuts[0][r]])
        _same_bits(deq[2][r], rows(1, r))  # not named: plain (NaN included)
    if world > 1:  # tensors that cannot form one tensor, quantized by name: refused everywhere
        odd = torch.zeros(2, 3 if rank == world - 1 else 4)
        _raises_everywhere(shardgather.InvalidArgumentError, "differ only along dim 0",
                           lambda: shardgather.foreach_all_gather([odd], group, timeout=T,
                                                                  quantize=["mxfp8"]))




def check_one_shot_quantized_calls(rank, world, group):
    """A one-shot quantized unshard is two calls: its agreement and one call of a quantized
    plan made for it; so is a started foreach_all_gather with the shapes hint (a blocking one
    on CPU tensors composes its agreement and payload, and here no amax exchange: MXFP8 blocks
    are never cut along dim 0). Started (async_op=True), the Work returns what the blocking
    call does."""
    comm = shardgather.communicator(group)
    full = _values((300, 256), torch.bfloat16, seed=71)
    sizes = _cuts(300, world, 72)
    spec = ShardSpec(full.dtype, full.shape, 0, sizes)
    mine = _shard(full, spec, rank, world)
    hint = [[(n, 256)] for n in sizes]
    data, scales = reference(full, "mxfp8")
    for async_op in (False, True):
        calls = comm.calls_issued
        got = shardgather.unshard([mine], [spec], group, timeout=T, quantize="mxfp8",
                                  async_op=async_op)
        every = shardgather.foreach_all_gather([mine], group, hint, timeout=T,
                                               quantize="mxfp8", async_op=async_op)
        if async_op:
            got, every = got.wait(), every.wait()
        if world > 1:
            assert comm.calls_issued - calls == 4, (rank, comm.calls_issued - calls)
        _same_bits(got[0][0], data)
        _same_bits(got[0][1], scales)
        for r in range(world):
            lo, n = sum(sizes[:r]), sizes[r]
            _same_bits(every[0][r][0], data[lo:lo + n])
            _same_bits(every[0][r][1], scales[lo:lo + n])  # a block is one row
    if world > 1:  # a started call on one rank only: its path differs, refused everywhere
        started = rank == world - 1
        _raises_everywhere(shardgather.MismatchError, "async_op differs",
                           lambda: shardgather.foreach_all_gather(
                               [mine], group, hint, timeout=T, quantize="mxfp8",
                               async_op=started))


def check_reshard_plan_quantized(rank, world, group):
    """A ReshardPlan made once with quantize, executed every step: each execute quantizes the
    sources' current values (a weight sync), bit-identical to the reference each time, also
    when started (async_op=True)."""
    from shardgather import quantized
    from shardgather.layouts import Box, TensorLayout

    full = _values((300, 256), torch.bfloat16, seed=61)
    fmt = "fp8_e4m3_128x128"
    src, dst = _cuts(300, world, 62), _cuts(300, world, 63)
    layout = TensorLayout(full.shape, full.dtype,
                          [(r, Box((sum(src[:r]), 0), (src[r], 256))) for r in range(world)],
                          [(r, Box((sum(dst[:r]), 0), (dst[r], 256))) for r in range(world)])
    plan = shardgather.ReshardPlan.for_group([layout], group, timeout=T, quantize=fmt)
    mine = full[sum(src[:rank]):sum(src[:rank + 1])].clone()
    box = layout.destinations[rank][1]
    out = (torch.empty(tuple(box.size), dtype=torch.float8_e4m3fn),
           torch.empty(quantized.scale_box(fmt, full.shape, box).size))
    for step in range(3):  # the third started (async_op): the same call, behind a Work
        if step == 1:  # every rank built its plan (step 0 was collective): none plans again
            planned = shardgather._C._plan_regions_runs()
        if step == 2:
            got = plan.execute([mine], [out], group, async_op=True).wait()
        else:
            got = plan.execute([mine], [out], group)
        assert len(got) == 1 and got[0] is out
        if world > 1:  # one call: its header, the cut blocks' maxima where any, the payload
            cut = plan._built().amax_row_bytes > 0
            assert plan.last_stats["payload_collectives"] == 1 + cut, plan.last_stats
            assert plan.last_stats["preflight_collectives"] == 1, plan.last_stats
        data, scales = reference(full, fmt)
        _same_bits(out[0], _region(data, box))
        _same_bits(out[1], _region(scales, quantized.scale_box(fmt, full.shape, box)))
        mine.mul_(-3.0)
        full.mul_(-3.0)
    assert shardgather._C._plan_regions_runs() == planned


def check_unshard_plan_quantized(rank, world, group):
    """UnshardPlan(quantize=...), made once and executed every step: the mixed list of
    check_unshard_bit_exact (cuts inside blocks along dim 0, 1 and the last, empty shards,
    plain tensors between), raw and dequantized, bit-identical to the references each step, also
    started (async_op) and with padded shards and dst; one call and no planning per execute."""
    cases = _case_tensors(world)
    specs = [spec for _, _, spec, _ in cases]
    fmts = [fmt for _, _, _, fmt in cases]
    out = torch.float32 if world % 2 else torch.bfloat16
    raw = shardgather.UnshardPlan(specs, world, rank, timeout=T, quantize=fmts)
    deq = shardgather.UnshardPlan(specs, world, rank, timeout=T,
                                  quantize=[fmt and Quantize(fmt, out) for fmt in fmts])
    # Padded shards (FSDP pads every shard to the largest) to one rank, run last; made here,
    # since a rank ahead making a plan would move the process-wide count of plannings.
    padded = []
    for s in specs:
        sizes = list(s.sizes) or shardgather.chunk_sizes(s.full_shape[s.shard_dim], world)
        padded.append(ShardSpec(s.dtype, s.full_shape, s.shard_dim, sizes, max(sizes)))
    dst = world - 1
    plan = shardgather.UnshardPlan(padded, world, rank, timeout=T, quantize=fmts, dst=dst)
    fulls = [full.clone() for _, full, _, _ in cases]
    for step in range(3):
        shards = [_shard(full, spec, rank, world) for full, spec in zip(fulls, specs)]
        if step == 1:  # every rank built its plans (step 0 was collective): none plans again
            planned = shardgather._C._plan_regions_runs()
        async_op = step == 2
        got_raw = raw.execute(shards, group, async_op=async_op)
        got_deq = deq.execute(shards, group, async_op=async_op)
        if async_op:
            got_raw, got_deq = got_raw.wait(), got_deq.wait()
        for i, (full, fmt) in enumerate(zip(fulls, fmts)):
            if fmt is None:
                assert torch.equal(got_raw[i], full) and torch.equal(got_deq[i], full), i
                continue
            data, scales = reference(full, fmt)
            _same_bits(got_raw[i][0], data)
            _same_bits(got_raw[i][1], scales)
            _same_bits(got_deq[i], shardgather.quantization.dequantize(data, scales, fmt, out))
        if world > 1:  # its header, the cut blocks' maxima, the payload: one call
            assert raw.last_stats["preflight_collectives"] == 1, raw.last_stats
            assert raw.last_stats["payload_collectives"] == 2, raw.last_stats
        for full in fulls:  # the next step's values
            if full.is_floating_point():
                full.mul_(-2.0)
    assert shardgather._C._plan_regions_runs() == planned
    shards = []
    for full, spec in zip(fulls, padded):
        rows = _shard(full, spec, rank, world)
        grown = list(rows.shape)
        grown[spec.shard_dim] = spec.padded_size
        pad = torch.zeros(grown, dtype=rows.dtype)
        pad.narrow(spec.shard_dim, 0, rows.shape[spec.shard_dim]).copy_(rows)
        shards.append(pad)
    got = plan.execute(shards, group)
    if rank != dst:
        assert got == [], got
        return
    for i, (full, fmt) in enumerate(zip(fulls, fmts)):
        if fmt is None:
            assert torch.equal(got[i], full), i
        else:
            data, scales = reference(full, fmt)
            _same_bits(got[i][0], data)
            _same_bits(got[i][1], scales)


def check_plans_quantizing_nothing(rank, world, group):
    """A single format over tensors it cannot quantize (1-d norms, integers): the plans are
    plain ones and move them as they are (an FSDP bucket of norms and biases)."""
    norm = torch.arange(4.0 * world)
    ids = torch.arange(3 * world, dtype=torch.int64)
    specs = [ShardSpec(norm.dtype, norm.shape, 0), ShardSpec(ids.dtype, ids.shape, 0)]
    shards = [_shard(norm, specs[0], rank, world), _shard(ids, specs[1], rank, world)]
    plan = shardgather.UnshardPlan(specs, world, rank, timeout=T, quantize="mxfp8")
    got = plan.execute(shards, group)
    assert torch.equal(got[0], norm) and torch.equal(got[1], ids)
    hint = [[(len(_shard(norm, specs[0], r, world)),), (len(_shard(ids, specs[1], r, world)),)]
            for r in range(world)]
    gather = shardgather.AllGatherPlan([norm.dtype, ids.dtype], hint, rank, timeout=T,
                                       quantize="fp8_e4m3_128x128")
    out = gather.execute(shards, group, async_op=True).wait()
    assert torch.equal(torch.cat(out[0]), norm) and torch.equal(torch.cat(out[1]), ids)


def check_plan_quantize_disagrees(rank, world, group):
    """RELIABILITY 2.8b for the quantized plans: UnshardPlan and AllGatherPlan whose quantize
    spec differs on the last rank (another format, or none): MismatchError on every rank before
    anything moves, and the group works afterwards."""
    if world == 1:
        return
    full = _values((300, 256), torch.bfloat16, seed=81)
    spec = ShardSpec(full.dtype, full.shape, 0, _cuts(300, world, 82))
    shard = _shard(full, spec, rank, world)
    hint = [[(n, 256)] for n in spec.sizes]
    last = rank == world - 1
    for theirs in ("mxfp8", None):
        q = theirs if last else "fp8_e4m3_128x128"
        for make in (lambda: shardgather.UnshardPlan([spec], world, rank, timeout=T, quantize=q),
                     lambda: shardgather.AllGatherPlan([full.dtype], hint, rank, timeout=T,
                                                       quantize=q)):
            plan = make()
            _raises_everywhere(shardgather.MismatchError, "differs",
                               lambda: plan.execute([shard], group))
        got = shardgather.unshard([shard], [spec], group, timeout=T)
        assert torch.equal(got[0], full)


def check_gather_plan_quantized(rank, world, group):
    """AllGatherPlan(quantize=...), made once: out[i][r] bit-identical to
    foreach_all_gather(quantize=...)'s (checked against the references in
    check_foreach_quantized), raw and dequantized, ragged plain tensors between, also started;
    one call and no planning per execute."""
    fulls = [_values((300, 256), torch.bfloat16, seed=71),
             _values((90, 64), torch.float32, seed=72, specials=True)]
    cuts = [_cuts(300, world, 73), _cuts(90, world, 74)]

    def rows(i, r):
        lo = sum(cuts[i][:r])
        return fulls[i][lo:lo + cuts[i][r]]

    ragged = [torch.arange(r + 2, dtype=torch.int32).reshape(1, r + 2) for r in range(world)]
    hint = [[tuple(rows(0, r).shape), tuple(ragged[r].shape), tuple(rows(1, r).shape)]
            for r in range(world)]
    dtypes = [torch.bfloat16, torch.int32, torch.float32]
    specs = [["fp8_e4m3_128x128", None, "mxfp8"],
             {0: Quantize("fp8_e4m3_128x128", torch.float32), 2: Quantize("mxfp8")}]
    plans = [shardgather.AllGatherPlan(dtypes, hint, rank, timeout=T, quantize=q)
             for q in specs]
    steps = []  # each step's params and the one-shot calls' results (those plan each time)
    for step in range(3):
        params = [rows(0, rank).clone(), ragged[rank], rows(1, rank).clone()]
        steps.append((params, [shardgather.foreach_all_gather(
            params, group, shapes_across_group=hint, timeout=T, quantize=q) for q in specs]))
        for f in fulls:
            f.mul_(-2.0)
    for step, (params, wants) in enumerate(steps):
        if step == 1:  # every rank built its plans (step 0 was collective): none plans again
            planned = shardgather._C._plan_regions_runs()
        for plan, want in zip(plans, wants):
            got = plan.execute(params, group, async_op=step == 2)
            if step == 2:
                got = got.wait()
            assert len(got) == 3 and all(len(row) == world for row in got)
            for i in range(3):
                for r in range(world):
                    g, w = got[i][r], want[i][r]
                    if isinstance(w, tuple):
                        _same_bits(g[0], w[0])
                        _same_bits(g[1], w[1])
                    else:
                        _same_bits(g, w)
            if world > 1:
                assert plan.last_stats["preflight_collectives"] == 1, plan.last_stats
                assert plan.last_stats["payload_collectives"] == 2, plan.last_stats
    assert shardgather._C._plan_regions_runs() == planned
    # ``out`` on the last rank only: refused on every rank, and the plan works afterwards.
    params = steps[0][0]
    _raises_everywhere(shardgather.InvalidArgumentError, "out is not taken",
                       lambda: plans[0].execute(params, group, out=torch.empty(8)
                                                if rank == world - 1 else None))
    assert len(plans[0].execute(params, group)) == 3


CHECKS = [check_unshard_bit_exact, check_one_spec_for_every_tensor, check_gather_to_one_rank,
          check_padded_shards, check_disagreement, check_bytes_on_the_wire,
          check_stream_quantized, check_export_fp8, check_export_fp8_has_one_writer,
          check_reshard_quantized, check_pass_through,
          check_foreach_quantized, check_one_shot_quantized_calls, check_reshard_plan_quantized,
          check_unshard_plan_quantized, check_gather_plan_quantized, check_plans_quantizing_nothing,
          check_plan_quantize_disagrees,
          check_export_mxfp8_names_what_a_loader_reads]
for _check in CHECKS:
    globals()[on_default_group(_check).__name__] = on_default_group(_check)
# full_tensors needs DTensors on a torch group: Gloo only.
CASES = ["case_" + c.__name__[len("check_"):] for c in CHECKS] + ["case_full_tensors_quantized"]
