"""Quantized transfers: ``unshard(..., quantize=...)`` quantizes on send, so that FP8 bytes
cross the wire and every receiver gets exactly the bytes that quantizing the unsharded tensor
gives (docs/quantization.md, "Quantized transfers").

How one call runs, every rank alike:

1. an agreement (``_agree.Agreement``): the specs, the quantize spec of every tensor and the
   options, so a spec that differs on one rank is a MismatchError on every rank before anything
   moves, and a bad argument on one rank an error on every rank;
2. each rank folds the absolute maxima of the blocks its shard touches (the host quantizer,
   over a window of the global tensor: the shard widened to block edges);
3. where a shard cut falls inside a block, the ranks sharing that block exchange their partial
   maxima: one small reshard of a table of them, point to point between those ranks only, and
   none at all when no cut falls inside a block;
4. each rank quantizes its shard with the agreed scales, and sends its FP8 bytes and the scales
   of the blocks that start in its shard, with the tensors that travel plain, in one unshard:
   one payload collective, exactly data + scales on the wire;
5. each receiver returns (data, scales), or dequantizes them to the asked dtype.

CPU tensors only (the quantizer is the host one); one call at a time (no ``async_op``).
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import _shardgather as _C
from ._agree import Agreement, InvalidArgumentError, InvalidTypeError
from .layouts import Box, TensorLayout

# (block rows, block cols) of each format; the rows only ever matter for 128 x 128.
_BLOCKS = {"fp8_e4m3_128x128": (128, 128), "fp8_e4m3_1x128": (1, 128), "mxfp8": (1, 32)}
_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
_OUTPUTS = (None, torch.float32, torch.bfloat16)


class Quantize(NamedTuple):
    """A tensor's quantization in a transfer: ``format`` (``"fp8_e4m3_128x128"``,
    ``"fp8_e4m3_1x128"`` or ``"mxfp8"``) and what the receiver gets: ``dequantize=None``, the
    raw ``(data, scales)`` (float8_e4m3fn data; float32 inverse scales, or float8_e8m0fnu for
    mxfp8), or a dtype (float32 or bfloat16) to get the dequantized tensor instead. A plain
    string means ``Quantize(format)``."""

    format: str
    dequantize: Optional[torch.dtype] = None


def _spec(value, what):
    """A :class:`Quantize`, or None, from what a caller gave."""
    if value is None or isinstance(value, Quantize):
        spec = value
    elif isinstance(value, str):
        spec = Quantize(value)
    else:
        raise InvalidTypeError("%s must be a format name, a Quantize or None, got %s"
                               % (what, type(value).__name__))
    if spec is not None and spec.format not in _BLOCKS:
        raise InvalidArgumentError("%s: unknown format %r (%s)"
                                   % (what, spec.format, ", ".join(_BLOCKS)))
    if spec is not None and spec.dequantize not in _OUTPUTS:
        raise InvalidArgumentError("%s: dequantize to %s (None, torch.float32 or "
                                   "torch.bfloat16)" % (what, spec.dequantize))
    return spec


def quantization_config(fmt):
    """The ``quantization_config`` of a model's ``config.json`` for a checkpoint in ``fmt``.
    For 128 x 128 blocks it is what Hugging Face's fine-grained FP8 loader and vLLM's ``fp8``
    method read; the 1 x 128 and MXFP8 ones only state their block shape and scale format in
    the same keys (no loader is known to read them as such)."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(_BLOCKS[fmt])}
    if fmt == "mxfp8":
        config["scale_fmt"] = "ue8m0"
    return config


def _why_not(fmt, dtype, shape):
    """Why ``fmt`` cannot quantize a tensor of this dtype and shape, or None when it can."""
    if dtype not in _INPUTS:
        return "a %s tensor (float32, bfloat16 or float16 only)" % dtype
    if not shape:
        return "a 0-d tensor"
    if fmt == "fp8_e4m3_128x128" and len(shape) != 2:
        return "a %d-d tensor (128 x 128 blocks need 2 dims)" % len(shape)
    if fmt == "mxfp8" and shape[-1] % 32:
        return "a last dim of %d (mxfp8 needs a multiple of 32)" % shape[-1]
    return None


