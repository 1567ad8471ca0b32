"""Quantized transfers: ``unshard(..., quantize=...)`` quantizes on send, so that FP8 bytes
cross the wire and every receiver gets exactly the bytes that quantizing the unsharded tensor
gives (docs/quantization.md, "Quantized transfers").

The one-shot ``unshard``, ``full_tensors``, and ``foreach_all_gather`` on CUDA tensors or
started, are an agreement (step 1 below) and one call of a quantized plan made for the call (the
C++ quantize stage: CPU or CUDA tensors, ``async_op``); the stream and the export, one call of
such a plan per bucket (C++ ``UnshardStream``). An unshard of FP8 data passed through and a
blocking foreach_all_gather on CPU tensors run, every rank alike:

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

These take CPU tensors only (the quantizer is the host one); one call at a time (no
``async_op``).
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import _shardgather as _C
from ._agree import Agreement, InvalidArgumentError, InvalidTypeError
from ._groups import _setup_timeout, communicator
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


class Described:
    """What resolve() reads of a spec: a dtype and the full shape (a layout's, a DTensor's, or
    the one the ranks' rows form)."""

    def __init__(self, dtype, shape):
        self.dtype, self.full_shape = dtype, tuple(shape)


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


def quantization_config(fmt, plain_modules=()):
    """The ``quantization_config`` of a model's ``config.json`` for a checkpoint in ``fmt``
    (docs/quantization.md, "What a loader reads"):

    - 128 x 128: ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]``, what Hugging
      Face's fine-grained FP8 loader and vLLM's ``fp8`` method read (``w`` and
      ``w_scale_inv``);
    - MXFP8: ``quant_method: "mxfp8"``, what vLLM reads as a ModelOpt / MiniMax MXFP8
      checkpoint (``w`` and ``w_scale``, E8M0, one per 32 elements along the last dim);
    - 1 x 128: the fp8 keys with ``weight_block_size: [1, 128]``, which transformers' config
      accepts but no known loader's kernels run.

    ``plain_modules``: the modules whose weights stay in high precision, listed as
    ``ignored_layers`` and ``modules_to_not_convert`` (vLLM reads either, transformers the
    second) when there are any."""
    config = {"quant_method": "mxfp8" if fmt == "mxfp8" else "fp8", "fmt": "e4m3",
              "activation_scheme": "dynamic", "weight_block_size": list(_BLOCKS[fmt])}
    if fmt == "mxfp8":
        config["scale_fmt"] = "ue8m0"
    if plain_modules:
        config["ignored_layers"] = sorted(plain_modules)
        config["modules_to_not_convert"] = sorted(plain_modules)
    return config


def _why_not(fmt, dtype, shape):
    """Why ``fmt`` cannot quantize a tensor of this dtype and shape, or None when it can."""
    if dtype not in _INPUTS:
        return "a %s tensor (float32, bfloat16 or float16 only)" % dtype
    if not shape:
        return "a 0-d tensor"
    if 0 in shape:
        return "an empty tensor"
    if fmt == "fp8_e4m3_128x128" and len(shape) != 2:
        return "a %d-d tensor (128 x 128 blocks need 2 dims)" % len(shape)
    if fmt == "mxfp8" and shape[-1] % 32:
        return "a last dim of %d (mxfp8 needs a multiple of 32)" % shape[-1]
    return None


def resolve(quantize, specs, names=None):
    """One spec (or None) per tensor from the ``quantize`` argument: a single spec applies to
    every tensor of 2 or more dims it can quantize (the others travel plain); a list (one entry
    per tensor) or a
    dict from name (or, without names, index) to spec names each one, and a spec that cannot
    apply is an error."""
    n = len(specs)
    if quantize is None or isinstance(quantize, (str, Quantize)):
        spec = _spec(quantize, "quantize")
        if spec is None:
            return [None] * n
        # A model's weights, not its 1-d norms and biases (which FP8 checkpoints and engines
        # keep in high precision): those are quantized only where named.
        return [None if len(s.full_shape) < 2 or _why_not(spec.format, s.dtype,
                                                           tuple(s.full_shape)) else spec
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


def scale_name(name, fmt):
    """What the scales of a quantized tensor ``name`` are called: ``name_scale_inv`` (float32
    inverse scales), or ``name_scale`` for mxfp8's E8M0 scales, as FP8 checkpoints name them."""
    return "%s_scale%s" % (name, "" if fmt == "mxfp8" else "_inv")


def _text(spec):
    return [spec.format, str(spec.dequantize)]


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


def _blocks(fmt, ndim):
    """The block's extent along each dim of an ndim-d tensor."""
    rows, cols = _BLOCKS[fmt]
    extent = [1] * ndim
    extent[-1] = cols
    if fmt == "fp8_e4m3_128x128":
        extent[0] = rows
    return extent


def _plan_tensor(i, spec, shape, dim, sizes, offsets):
    return _Tensor(i, spec, tuple(shape), dim, list(sizes), list(offsets),
                   _blocks(spec.format, len(shape))[dim], _scale_shape(spec.format, shape))


def _from_spec(i, spec, s, world):
    shape = tuple(s.full_shape)
    dim = s.shard_dim % len(shape)
    sizes = list(s.sizes) or _C.chunk_sizes(shape[dim], world)
    return _plan_tensor(i, spec, shape, dim, sizes, [sum(sizes[:r]) for r in range(world)])


def scale_box(fmt, shape, box):
    """The box of the scale tensor that holds the scales of every block a box of a tensor of
    ``shape`` touches: what a quantized reshard's destination receives with its data."""
    offset, size = box
    lo, n = [], []
    for o, k, b in zip(offset, size, _blocks(fmt, len(shape))):
        lo.append(o // b)
        n.append(0 if k == 0 else -(-(o + k) // b) - o // b)
    return Box(tuple(lo), tuple(n))


def _real_rows(shard, t, rank):
    return shard.narrow(t.dim, 0, t.sizes[rank])


def _check_shard(shard, dtype, padded, t, rank, world, what="shards"):
    """The checks the quantizer needs before it reads a shard (the transfer checks the rest)."""
    if not isinstance(shard, torch.Tensor):
        raise InvalidTypeError("%s[%d] must be a tensor, got %s"
                               % (what, t.index, type(shard).__name__))
    if shard.device.type != "cpu":
        raise InvalidArgumentError("%s[%d]: quantize runs on CPU tensors (the host "
                                   "quantizer), got one on %s" % (what, t.index, shard.device))
    want = list(t.shape)
    want[t.dim] = padded or t.sizes[rank]
    if list(shard.shape) != want or shard.dtype != dtype:
        raise InvalidArgumentError(
            "%s[%d] on rank %d: %s %s, the layout wants %s %s (world %d)"
            % (what, t.index, rank, shard.dtype, list(shard.shape), dtype, want, world))


# The steps of each quantized entry point, as their calls' stages name them (shardgather's
# Stage: the pre-flight header carries it, so that no step pairs with another rank's other call).
UNSHARD = "unshard(quantize)"
RESHARD = "ReshardPlan(quantize)"
FOREACH = "foreach_all_gather(quantize)"


def unshard(shards, specs, comm, quantize, *, strategy, preflight, timeout, async_op, dst):
    """shardgather.unshard with ``quantize`` given (see the module): an agreement, then one
    call of a one-shot UnshardPlan(quantize=...); where a shard is passed through (FP8 data
    and its scales), the steps of the module, on the host."""
    if _passes_through(shards):
        return _unshard_given(shards, specs, comm, quantize, strategy=strategy,
                              preflight=preflight, timeout=timeout, async_op=async_op, dst=dst)
    agreement = Agreement("unshard", UNSHARD + ": agreement")
    agreement.capture(lambda: check_keywords(timeout=timeout, strategy=strategy,
                                             preflight=preflight, async_op=async_op, dst=dst,
                                             world=comm.size))
    plan = agreement.capture(lambda: _unshard_plan(agreement, shards, specs, quantize, comm,
                                                   strategy=strategy, preflight=preflight,
                                                   timeout=timeout, dst=dst))
    valid = agreement.error is None
    agreement.options = [(k, v if valid else None) for k, v in
                         (("dst", dst), ("strategy", strategy), ("preflight", preflight))]
    agreement.run(comm, _setup_timeout(timeout))
    return plan.execute(shards, comm, async_op=async_op)


def _passes_through(shards):
    return isinstance(shards, (list, tuple)) and any(
        isinstance(s, tuple) and len(s) == 2 for s in shards)


def _unshard_plan(agreement, shards, specs, quantize, comm, **options):
    """The one-shot UnshardPlan, its specs and quantize specs told to ``agreement``; or the
    first argument error."""
    from ._ops import UnshardPlan  # _ops imports this module

    specs = list(specs)
    if not all(isinstance(s, _C.ShardSpec) for s in specs):
        raise InvalidTypeError("specs must be a list of ShardSpec")
    agreement.specs = specs
    if len(shards) != len(specs):
        raise InvalidArgumentError("%d shards for %d specs" % (len(shards), len(specs)))
    plan = UnshardPlan(specs, comm.size, comm.rank, quantize=quantize,
                       _stage=UNSHARD + ": payload", **options)
    plan._built()  # its argument error, raised here, is the agreement's
    specs_q = resolve(quantize, plan._plan.specs)
    agreement.quantize = [None if q is None else _text(q) for q in specs_q]
    return plan


def _unshard_given(shards, specs, comm, quantize, *, strategy, preflight, timeout, async_op,
                   dst):
    quantizer, sent = encode(shards, specs, comm, quantize, timeout=timeout,
                             options=[("dst", dst), ("strategy", strategy),
                                      ("preflight", preflight)], async_op=async_op)
    if quantizer.passthrough:  # its header is where a disagreement of given scales travels
        preflight = True
    stage = UNSHARD + ": payload"
    if quantizer.disagreement is not None:
        _C._fail_call(comm, "unshard", quantizer.disagreement, False, True,
                      _setup_timeout(timeout), stage)
    got = _C.unshard(sent, comm, quantizer.payload_specs, strategy, preflight, timeout, False,
                     dst, stage)
    return quantizer.outputs(got) if got else got


def check_keywords(*, timeout=None, strategy="auto", preflight=True, async_op=False,
                   dst=None, world=None):
    """The keywords' types and domains, as an agreement's step (every rank hears of a bad one
    before anything moves)."""
    from numbers import Real

    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, Real)):
        raise InvalidTypeError("timeout must be a number of seconds or None, got %s"
                               % type(timeout).__name__)
    if timeout is not None and not timeout >= 0:
        raise InvalidArgumentError("timeout must be >= 0, got %s" % timeout)
    if not isinstance(strategy, str):
        raise InvalidTypeError("strategy must be a str, got %s" % type(strategy).__name__)
    for name, value in (("preflight", preflight), ("async_op", async_op)):
        if not isinstance(value, bool):
            raise InvalidTypeError("%s must be a bool, got %s" % (name, type(value).__name__))
    if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int)
                            or not 0 <= dst < world):
        raise InvalidArgumentError("dst must be a rank of the group's %d, or None, got %r"
                                   % (world, dst))


def encode(shards, specs, comm, quantize, *, timeout=None, options=(), async_op=False):
    """Steps 1 to 4 of the module, collective over ``comm``: (the :class:`Quantizer`, what this
    rank sends in the payload). ``options``: (name, int or None) pairs that every rank must
    pass alike, agreed on with the specs."""
    agreement = Agreement("unshard", UNSHARD + ": agreement")
    agreement.capture(lambda: check_keywords(timeout=timeout, async_op=async_op,
                                             **dict(options), world=comm.size))
    if async_op is True:
        agreement.fail(InvalidArgumentError, "quantize: async_op=True is not supported with "
                       "FP8 data passed through")
    quantizer = agree(agreement, comm, lambda: (None, list(shards), list(specs)), quantize,
                      op=UNSHARD)
    valid = agreement.error is None
    agreement.options = [(k, v if valid else None) for k, v in options]
    agreement.run(comm, _setup_timeout(timeout))
    return quantizer, quantizer.encode(list(shards), comm, timeout)


def agree(agreement, comm, inputs, quantize, *, op):
    """Adds a quantized transfer's checks to ``agreement`` (before its ``run``): ``inputs()``
    gives (names or None, shards, specs); returns the :class:`Quantizer` (None where a check
    failed: ``run`` then raises on every rank). ``op`` names the entry point in the stages of
    the quantizer's own calls (``"<op>: amax"``)."""
    def build():
        names, shards, specs = inputs()
        if not all(isinstance(s, _C.ShardSpec) for s in specs):
            raise InvalidTypeError("specs must be a list of ShardSpec")
        agreement.specs = specs
        return Quantizer(names, shards, specs, quantize, comm.rank, comm.size, op=op)

    quantizer = agreement.capture(build)
    agreement.quantize = None if quantizer is None else [
        _text(q) + (["passed through"] if i in quantizer.passthrough else [])
        if q is not None else None for i, q in enumerate(quantizer.specs_q)]
    return quantizer


class _Encoder:
    """The send side every quantized transfer shares: ``tensors`` (the :class:`_Tensor` of each
    quantized one) and this rank; ``encode_quantized`` folds, agrees and quantizes. ``op``
    names the entry point in the stage of the amax exchange (``"<op>: amax"``), whose plan is
    made once and reused by every encode."""

    def __init__(self, tensors, rank, world, passthrough=(), *, op):
        self.tensors, self.rank, self.world, self.op = tensors, rank, world, op
        self.passthrough = set(passthrough)  # indices whose shards are (FP8 data, scales)
        self.disagreement = None  # pass-through scales that differ from a peer's (a message)
        self._amax = None  # ((timeout, preflight), the amax exchange's plan or None)
        # Allocated here, inside the agreement's step, so that running out of memory is an
        # error every rank hears of.
        self._staging = _C._host_staging(sum(_rows_numel(t, rank) for t in tensors
                                             if t.index not in self.passthrough))
        column = 0
        for t in tensors:
            if any(t.cut_slabs(r) for r in range(world)):
                t.column = column
                column += 2 * t.slot

    def encode_quantized(self, shards, comm, timeout):
        """{tensor index: [FP8 bytes of this rank's rows, the scales of the blocks that start
        in them]} from ``shards`` (indexable by tensor index), collective over ``comm``. The
        FP8 bytes go into one buffer that the encoder keeps and reuses on its next encode (a
        stream's every iteration): the payload of the previous encode must be done with by
        then. The amax exchange always sends its header: it is the first call of a stream's
        later runs, where nothing else has agreed the step (a headerless exchange there could
        pair with a peer's other call)."""
        rank = self.rank
        amax, bad = {}, set()
        for t in self.tensors:
            if not t.sizes[rank]:
                continue
            window = t.window(rank)[1]
            if not _still_fits(shards[t.index], t, rank, t.index in self.passthrough):
                # A shard changed since the plan was checked (a stream's): it joins the
                # exchange with nothing and travels as it is, so that the payload call's own
                # check of it raises on every rank.
                bad.add(t.index)
                amax[t.index] = torch.zeros(_scale_shape(t.spec.format, window))
            elif t.index in self.passthrough:  # the table carries the given scales, to compare
                amax[t.index] = _scales_as_f32(shards[t.index][1], t)
            else:
                amax[t.index] = _C._fold_amax(_real_rows(shards[t.index], t, rank),
                                              t.spec.format, window, _in_window(t, rank))
        self.disagreement = None
        _agree_amax(self.tensors, self.amax_plan(timeout), amax, comm, self._compare)
        out, at = {}, 0
        for t in self.tensors:
            n = 0 if t.index in self.passthrough else _rows_numel(t, rank)
            if t.index in bad:
                out[t.index] = [shards[t.index] if isinstance(shards[t.index], torch.Tensor)
                                else torch.empty(0), torch.empty(0)]
            elif t.index in self.passthrough:
                out[t.index] = _pass_through(t, shards[t.index], rank)
            else:
                shard = shards[t.index] if t.sizes[rank] else None
                out[t.index] = _encode(t, shard, amax.get(t.index), rank,
                                       self._staging[at:at + n])
            at += n
        return out

    def amax_plan(self, timeout, hosts=None):
        """The amax exchange: (its ReshardPlan, what each destination box is), or None where
        no cut falls inside a block; planned on first use and kept (per timeout, which a plan
        fixes)."""
        if self._amax is None or self._amax[0] != timeout:
            self._amax = (timeout, _amax_plan(self.tensors, self.world, self.rank, timeout,
                                              self.op + ": amax", hosts))
        return self._amax[1]

    def _compare(self, t, slot, mine, theirs, peer):
        """Pass-through: the scales a peer gave for a block both hold must be these, bit for
        bit (the first difference is kept for the payload call to report on every rank)."""
        if t.index not in self.passthrough:
            return False
        differ = mine.view(torch.int32) != theirs.view(torch.int32)
        if self.disagreement is None and bool(differ.any()):
            at = int(differ.reshape(-1).nonzero()[0])
            self.disagreement = (
                "quantize[%d]: given scales of a block shared with rank %d differ (%.9g here, "
                "%.9g there; block %d of the slab along dim %d)"
                % (t.index, peer, mine.reshape(-1)[at].item(), theirs.reshape(-1)[at].item(),
                   at, t.dim))
        return True


class Quantizer(_Encoder):
    """One quantized transfer's plan (an unshard of FP8 data passed through), the same on every
    rank but for ``rank``: which tensors are quantized (``specs_q``), what the payload carries
    (``payload_specs``: a quantized tensor's data, then its scales), and the arithmetic of each
    quantized tensor."""

    def __init__(self, names, shards, specs, quantize, rank, world, *, op):
        if len(shards) != len(specs):
            raise InvalidArgumentError("%d shards for %d specs" % (len(shards), len(specs)))
        for i, s in enumerate(specs):
            _check_spec(i, s, world)
        self.specs_q = quantize(specs) if callable(quantize) else resolve(quantize, specs, names)
        tensors = [_from_spec(i, q, s, world)
                   for i, (q, s) in enumerate(zip(self.specs_q, specs)) if q is not None]
        passthrough = [t.index for t in tensors if isinstance(shards[t.index], tuple)
                       and len(shards[t.index]) == 2]
        for t in tensors:
            s = specs[t.index]
            check = _check_given if t.index in passthrough else _check_shard
            check(shards[t.index], s.dtype, s.padded_size, t, rank, world)
        super().__init__(tensors, rank, world, passthrough, op=op)
        by_index = {t.index: t for t in self.tensors}
        self.payload_specs = [x for i, s in enumerate(specs)
                              for x in (_payload_specs(by_index[i]) if i in by_index else [s])]

    def encode(self, shards, comm, timeout):
        """Steps 2 to 4 of the module, collective over ``comm``: the payload this rank sends
        (a quantized tensor's FP8 bytes as uint8 and its owned scales; plain tensors as they
        are), from the shards' current values (see ``encode_quantized``)."""
        quantized = self.encode_quantized(shards, comm, timeout)
        sent = []
        for i, shard in enumerate(shards):
            sent += quantized[i][:2] if i in quantized else [shard]
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


def _amax_plan(tensors, world, rank, timeout, stage, hosts=None):
    """Step 3's exchange, planned: one reshard of a [world, K] table, where rank r's row holds,
    per tensor, the slabs it shares with other ranks (its first and its last), to the ranks
    that share them. (its ReshardPlan at ``stage``, [(tensor, this rank's slot, box)] of each of
    this rank's destinations in the plan's order), or None when no cut falls inside a block."""
    width = sum(2 * t.slot for t in tensors if any(t.cut_slabs(r) for r in range(world)))
    if width == 0:
        return None
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
    from ._ops import ReshardPlan  # _ops imports this module

    plan = ReshardPlan([layout], world, rank, hosts=hosts, fan_out=False, timeout=timeout,
                       _stage=stage)
    order = {(tuple(o), tuple(n)): k for k, (_, o, n) in enumerate(plan.destination_boxes)}
    ordered = [None] * len(wanted)
    for w in wanted:
        ordered[order[(tuple(w[2].offset), tuple(w[2].size))]] = w
    return plan, ordered, width


def _agree_amax(tensors, planned, amax, comm, combine=None):
    """Step 3 of the module over ``planned`` (:func:`_amax_plan` of ``tensors``): this rank's
    partial maxima of the slabs it shares go to the ranks sharing them, and what arrives is
    combined by max (a NaN wins), or by ``combine(t, slot, mine, theirs, peer)`` where it is
    given and returns True (pass-through tensors, whose table holds their given scales)."""
    if planned is None:
        return
    plan, wanted, width = planned
    row = torch.zeros(1, width)
    for t in tensors:
        for slot, _ in t.cut_slabs(comm.rank):
            start = t.column + slot * t.slot
            row[0, start:start + t.slot] = _slab(amax[t.index], t, slot).reshape(-1)
    pieces = [torch.empty(1, t.slot) for t, _, _ in wanted]
    plan.execute([row], pieces, comm)
    for piece, (t, slot, box) in zip(pieces, wanted):
        view = _slab(amax[t.index], t, slot)
        theirs = piece.reshape(view.shape)
        if combine is None or not combine(t, slot, view, theirs, box.offset[0]):
            view.copy_(torch.maximum(view, theirs))


def quantize_here(tensor, spec):
    """One whole tensor quantized on this rank, in the form a transfer returns it."""
    from .quantization import dequantize, quantize

    data, scales = quantize(tensor, spec.format)
    if spec.dequantize is not None:
        return dequantize(data, scales, spec.format, spec.dequantize)
    return data, scales


def _still_fits(shard, t, rank, given):
    """Whether a shard still has the shape and dtype its plan was checked with."""
    try:
        if given:
            return _real_rows(shard[0], t, rank).shape[t.dim] == t.sizes[rank]
        rows = _real_rows(shard, t, rank)
    except (TypeError, IndexError, RuntimeError, AttributeError):
        return False
    want = list(t.shape)
    want[t.dim] = t.sizes[rank]
    return (isinstance(shard, torch.Tensor) and shard.device.type == "cpu"
            and shard.dtype in _INPUTS and list(rows.shape) == want)


def _scales_as_f32(scales, t):
    """Given scales as the amax table carries them: fp32, or E8M0 bytes as their fp32 values."""
    if t.spec.format == "mxfp8":
        return scales.view(torch.uint8).float()
    return scales.float()


def _pass_through(t, given, rank):
    """[the FP8 bytes of the real rows, the scales of the blocks that start in them] from a
    caller's (data, scales)."""
    data, scales = given
    data = _real_rows(data, t, rank).view(torch.uint8)
    n = t.owned(rank)
    if n == 0:  # no block starts in these rows (or there are none): no scales to send
        empty = list(t.scale_shape)
        empty[t.dim] = 0
        return [data, torch.empty(empty, dtype=_scale_dtype(t))]
    if scales.element_size() == 1:
        scales = scales.view(torch.uint8)
    return [data, scales.narrow(t.dim, scales.shape[t.dim] - n, n)]


def _check_given(given, dtype, padded, t, rank, world):
    """A pass-through shard: (FP8 data of the shard's shape, the scales of every block its
    real rows touch, in the format's layout)."""
    data, scales = given
    want = list(t.shape)
    want[t.dim] = padded or t.sizes[rank]
    wide = _scale_shape(t.spec.format, t.window(rank)[1]) if t.sizes[rank] else None
    mx = t.spec.format == "mxfp8"
    ok = (isinstance(data, torch.Tensor) and isinstance(scales, torch.Tensor)
          and data.device.type == "cpu" and scales.device.type == "cpu"
          and data.dtype in (torch.float8_e4m3fn, torch.uint8) and list(data.shape) == want)
    if ok and wide is not None:
        ok = tuple(scales.shape) == tuple(wide) and (
            scales.dtype in (torch.float8_e8m0fnu, torch.uint8) if mx
            else scales.dtype == torch.float32)
    if not ok:
        raise InvalidArgumentError(
            "shards[%d] on rank %d: FP8 data passed through is a (data, scales) pair of "
            "float8_e4m3fn %s and %s scales of %s (the blocks its rows touch), got %s"
            % (t.index, rank, want, "E8M0" if mx else "float32",
               list(wide) if wide is not None else "any shape",
               tuple((x.dtype, list(x.shape)) if isinstance(x, torch.Tensor) else type(x)
                     for x in given)))
    del dtype, world  # the spec's dtype names the values the data encodes, not the data's


def _rows_numel(t, rank):
    n = t.sizes[rank]
    for d, s in enumerate(t.shape):
        n *= 1 if d == t.dim else s
    return n


def _encode(t, shard, amax, rank, out):
    """[FP8 bytes of the real rows (into ``out``, flat), the scales of the slabs that start in
    them]."""
    if amax is None:  # no rows: nothing to send (data, owned scales, window scales)
        empty = list(t.shape)
        empty[t.dim] = 0
        scales = list(t.scale_shape)
        scales[t.dim] = 0
        no_scales = torch.empty(scales, dtype=_scale_dtype(t))
        return [torch.empty(empty, dtype=torch.uint8), no_scales, no_scales]
    rows = _real_rows(shard, t, rank)
    data, scales = _C._quantize_box(rows, t.spec.format, t.window(rank)[1], _in_window(t, rank),
                                    amax, out.view(rows.shape))
    n = t.owned(rank)
    return [data, scales.narrow(t.dim, scales.shape[t.dim] - n, n), scales]


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


# ---------------------------------------------------------------------------------------------
# The reshard: sources that split one dim (FSDP's rows, a column or row split), destinations
# of any boxes.


def reshard(sources, destinations, layouts, comm, quantize, *, timeout, async_op=False):
    """``shardgather.reshard`` with ``quantize`` over ``comm`` (a Communicator): each source
    quantizes its box (the ranks sharing a block agree on its amax first), and one reshard
    moves the FP8 bytes of every destination box with the scales of the blocks that box
    touches (:func:`scale_box`). A quantized tensor's destination is a ``(data, scales)``
    pair, written in place (float8_e4m3fn or uint8 data of the box's shape; the scales of the
    scale box's shape: float32, or float8_e8m0fnu / uint8 for mxfp8), or a float32 / bfloat16
    tensor, which receives the dequantized values. A one-shot :class:`shardgather.ReshardPlan`
    made with ``quantize`` (plan once to reshard every step)."""
    from ._ops import ReshardPlan  # _ops imports this module

    plan = ReshardPlan(layouts, comm.size, comm.rank, hosts=comm.hosts or None, timeout=timeout,
                       quantize=quantize)
    return plan.execute(sources, destinations, comm, async_op=async_op)


def _scale_dtype(t):
    return torch.uint8 if t.spec.format == "mxfp8" else torch.float32


def destination_parts(destinations):
    """A quantized :class:`shardgather.ReshardPlan`'s destinations as its execute takes them:
    {"destinations": each one, a (data, scales) pair's FP8 data as uint8; "scales": per
    destination None (it receives values) or the pair's scales (E8M0 as uint8); "returned":
    the list execute returns}. Anything else is passed on as it is, for the call to refuse on
    every rank."""
    try:
        given = list(destinations)
    except TypeError:
        return {}  # the call names it
    moved, scales = [], []
    for d in given:
        if isinstance(d, tuple) and len(d) == 2 and all(isinstance(x, torch.Tensor) for x in d):
            moved.append(d[0].view(torch.uint8) if d[0].dtype == torch.float8_e4m3fn else d[0])
            scales.append(d[1].view(torch.uint8) if d[1].dtype == torch.float8_e8m0fnu else d[1])
        else:
            moved.append(d)
            scales.append(None)
    return {"destinations": moved, "scales": scales, "returned": given}


# ---------------------------------------------------------------------------------------------
# UnshardPlan(quantize=...): an unshard is a reshard from every rank's rows to the full tensors,
# and a quantized reshard is one call of the C++ plan execution.


def _entry(q, shape, box):
    """A quantized plan's own entry for ``box`` of a tensor of ``shape`` (on the meta device,
    for :func:`_carved`): the dequantized box, or (FP8 data, the scales of every block the box
    touches)."""
    if q.dequantize is not None:
        return torch.empty(tuple(box.size), dtype=q.dequantize, device="meta")
    scales = scale_box(q.format, shape, box).size
    return (torch.empty(tuple(box.size), dtype=torch.float8_e4m3fn, device="meta"),
            torch.empty(scales, dtype=torch.float8_e8m0fnu if q.format == "mxfp8"
                        else torch.float32, device="meta"))


def _carved(entries):
    """``entries`` (meta tensors, tuples and lists of them) made in one host buffer of huge
    pages, at 64-byte offsets: a fresh plan (a one-shot call's) first-touches its entries, and
    that costs 40 times more on 4 KiB pages (docs/benchmarking.md)."""
    flat = _flat(entries)
    sizes = [t.numel() * t.element_size() for t in flat]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 64) * 64)
    buffer = _C._host_staging(starts[-1])
    made = iter([buffer[a:a + n].view(t.dtype).view(t.shape)
                 for t, a, n in zip(flat, starts, sizes)])
    return _nested_like(entries, made)


