"""The agreement of the Python entry points that take names, specs and options of their own
(streams, the export, ``full_tensors`` over dicts): one collective in which every rank tells
the others the argument error it found, if any, and fingerprints of what must be equal.

Why it exists: an argument that is bad on one rank only, raised there before any exchange,
leaves the peers waiting for their whole deadline and the group unusable. Here every argument
error travels instead, so every rank raises the same class at once and the group stays usable;
and what ranks must agree on (the ordered names, the specs, the options) is compared, so that a
rank holding other keys is a MismatchError naming the first differing key, not silently wrong
rows.

Cost: one fixed-size gather (a header and a payload collective) per agreement; when names or
specs differ, one more gather of every rank's description, on that failure path only (every
rank takes it alike: they all see the same fingerprints).
"""

import hashlib
import json
from numbers import Integral

import torch

from ._shardgather import (CountOverflowError, InvalidArgumentError, InvalidTypeError,
                           MismatchError, OutOfMemoryError, chunk_sizes)
from ._shardgather import _fail_call
from ._shardgather import foreach_all_gather as _gather

_MESSAGE_BYTES = 480
_CLASSES = {1: InvalidArgumentError, 2: InvalidTypeError, 3: MismatchError,
            4: CountOverflowError, 5: OutOfMemoryError}
_CODES = {cls: code for code, cls in _CLASSES.items()}
# The classes an argument error on one rank may raise on every rank, by the name the C++ core
# gives their ErrorCode (_fail_call's ``code``).
_CORE_NAMES = {InvalidArgumentError: "InvalidArgument", InvalidTypeError: "InvalidType",
               MismatchError: "Mismatch", CountOverflowError: "CountOverflow",
               OutOfMemoryError: "OutOfMemory"}
# record: [error, names hash, specs hash, quantize hash, options...]
_NAMES, _SPECS, _QUANTIZE, _OPTIONS = 1, 2, 3, 4