def resolve(quantize, specs, names=None):
    """One spec (or None) per tensor from the ``quantize`` argument: a single spec applies to
    every tensor it can quantize (the others travel plain); a list (one entry per tensor) or a
    dict from name (or, without names, index) to spec names each one, and a spec that cannot
    apply is an error."""
    n = len(specs)
    if quantize is None or isinstance(quantize, (str, Quantize)):
        spec = _spec(quantize, "quantize")
        if spec is None:
            return [None] * n
        return [None if _why_not(spec.format, s.dtype, tuple(s.full_shape)) else spec
                for s in specs]
    keys = list(range(n)) if names is None else list(names)
    if isinstance(quantize, dict):
        where = {k: i for i, k in enumerate(keys)}
        bad = [k for k in quantize if isinstance(k, bool) or k not in where]
        if bad:
            raise InvalidArgumentError("quantize: key %r is not %s" % (
                bad[0], "a tensor index in [0, %d)" % n if names is None else "a tensor's name"))
        given = [quantize.get(k) for k in keys]
    elif isinstance(quantize, (list, tuple)):
        if len(quantize) != n:
            raise InvalidArgumentError("quantize: %d entries for %d tensors" % (len(quantize), n))
        given = list(quantize)
    else:
        raise InvalidTypeError("quantize must be a format name, a Quantize, a list or a dict, "
                               "got %s" % type(quantize).__name__)
    out = []
    for key, value, s in zip(keys, given, specs):
        what = "quantize[%r]" % (key,)
        spec = _spec(value, what)
        why = spec and _why_not(spec.format, s.dtype, tuple(s.full_shape))
        if why:
            raise InvalidArgumentError("%s: %s cannot quantize %s" % (what, spec.format, why))
        out.append(spec)
    return out


def _text(spec):
    return None if spec is None else [spec.format, str(spec.dequantize)]