def _flat(x):
    """The tensors of ``x`` (a tensor, or tuples and lists of them), in order."""
    return [x] if isinstance(x, torch.Tensor) else [t for y in x for t in _flat(y)]


def _nested_like(x, made):
    """``x``'s nesting, each tensor the next of ``made``. (Module functions, not closures: a
    recursive closure is a reference cycle, which would hold the buffer until a gc pass.)"""
    if isinstance(x, torch.Tensor):
        return next(made)
    return type(x)(_nested_like(y, made) for y in x)


def _device_of(tensors):
    """The device of the first tensor in ``tensors`` (a list), or None."""
    for t in tensors if isinstance(tensors, (list, tuple)) else ():
        if isinstance(t, torch.Tensor):
            return t.device
    return None


def follow_device(entries, params, plan, group):
    """A quantized plan's own entries (tensors, (data, scales) pairs, lists of them) remade on
    the device of ``params``' first tensor where they are elsewhere (a plan is built before it
    sees a tensor); ``entries`` where they are there, or ``params`` names no device. A failed
    allocation fails ``plan``'s call on every rank."""
    device = _device_of(params)
    first = entries
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if device is None or not isinstance(first, torch.Tensor) or first.device == device:
        return entries

    def remake(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_like(x, device=device)
        return type(x)(remake(y) for y in x)

    try:
        return remake(entries)
    except RuntimeError as e:  # out of memory, or a device torch cannot use
        _refuse(plan, group, "the plan's own entries on %s: %s" % (device, e))
        raise  # not reached: _refuse raises


def _refuse(plan, group, message):
    """Fails a quantized plan's call on every rank (``plan``: the Python plan whose call it is;
    the call is its reshard's) with ``message``: the peers meet this rank's failed header in
    their own call."""

    comm = communicator(group, plan._timeout())
    _C._fail_call(comm, "ReshardPlan::execute", message, False, plan._preflight is not False,
                  _setup_timeout(plan._given_timeout), plan._stage)


def unshard_entries(specs, specs_q):
    """A quantized UnshardPlan's own entries (its C++ plan writes them every execute): per
    parameter its full tensor, or (FP8 data, the scales of every block) or its dequantized
    tensor, as :func:`destination_parts` hands them to the plan."""
    entries = [torch.empty(tuple(s.full_shape), dtype=s.dtype, device="meta") if q is None
               else _entry(q, s.full_shape, Box((0,) * len(s.full_shape), s.full_shape))
               for s, q in zip(specs, specs_q)]
    return destination_parts(_carved(entries))


def _formed(per_rank):
    """The shape the ranks' tensors form along dim 0 (each ``per_rank[r]`` a shape), or None
    where they cannot."""
    if any(len(s) != len(per_rank[0]) or not s or s[1:] != per_rank[0][1:] for s in per_rank):
        return None
    return (sum(s[0] for s in per_rank),) + tuple(per_rank[0][1:])


def _gather_specs(dtypes, shapes, quantize):
    """Each index's spec (None: plain) and the shape its ranks' tensors form: a format for
    every index leaves ragged pieces plain; one named by index must form a tensor."""
    formed = [_formed([row[i] for row in shapes]) for i in range(len(dtypes))]
    specs_q = resolve(quantize, [Described(d, f or (1, 32)) for d, f in zip(dtypes, formed)])
    for i, (q, f) in enumerate(zip(specs_q, formed)):
        if q is None or f is not None:
            continue
        if not isinstance(quantize, (str, Quantize)):
            raise InvalidArgumentError("quantize[%d]: the ranks' tensors must differ only "
                                       "along dim 0 to form one tensor, got %s"
                                       % (i, [row[i] for row in shapes]))
        specs_q[i] = None  # ragged pieces travel plain under one format
    return specs_q, formed


def gather_entries(dtypes, shapes, quantize, strategy):
    """``AllGatherPlan(quantize=...)``'s formats (one per index, None: plain) for the C++ plan,
    which reads a quantized index as one tensor whose every rank's rows go to every rank as a
    box of their own, and its own entries as its execute takes them
    (:func:`destination_parts`, ``returned`` as ``out[i][r]``): per quantized index and rank
    (FP8 data, scales) or the dequantized rows, per plain index each rank's tensor; None where
    no index is quantized (the plan is then a plain one)."""
    if strategy not in ("auto", "direct"):
        raise InvalidArgumentError(
            "AllGatherPlan(quantize=...): strategy is %r; a quantized plan moves as one "
            "personal exchange (auto or direct)" % (strategy,))
    specs_q, formed = _gather_specs(dtypes, shapes, quantize)
    formats = [None if q is None else q.format for q in specs_q]
    if all(f is None for f in formats):
        return formats, None  # a plain plan, into its own buffer or `out`
    entries = []
    for i, (q, f, dtype) in enumerate(zip(specs_q, formed, dtypes)):
        if q is None:
            entries.append([torch.empty(row[i], dtype=dtype, device="meta") for row in shapes])
            continue
        rows, at = [], 0
        for row in shapes:
            rows.append(Box((at,) + (0,) * (len(f) - 1), row[i]))
            at += row[i][0]
        entries.append([_entry(q, f, box) for box in rows])
    entries = _carved(entries)
    parts = destination_parts([e for row in entries for e in row])
    parts["returned"] = [list(row) for row in entries]
    return formats, parts


# ---------------------------------------------------------------------------------------------
# foreach_all_gather: each index's tensors, one per rank, are the rows of one tensor (FSDP's
# reading: rank r's rows follow rank r-1's along dim 0), gathered by a one-shot
# AllGatherPlan(quantize=...).


def foreach_all_gather(params, comm, shapes, quantize, *, timeout, preflight, strategy,
                       async_op, twice=False):
    """shardgather.foreach_all_gather with ``quantize`` given: ``out[i][r]`` is rank r's rows of
    the quantized tensor that tensor i of every rank forms along dim 0, with the scales of the
    blocks those rows touch (a block shared by two ranks' rows is in both entries), or those
    rows dequantized. ``shapes``: the shapes hint, or None (one small gather of the shapes).
    An agreement (every argument, the specs), then one call of a quantized AllGatherPlan made
    for it; blocking on CPU tensors, the steps of the module instead: its one all-gather of
    every rank's FP8 rows into one buffer is faster on a host than the plan's personal
    exchange into entries of their own (docs/benchmarking.md)."""
    agreement = Agreement("foreach_all_gather", FOREACH + ": agreement")
    agreement.capture(lambda: check_keywords(timeout=timeout, strategy=strategy,
                                             preflight=preflight, async_op=async_op))
    if twice:
        agreement.fail(InvalidArgumentError, "the shapes hint was given twice "
                       "(shapes_across_group and params_shapes_across_group)")
    if shapes is None:
        from ._ops import _gather_shapes  # _ops imports this module

        shapes = _gather_shapes(list(params) if isinstance(params, (list, tuple)) else [],
                                comm, _setup_timeout(timeout), FOREACH + ": shapes")
    composed = async_op is False and _device_of(params) in (None, torch.device("cpu"))
    build = _RowsQuantizer if composed else _GatherPlan
    plan = agreement.capture(lambda: build(params, shapes, quantize, comm, strategy=strategy,
                                           preflight=preflight, timeout=timeout))
    agreement.quantize = None if plan is None else plan.agreed
    agreement.options = [("async_op", int(async_op) if agreement.error is None else None)]
    agreement.run(comm, _setup_timeout(timeout))
    if not composed:
        return plan.plan.execute(params, comm, async_op=async_op)
    params = list(params)
    quantized = plan.encode_quantized(params, comm, timeout)
    sent = []
    for i, t in enumerate(params):
        sent += [quantized[i][0], quantized[i][2]] if i in quantized else [t]
    got = _C.foreach_all_gather(sent, comm, plan.payload_shapes, timeout, preflight, strategy,
                                False, FOREACH + ": payload")
    return plan.outputs(got)


def _checked_rows(params, shapes, world):
    """``params`` as a list and ``shapes`` as tuples, checked against each other."""
    params, shapes = list(params), [[tuple(s) for s in row] for row in shapes]
    if len(shapes) != world or any(len(row) != len(params) for row in shapes):
        raise InvalidArgumentError("quantize: the shapes hint has not %d tensors for each of "
                                   "%d ranks" % (len(params), world))
    for i, t in enumerate(params):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("params[%d] must be a tensor, got %s"
                                   % (i, type(t).__name__))
    return params, shapes


def _agreed(specs_q, dtypes, formed):
    """What every rank must agree on: each quantized index's spec, dtype and formed shape."""
    return [None if q is None else _text(q) + [str(dtypes[i]), list(formed[i])]
            for i, q in enumerate(specs_q)]


class _GatherPlan:
    """A one-shot quantized foreach_all_gather's AllGatherPlan (``plan``), and ``agreed``."""

    def __init__(self, params, shapes, quantize, comm, **options):
        from ._ops import AllGatherPlan  # _ops imports this module

        params, shapes = _checked_rows(params, shapes, comm.size)
        for i, t in enumerate(params):
            if tuple(t.shape) != shapes[comm.rank][i]:
                raise InvalidArgumentError("params[%d] has shape %s on rank %d; the shapes "
                                           "hint says %s" % (i, tuple(t.shape), comm.rank,
                                                             shapes[comm.rank][i]))
        dtypes = [t.dtype for t in params]
        self.plan = AllGatherPlan(dtypes, shapes, comm.rank, quantize=quantize,
                                  _stage=FOREACH + ": payload", **options)
        self.plan._built()  # its argument error, raised here, is the agreement's
        specs_q, formed = _gather_specs(dtypes, shapes, quantize)
        self.agreed = _agreed(specs_q, dtypes, formed)


class _RowsQuantizer(_Encoder):
    def __init__(self, params, shapes, quantize, comm, **options):
        del options  # the payload call takes them
        rank, world = comm.rank, comm.size
        params, shapes = _checked_rows(params, shapes, world)
        dtypes = [t.dtype for t in params]
        self.specs_q, formed = _gather_specs(dtypes, shapes, quantize)
        tensors = []
        for i, q in enumerate(self.specs_q):
            if q is not None:
                sizes = [row[i][0] for row in shapes]
                tensors.append(_plan_tensor(i, q, formed[i], 0, sizes,
                                            [sum(sizes[:r]) for r in range(world)]))
        for t in tensors:
            _check_shard(params[t.index], params[t.index].dtype, 0, t, rank, world, "params")
        super().__init__(tensors, rank, world, op=FOREACH)
        self.by_index = {t.index: t for t in tensors}
        self.agreed = _agreed(self.specs_q, dtypes, formed)
        self.payload_shapes = [[] for _ in range(world)]
        for r in range(world):
            for i in range(len(params)):
                t = self.by_index.get(i)
                if t is None:
                    self.payload_shapes[r].append(shapes[r][i])
                else:
                    self.payload_shapes[r] += [shapes[r][i], self._scales_shape(t, r)]

    @staticmethod
    def _scales_shape(t, r):
        if not t.sizes[r]:
            empty = list(t.scale_shape)
            empty[0] = 0
            return tuple(empty)
        return _scale_shape(t.spec.format, t.window(r)[1])

    def outputs(self, got):
        out, k = [], 0
        for i, spec in enumerate(self.specs_q):
            if spec is None:
                out.append(got[k])
                k += 1
                continue
            t = self.by_index[i]
            pieces = []
            for r, (data, scales) in enumerate(zip(got[k], got[k + 1])):
                if spec.dequantize is not None:
                    full = torch.empty(data.shape, dtype=spec.dequantize)
                    if data.numel():
                        _C._dequantize_box(data, scales, spec.format, t.window(r)[1],
                                           _in_window(t, r), full)
                    pieces.append(full)
                else:
                    if spec.format == "mxfp8":
                        scales = scales.view(torch.float8_e8m0fnu)
                    pieces.append((data.view(torch.float8_e4m3fn), scales))
            out.append(pieces)
            k += 2
        return out