class Agreement:
    """What one rank brings to an agreement: ``what`` prefixes every message (the entry point);
    ``options`` is a list of (name, int) pairs, in the same order on every rank. ``stage`` names
    the step its gathers are (the pre-flight header carries it, so that no other call can pair
    with them): ``"<what>: agreement"`` by default; the gather that explains a difference is
    ``"<stage> (why)"``."""

    def __init__(self, what, stage=None):
        self.what = what
        self.stage = stage if stage is not None else what + ": agreement"
        self.error = None  # (class, message): the first local argument error
        self.names = None
        self.specs = None
        self.quantize = None  # per tensor: None or [format, dequantize dtype] (quantized.py)
        self.options = []

    def fail(self, cls, message):
        """Records a local argument error (the first one wins)."""
        if self.error is None:
            self.error = (cls if cls in _CODES else InvalidArgumentError, str(message))

    def capture(self, step):
        """Runs ``step()`` unless an earlier step failed, recording what it raises (as
        :func:`classify` names it) instead of raising it. Returns the step's result, or None."""
        if self.error is not None:
            return None
        try:
            return step()
        except Exception as e:  # noqa: BLE001  (whatever it is, the peers must hear of it)
            self.fail(*classify(e))
        return None

    def run(self, comm, timeout=None):
        """Collective over ``comm``: raises, identically on every rank, the first rank's
        recorded error, else the first difference of names, specs or options."""
        record, message = self._record(comm.size)
        n = len(record)
        hint = [[(n,), (_MESSAGE_BYTES,)]] * comm.size
        got = _gather([record, message], comm, hint, timeout, True, "auto", False,
                      stage=self.stage)
        records = [r.tolist() for r in got[0]]
        for r, rec in enumerate(records):
            if rec[0]:
                text = got[1][r].numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
                raise _CLASSES[rec[0]]("%s: rank %d: %s" % (self.what, r, text))
        for r, rec in enumerate(records):
            if any(rec[k] != records[0][k] for k in (_NAMES, _SPECS, _QUANTIZE)):
                self._explain(comm, r, timeout)
        for k, (name, _) in enumerate(self.options):
            for r, rec in enumerate(records):
                if rec[_OPTIONS + k] != records[0][_OPTIONS + k]:
                    raise MismatchError("%s: %s differs: rank 0 has %s, rank %d has %s"
                                        % (self.what, name, _show(name, records[0][_OPTIONS + k]),
                                           r, _show(name, rec[_OPTIONS + k])))

    def _record(self, world):
        code, text = 0, ""
        if self.error is not None:
            code, text = _CODES[self.error[0]], self.error[1]
        record = [code, _digest(self._names_text()), _digest(self._specs_text(world)),
                  _digest(self.quantize)]
        record += [_wire(name, v) for name, v in self.options]
        raw = text.encode("utf-8")[:_MESSAGE_BYTES - 1]
        message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if raw:
            message[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return torch.tensor(record, dtype=torch.int64), message

    def _names_text(self):
        return None if self.names is None else [repr(k) for k in self.names]

    def _specs_text(self, world):
        """The specs as the plans read them: default sizes filled in (torch.chunk's), the shard
        dim made non-negative, so that equal specs written two ways agree."""
        if self.specs is None:
            return None
        out = []
        for s in self.specs:
            ndim = len(s.full_shape)
            dim = s.shard_dim % ndim if ndim else s.shard_dim
            sizes = list(s.sizes) or (chunk_sizes(s.full_shape[dim], world) if ndim else [])
            out.append([str(s.dtype), list(s.full_shape), dim, sizes, s.padded_size])
        return out

    def _explain(self, comm, r, timeout):
        """Every rank's names and specs (one more gather, on this failure path only), and the
        MismatchError naming the first difference between rank 0's and rank ``r``'s."""
        mine = json.dumps([self._names_text(), self._specs_text(comm.size),
                           self.quantize]).encode("utf-8")
        mine = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        got = _gather([mine], comm, None, timeout, True, "auto", False,
                      stage=self.stage + " (why)")[0]
        names0, specs0, quantize0 = json.loads(got[0].numpy().tobytes())
        names, specs, quantize = json.loads(got[r].numpy().tobytes())
        if names0 == names and specs0 == specs:
            raise MismatchError("%s: %s" % (self.what, _quantize_difference(quantize0, quantize,
                                                                              r)))
        raise MismatchError("%s: %s" % (self.what, _first_difference(names0, specs0, names,
                                                                       specs, r)))


def _quantize_difference(quantize0, quantize, r):
    """The first tensor whose quantize spec ([format, dequantize dtype] or None) differs."""
    if (quantize0 is None) != (quantize is None):
        return ("quantize= is given on rank %d only (rank 0: %s, rank %d: %s)"
                % (0 if quantize is None else r, "given" if quantize0 is not None else "none",
                   r, "given" if quantize is not None else "none"))
    for i, (a, b) in enumerate(zip(quantize0 or [], quantize or [])):
        if a != b:
            return ("the quantize spec of tensor %d differs: %s on rank 0, %s on rank %d"
                    % (i, _quantize_text(a), _quantize_text(b), r))
    return "the quantize specs differ between rank 0 and rank %d" % r


def _quantize_text(spec):
    if spec is None:
        return "none"
    text = spec[0] if spec[1] == "None" else "%s dequantized to %s" % (spec[0], spec[1])
    return text + "".join(", " + str(x) for x in spec[2:])


def _first_difference(names0, specs0, names, specs, r):
    if names0 != names:
        return _names_difference(names0 or [], names or [], r)
    fields = ("dtype", "full shape", "shard dim", "per-rank sizes", "padded size")
    for i, (a, b) in enumerate(zip(specs0 or [], specs or [])):
        for field, x, y in zip(fields, a, b):
            if x != y:
                name = " (%s)" % names0[i] if names0 else ""
                return ("the spec of tensor %d%s differs: %s is %s on rank 0, %s on rank %d"
                        % (i, name, field, x, y, r))
    return "the number of specs differs: rank 0 has %d, rank %d has %d" % (
        len(specs0 or []), r, len(specs or []))


def _names_difference(names0, names, r):
    """The first key one side lacks, else the first position whose key differs."""
    have, have0 = set(names), set(names0)
    only0 = [k for k in names0 if k not in have]
    only = [k for k in names if k not in have0]
    if only0 or only:
        parts = []
        if only0:
            parts.append("rank %d lacks key %s (and %d more)" % (r, only0[0], len(only0) - 1)
                         if len(only0) > 1 else "rank %d lacks key %s" % (r, only0[0]))
        if only:
            parts.append("rank %d has key %s that rank 0 lacks" % (r, only[0]))
        return "the keys differ: " + "; ".join(parts)
    for i, (a, b) in enumerate(zip(names0, names)):
        if a != b:
            return ("the key order differs: key %d is %s on rank 0, %s on rank %d (the same "
                    "keys in another order would gather one parameter's rows into another)"
                    % (i, a, b, r))
    return "the keys differ between rank 0 and rank %d" % r


def classify(error):
    """(class, message) for an argument error raised on one rank, as every rank will raise it:
    shardgather's own argument classes (InvalidArgument, InvalidType, CountOverflow, Mismatch,
    OutOfMemory) as they are, a TypeError an InvalidTypeError, a MemoryError an
    OutOfMemoryError, a ValueError an InvalidArgumentError, and anything else (a bug in a
    caller's object) an InvalidArgumentError naming its type."""
    for cls in (InvalidTypeError, CountOverflowError, OutOfMemoryError, InvalidArgumentError,
                MismatchError):
        if isinstance(error, cls):
            return cls, str(error)
    if isinstance(error, TypeError):
        return InvalidTypeError, str(error)
    if isinstance(error, MemoryError):
        return OutOfMemoryError, "%s: %s" % (type(error).__name__, error)
    if isinstance(error, ValueError):
        return InvalidArgumentError, str(error)
    return InvalidArgumentError, "%s: %s" % (type(error).__name__, error)


def fail_call(comm, op, cls, message, *, preflight=True, timeout=None, stage=""):
    """Fails the call ``op`` (as the core names it) at ``stage`` that the peers are making,
    raising ``cls`` (one of classify()'s) with ``message`` on every rank."""
    _fail_call(comm, op, message, cls is InvalidTypeError, preflight is not False, timeout,
               stage, _CORE_NAMES.get(cls, "InvalidArgument"))


def check_int(name, value, low, high=None, domain=None):
    """``value`` as an int, when it is one (not a bool, not a float) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidTypeError("%s must be an int, got %s" % (name, type(value).__name__))
    if value < low or (high is not None and value > high):
        if domain is None:
            domain = ">= %d" % low if high is None else "in [%d, %d]" % (low, high)
        raise InvalidArgumentError("%s must be %s, got %d" % (name, domain, value))
    return int(value)


def check_str(name, value):
    """``value`` is a str (a strategy name: which names exist, the call itself checks)."""
    if not isinstance(value, str):
        raise InvalidTypeError("%s must be a str, got %s" % (name, type(value).__name__))


def _digest(value):
    """A 63-bit fingerprint of a JSON-able value, the same in every process (Python's own
    hash() of a str is salted per process)."""
    raw = json.dumps(value).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


# Option values that are not ints travel as codes: None as -1 (dst=None: every rank), a
# strategy as its index here (an unknown name is an argument error found before).
_STRATEGIES = ("auto", "direct", "packed", "per_tensor", "shared", "padded", "hierarchical")


def _wire(name, value):
    if value is None:
        return -1
    if name == "strategy":
        return _STRATEGIES.index(value) if value in _STRATEGIES else -2
    return int(value)


def _show(name, value):
    if name == "strategy":
        return repr(_STRATEGIES[value]) if 0 <= value < len(_STRATEGIES) else "?"
    return "None" if value == -1 and name == "dst" else str(value)