@dataclass
class _Tensor:
    """One quantized tensor's arithmetic, the same on every rank (a function of the specs)."""

    index: int
    spec: Quantize
    shape: tuple
    dim: int
    sizes: list  # every rank's real rows along dim
    offsets: list  # where each rank's rows start
    block: int  # the block's extent along dim (1: no cut can fall inside a block)
    scale_shape: tuple
    column: int = 0  # where its slots start in the amax table

    @property
    def slot(self):
        """Amaxes in one slab of blocks along dim (a slab: the blocks at one index along it)."""
        n = 1
        for k, s in enumerate(self.scale_shape):
            n *= 1 if k == self.dim else s
        return n

    def first_slab(self, r):
        return self.offsets[r] // self.block

    def last_slab(self, r):
        return (self.offsets[r] + self.sizes[r] - 1) // self.block

    def slab_end(self, k):
        return min((k + 1) * self.block, self.shape[self.dim])

    def cut_slabs(self, r):
        """[(slot, slab)]: the slabs rank r shares with other ranks (0: its first, 1: its last)."""
        if self.sizes[r] == 0 or self.block == 1:
            return []
        lo, hi = self.offsets[r], self.offsets[r] + self.sizes[r]
        k0, k1 = self.first_slab(r), self.last_slab(r)
        out = []
        if lo > k0 * self.block or hi < self.slab_end(k0):
            out.append((0, k0))
        if k1 != k0 and hi < self.slab_end(k1):
            out.append((1, k1))
        return out

    def sharers(self, k, but):
        """The ranks other than ``but`` whose rows meet slab k, with their slot for it."""
        lo, hi = k * self.block, self.slab_end(k)
        return [(q, 0 if self.first_slab(q) == k else 1)
                for q in range(len(self.sizes)) if q != but and self.sizes[q]
                and self.offsets[q] < hi and self.offsets[q] + self.sizes[q] > lo]

    def owned(self, r):
        """The slabs whose first row lies in rank r's rows: the scales rank r sends."""
        b, lo, n = self.block, self.offsets[r], self.sizes[r]
        return -(-(lo + n) // b) - -(-lo // b)

    def window(self, r):
        """(offset along dim, shape) of rank r's rows widened to block edges."""
        lo = self.first_slab(r) * self.block
        hi = self.slab_end(self.last_slab(r))
        shape = list(self.shape)
        shape[self.dim] = hi - lo
        return lo, shape


def _scale_shape(fmt, shape):
    rows, cols = _BLOCKS[fmt]
    if fmt == "fp8_e4m3_128x128":
        return (-(-shape[0] // rows), -(-shape[1] // cols))
    return tuple(shape[:-1]) + (-(-shape[-1] // cols),)


def _plan_tensor(i, spec, s, world):
    shape = tuple(s.full_shape)
    dim = s.shard_dim % len(shape)
    sizes = list(s.sizes) or _C.chunk_sizes(shape[dim], world)
    offsets = [sum(sizes[:r]) for r in range(world)]
    rows, cols = _BLOCKS[spec.format]
    block = cols if dim == len(shape) - 1 else (rows if spec.format == "fp8_e4m3_128x128" else 1)
    return _Tensor(i, spec, shape, dim, sizes, offsets, block,
                   _scale_shape(spec.format, shape))


def _real_rows(shard, t, rank):
    return shard.narrow(t.dim, 0, t.sizes[rank])


def _check_shard(shard, s, t, rank, world):
    """The checks the quantizer needs before it reads a shard (the unshard checks the rest)."""
    if not isinstance(shard, torch.Tensor):
        raise InvalidTypeError("shards[%d] must be a tensor, got %s"
                               % (t.index, type(shard).__name__))
    if shard.device.type != "cpu":
        raise InvalidArgumentError("shards[%d]: quantize runs on CPU tensors (the host "
                                   "quantizer), got one on %s" % (t.index, shard.device))
    want = list(t.shape)
    want[t.dim] = s.padded_size or t.sizes[rank]
    if list(shard.shape) != want or shard.dtype != s.dtype:
        raise InvalidArgumentError(
            "shards[%d] on rank %d: %s %s, the spec wants %s %s (world %d)"
            % (t.index, rank, shard.dtype, list(shard.shape), s.dtype, want, world))


def unshard(shards, specs, comm, quantize, *, strategy, preflight, timeout, async_op, dst):
    """shardgather.unshard with ``quantize`` given (see the module)."""
    quantizer, sent = encode(shards, specs, comm, quantize, timeout=timeout,
                             options=[("dst", dst), ("strategy", strategy)], async_op=async_op)
    got = _C.unshard(sent, comm, quantizer.payload_specs, strategy, preflight, timeout, False,
                     dst)
    return quantizer.outputs(got) if got else got


def encode(shards, specs, comm, quantize, *, timeout=None, options=(), async_op=False):
    """Steps 1 to 4 of the module, collective over ``comm``: (the :class:`Quantizer`, what this
    rank sends in the payload). ``options``: (name, int or None) pairs that every rank must
    pass alike, agreed on with the specs."""
    agreement = Agreement("unshard")
    quantizer = agree(agreement, comm, lambda: (None, list(shards), list(specs)), quantize,
                      async_op)
    agreement.options = list(options)
    agreement.run(comm, timeout)
    return quantizer, quantizer.encode(list(shards), comm, timeout)


def agree(agreement, comm, inputs, quantize, async_op=False, raw_only=False):
    """Adds a quantized transfer's checks to ``agreement`` (before its ``run``): ``inputs()``
    gives (names or None, shards, specs); returns the :class:`Quantizer` (None where a check
    failed: ``run`` then raises on every rank). ``raw_only``: a spec may not ask to
    dequantize (streams yield data and scales as they arrive)."""
    def build():
        names, shards, specs = inputs()
        if not all(isinstance(s, _C.ShardSpec) for s in specs):
            raise InvalidTypeError("specs must be a list of ShardSpec")
        agreement.specs = specs
        if async_op:
            raise InvalidArgumentError("quantize: async_op=True is not supported yet")
        quantizer = Quantizer(names, shards, specs, quantize, comm.rank, comm.size)
        if raw_only and any(q is not None and q.dequantize for q in quantizer.specs_q):
            raise InvalidArgumentError("quantize: %s yields the FP8 data and scales as they "
                                       "arrive; dequantize is for unshard" % agreement.what)
        return quantizer

    quantizer = agreement.capture(build)
    agreement.quantize = None if quantizer is None else [_text(q) for q in quantizer.specs_q]
    return quantizer


class Quantizer:
    """One quantized transfer's plan, the same on every rank but for ``rank``: which tensors are
    quantized (``specs_q``), what the payload carries (``payload_specs``; with names,
    ``payload_names``: a quantized tensor ``w`` travels as ``w`` and ``w_scale_inv``, or
    ``w_scale`` for mxfp8's E8M0 scales), and the arithmetic of each quantized tensor."""

    def __init__(self, names, shards, specs, quantize, rank, world):
        if len(shards) != len(specs):
            raise InvalidArgumentError("%d shards for %d specs" % (len(shards), len(specs)))
        for i, s in enumerate(specs):
            _check_spec(i, s, world)
        self.specs_q = resolve(quantize, specs, names)
        self.rank = rank
        self._staging = None
        self.tensors = [_plan_tensor(i, q, s, world)
                        for i, (q, s) in enumerate(zip(self.specs_q, specs)) if q is not None]
        for t in self.tensors:
            _check_shard(shards[t.index], specs[t.index], t, rank, world)
        column = 0
        for t in self.tensors:
            if any(t.cut_slabs(r) for r in range(world)):
                t.column = column
                column += 2 * t.slot
        by_index = {t.index: t for t in self.tensors}
        taken = set() if names is None else {str(n) for n in names}
        self.payload_specs, self.payload_names, self.views = [], [], {}
        for i, s in enumerate(specs):
            t = by_index.get(i)
            name = None if names is None else names[i]
            if t is None:
                self.payload_specs.append(s)
                self.payload_names.append(name)
                continue
            self.payload_specs += _payload_specs(t)
            if names is None:
                continue
            scale = "%s_scale%s" % (name, "" if t.spec.format == "mxfp8" else "_inv")
            if scale in taken:
                raise InvalidArgumentError("quantize: the scales of %r would be named %r, "
                                           "which is a tensor of its own" % (name, scale))
            self.payload_names += [name, scale]
            self.views[name] = torch.float8_e4m3fn
            if t.spec.format == "mxfp8":
                self.views[scale] = torch.float8_e8m0fnu

    def encode(self, shards, comm, timeout):
        """Steps 2 to 4 of the module, collective over ``comm``: the payload this rank sends
        (a quantized tensor's FP8 bytes as uint8 and its owned scales; plain tensors as they
        are), from the shards' current values. The FP8 bytes go into one buffer that the
        quantizer keeps and reuses on its next encode (a stream's every iteration): the
        payload of the previous encode must be done with by then."""
        rank = self.rank
        if self._staging is None:
            self._staging = _C._host_staging(sum(_rows_numel(t, rank) for t in self.tensors))
        at = 0
        amax = {t.index: _C._fold_amax(_real_rows(shards[t.index], t, rank), t.spec.format,
                                       t.window(rank)[1], _in_window(t, rank))
                for t in self.tensors if t.sizes[rank]}
        _agree_amax(self.tensors, amax, comm, timeout)
        by_index = {t.index: t for t in self.tensors}
        sent = []
        for i, shard in enumerate(shards):
            t = by_index.get(i)
            if t is None:
                sent.append(shard)
                continue
            n = _rows_numel(t, rank)
            sent += _encode(t, shard, amax.get(i), rank, self._staging[at:at + n])
            at += n
        return sent

    def outputs(self, got):
        """The receiver's entries from the payload's: (data, scales) or dequantized."""
        return _outputs(got, self.specs_q)


def _check_spec(i, s, world):
    """What the quantizer's arithmetic reads of a spec, checked as the unshard checks it."""
    ndim = len(s.full_shape)
    if ndim and not -ndim <= s.shard_dim < ndim:
        raise InvalidArgumentError("specs[%d]: shard_dim %d of a %d-d tensor"
                                   % (i, s.shard_dim, ndim))
    if not ndim:
        return
    full = s.full_shape[s.shard_dim % ndim]
    sizes = list(s.sizes) or _C.chunk_sizes(full, world)
    if len(sizes) != world or min(sizes) < 0 or sum(sizes) != full:
        raise InvalidArgumentError("specs[%d]: sizes %s for %d rows over %d ranks"
                                   % (i, sizes, full, world))
    if s.padded_size and s.padded_size < max(sizes):
        raise InvalidArgumentError("specs[%d]: padded_size %d < the largest shard %d"
                                   % (i, s.padded_size, max(sizes)))


def _in_window(t, rank):
    offset = [0] * len(t.shape)
    offset[t.dim] = t.offsets[rank] - t.window(rank)[0]
    return offset


def _slab(amax, t, slot):
    return amax.select(t.dim, 0 if slot == 0 else amax.shape[t.dim] - 1)


def _agree_amax(tensors, amax, comm, timeout):
    """Step 3 of the module: the partial maxima of shared blocks, exchanged between the ranks
    that share them (one reshard of a [world, K] table, where rank r's row holds, per tensor,
    the slabs it shares: its first and its last), then combined by max (a NaN wins)."""
    rank, world = comm.rank, comm.size
    width = sum(2 * t.slot for t in tensors if any(t.cut_slabs(r) for r in range(world)))
    if width == 0:
        return
    row = torch.zeros(1, width)
    for t in tensors:
        for slot, _ in t.cut_slabs(rank):
            start = t.column + slot * t.slot
            row[0, start:start + t.slot] = _slab(amax[t.index], t, slot).reshape(-1)
    wanted = []  # (tensor, my slot, box) per piece this rank receives
    destinations = []
    for r in range(world):
        for t in tensors:
            for slot, k in t.cut_slabs(r):
                for q, theirs in t.sharers(k, r):
                    box = Box((q, t.column + theirs * t.slot), (1, t.slot))
                    destinations.append((r, box))
                    if r == rank:
                        wanted.append((t, slot, box))
    layout = TensorLayout((world, width), torch.float32,
                          [(q, Box((q, 0), (1, width))) for q in range(world)], destinations)
    from . import ReshardPlan  # the package imports this module

    plan = ReshardPlan([layout], world, rank, preflight=False, timeout=timeout)
    order = {(tuple(o), tuple(n)): k for k, (_, o, n) in enumerate(plan.destination_boxes)}
    pieces = [torch.empty(1, t.slot) for t, _, _ in wanted]
    ordered = [None] * len(wanted)
    for piece, (_, _, box) in zip(pieces, wanted):
        ordered[order[(tuple(box.offset), tuple(box.size))]] = piece
    plan.execute([row], ordered, comm)
    for piece, (t, slot, _) in zip(pieces, wanted):
        view = _slab(amax[t.index], t, slot)
        view.copy_(torch.maximum(view, piece.reshape(view.shape)))


def _rows_numel(t, rank):
    n = t.sizes[rank]
    for d, s in enumerate(t.shape):
        n *= 1 if d == t.dim else s
    return n


def _encode(t, shard, amax, rank, out):
    """[FP8 bytes of the real rows (into ``out``, flat), the scales of the slabs that start in
    them]."""
    if amax is None:  # no rows: nothing to send
        empty = list(t.shape)
        empty[t.dim] = 0
        scales = list(t.scale_shape)
        scales[t.dim] = 0
        return [torch.empty(empty, dtype=torch.uint8),
                torch.empty(scales, dtype=torch.uint8 if t.spec.format == "mxfp8"
                            else torch.float32)]
    rows = _real_rows(shard, t, rank)
    data, scales = _C._quantize_box(rows, t.spec.format, t.window(rank)[1], _in_window(t, rank),
                                    amax, out.view(rows.shape))
    n = t.owned(rank)
    return [data, scales.narrow(t.dim, scales.shape[t.dim] - n, n)]


def _payload_specs(t):
    world = len(t.sizes)
    scale_dtype = torch.uint8 if t.spec.format == "mxfp8" else torch.float32
    return [_C.ShardSpec(torch.uint8, list(t.shape), t.dim, list(t.sizes), 0),
            _C.ShardSpec(scale_dtype, list(t.scale_shape), t.dim,
                         [t.owned(r) for r in range(world)], 0)]


def _outputs(got, specs_q):
    out, k = [], 0
    for spec in specs_q:
        if spec is None:
            out.append(got[k])
            k += 1
            continue
        data, scales = got[k], got[k + 1]
        k += 2
        if spec.dequantize is not None:
            out.append(_C._dequantize(data, scales, spec.format, spec.dequantize))
            continue
        if spec.format == "mxfp8":
            scales = scales.view(torch.float8_e8m0fnu)
        out.append((data.view(torch.float8_e4m3fn), scales))
    return out
