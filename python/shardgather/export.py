"""Sharded state dict to a Hugging Face safetensors checkpoint, written by one rank.

    from shardgather.export import save_safetensors
    save_safetensors(model.state_dict(), "out/", group=None, dst=0, bucket_bytes=1 << 30)

writes ``out/model-00001-of-0000N.safetensors`` .. and ``out/model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), the layout
``transformers``' ``from_pretrained`` and ``safetensors.safe_open`` read. It is one
:func:`shardgather.unshard_stream` to ``dst``: the other ranks only send, and hold no full
tensor; on ``dst`` each bucket becomes one file, written while the next bucket gathers, so
``dst``'s extra memory is about (prefetch + 1) x bucket_bytes whatever the model's size. The
files are written into a staging directory inside ``out_dir`` and the whole checkpoint replaces
an older one there atomically (:mod:`shardgather.checkpoint_dir`): a loader sees the old
checkpoint, none, or the new one, never a mix.

Collective over the group (for DTensors: their mesh): every rank calls it with the same layouts.
A failure on any rank (a write error on ``dst`` included) raises on every rank.
"""

import math
import os

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from . import _shardgather as _C
from ._groups import _setup_timeout, communicator
from ._ops import ReshardPlan
from ._shardgather import InvalidArgumentError, InvalidTypeError, chunk_sizes
from ._agree import Agreement, check_int
from .checkpoint_dir import INDEX_NAME, CheckpointWriter
from .stream import UnshardStream, _stream_group

__all__ = ["save_safetensors", "INDEX_NAME"]


def save_safetensors(state_dict, out_dir, specs=None, group=None, *, dst=0,
                     bucket_bytes=1 << 30, prefetch=1, progress=True, timeout=None,
                     metadata=None, writers=1, quantize=None):
    """Writes the full tensors of ``state_dict`` (shards with ``specs``, or DTensors with
    ``specs=None``, as for :func:`shardgather.unshard_stream`) to ``out_dir`` on rank ``dst``.
    ``state_dict`` may also be an UnshardStream made with the same ``dst``: a checkpoint saved
    every N steps then reuses its buckets (the other arguments but ``out_dir`` are its own).

    ``dst``: a rank of the group (an int in [0, world size)). ``progress``: a tqdm bar on
    ``dst`` (bytes written). ``metadata``: extra str to str pairs for each file's header
    (``{"format": "pt"}`` is always set). Returns the index's path on ``dst``, None elsewhere.

    ``writers=W`` (1 <= W <= world size): W ranks write the files, each file (the same files,
    bytes and index as with one writer) assigned to one writer, balanced by bytes, and moved to
    it by a reshard from the ranks that hold its shards (every byte crosses the network once).
    The writers write into ``dst``'s staging directory, so ``out_dir`` must be one filesystem
    that every writer sees (a shared one across hosts); ``dst`` commits.

    ``quantize`` (:mod:`shardgather.quantized`; one writer): an FP8 checkpoint, quantized on
    send. ``"fp8_e4m3_128x128"`` writes each 2-d floating tensor ``w`` (or those a dict from
    name to format names) as ``w`` in F8_E4M3 and ``w_scale_inv`` in F32, the layout Hugging
    Face FP8 checkpoints (DeepSeek-V3, Qwen3 FP8) ship, bit-identical to quantizing the full
    tensor; the index's metadata gains the ``quantization_config`` a loader reads from
    ``config.json`` (:func:`shardgather.quantized.quantization_config`), to be merged there.

    The checkpoint replaces an older one in ``out_dir`` atomically (see
    :mod:`shardgather.checkpoint_dir`): until it is complete the older one stays intact, and
    afterwards nothing of it that the new index could be confused with remains; other files
    (``config.json``, tokenizer files, ...) are left alone. Every argument error, on any rank,
    raises the same class on every rank before anything moves, and so does a failure to write
    or commit on ``dst``.
    """

    def check(names, specs_q):
        # specs_q: what the stream quantizes (per parameter a spec or None), however it was made.
        _check_export(out_dir, dst, progress, metadata, names, world)
        check_int("writers", writers, 1, world, "the group's %d ranks" % world)
        if any(specs_q or ()) and writers != 1:
            raise InvalidArgumentError("quantize: an FP8 export has one writer (writers=%d)"
                                       % writers)

    if isinstance(state_dict, UnshardStream):  # one made once, run again on every save
        stream = state_dict
        world = stream._comm.size
        _check_premade(stream, dst, check, timeout, writers, quantize)
    else:
        world = _world_of(state_dict, specs, group, timeout)
        stream = UnshardStream(state_dict, specs, group, bucket_bytes=bucket_bytes,
                               prefetch=prefetch, dst=dst, timeout=timeout, quantize=quantize,
                               _checks=(check,),
                               _options=[("writers", writers)], _op="save_safetensors")
    if writers != 1:
        return _save_with_writers(stream, out_dir, writers, progress, metadata, timeout)
    writer = []  # on dst: the CheckpointWriter, made inside the stream (a failure travels)
    try:
        index = _write_buckets(stream, out_dir, writer, progress, metadata)
    except BaseException:
        for w in writer:
            w.abort()
        raise
    return _commit(stream, writer[0] if writer else None, index, timeout, out_dir)


def _write_buckets(stream, out_dir, writer, progress, metadata):
    """Gathers the buckets; on ``dst`` writes each as one file into the staging directory of a
    CheckpointWriter it appends to ``writer``. Returns the index to commit (None elsewhere).
    Everything on ``dst`` that can fail happens inside the stream, whose ``with`` tells the
    peers."""
    receives = stream.rank == stream.dst
    n = stream.num_buckets
    names = ["model-%05d-of-%05d.safetensors" % (b + 1, n) for b in range(n)]
    header = dict(metadata or {}, format="pt")
    weight_map, total = {}, 0
    with stream:
        if receives:
            writer.append(CheckpointWriter(out_dir))
        bar = tqdm(total=stream.total_bytes, unit="B", unit_scale=True, desc="export",
                   disable=not (receives and progress))
        try:
            for b, bucket in enumerate(stream):
                if not receives:
                    continue
                # CUDA buckets (a stream over CUDA shards) are written from host copies.
                tensors = {str(k): t.cpu() for k, t in bucket.items()}
                writer[0].write(names[b], lambda path: save_file(tensors, path, metadata=header))
                size = sum(t.nbytes for t in tensors.values())
                total += size
                weight_map.update(dict.fromkeys(tensors, names[b]))
                bar.update(size)
        finally:
            _close_quietly(bar)
    if not receives:
        return None
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    config = _quantization_config(stream)
    if config is not None:
        index["metadata"]["quantization_config"] = config
    return index


def _quantization_config(stream):
    """The quantization_config of a stream's quantized tensors (one format), or None."""
    from .quantized import quantization_config

    formats = {q.format for q in stream._specs_q if q is not None}
    if len(formats) != 1:
        return None if not formats else {"formats": sorted(formats)}
    # The modules whose matrices stay in high precision (a loader must not expect FP8 there).
    plain = [str(name).removesuffix(".weight")
             for name, q, spec in zip(stream._names, stream._specs_q, stream._specs)
             if q is None and len(spec.full_shape) >= 2]
    return quantization_config(formats.pop(), plain)


def _file_names(n):
    return ["model-%05d-of-%05d.safetensors" % (b + 1, n) for b in range(n)]


def _assign_files(file_bytes, world, writers):
    """(writer ranks, owner of each file): writers spread evenly over the ranks (so over hosts
    of consecutive ranks), each file to the least-loaded writer, largest files first."""
    ranks = [k * world // writers for k in range(writers)]
    loads = [0] * writers
    owner = [0] * len(file_bytes)
    for b in sorted(range(len(file_bytes)), key=lambda b: (-file_bytes[b], b)):
        k = min(range(writers), key=lambda k: (loads[k], k))
        owner[b] = ranks[k]
        loads[k] += file_bytes[b]
    return ranks, owner


def _split(spec, world):
    """(shard dim, every rank's real size along it) of ``spec``; torch.chunk sizes by default."""

    dim = spec.shard_dim % len(spec.full_shape)
    return dim, list(spec.sizes) or chunk_sizes(spec.full_shape[dim], world)


def _source_boxes(spec, world):
    """[(rank, Box)]: the real part of each rank's shard of ``spec``."""
    from .layouts import Box

    full = tuple(spec.full_shape)
    dim, sizes = _split(spec, world)
    out, at = [], 0
    for r in range(world):
        offset = tuple(at if d == dim else 0 for d in range(len(full)))
        size = tuple(sizes[r] if d == dim else n for d, n in enumerate(full))
        out.append((r, Box(offset, size)))
        at += sizes[r]
    return out


def _staging_everywhere(comm, writer):
    """``dst``'s staging directory, on every rank (one small gather of its path)."""

    mine = writer.staging_dir.encode() if writer is not None else b""
    got = _C.foreach_all_gather([torch.frombuffer(bytearray(mine), dtype=torch.uint8)
                                 if mine else torch.empty(0, dtype=torch.uint8)], comm,
                                stage="save_safetensors: staging")
    return next(bytes(t.tolist()).decode() for t in got[0] if t.numel())


def _save_with_writers(stream, out_dir, writers, progress, metadata, timeout):
    """The export with W writer ranks, round by round: in round k every writer receives the
    full tensors of its k-th file (one reshard: each destination is a writer's whole tensor),
    writes the file into ``dst``'s staging directory and the round agrees (a write error raises
    on every rank). ``dst`` then adopts every file and commits. A writer holds one file's
    tensors at a time."""
    comm, me, world = stream._comm, stream.rank, stream._comm.size
    n = stream.num_buckets
    names, specs = _file_names(n), stream._specs
    params = [range(*stream._stream.bucket_params(b)) for b in range(n)]
    file_bytes = [sum(math.prod(specs[i].full_shape) * specs[i].dtype.itemsize for i in params[b])
                  for b in range(n)]
    ranks, owner = _assign_files(file_bytes, world, writers)
    header = dict(metadata or {}, format="pt")
    made = Agreement("save_safetensors", "save_safetensors: staging made")
    writer = made.capture(lambda: CheckpointWriter(out_dir)) if me == stream.dst else None
    made.run(comm, _setup_timeout(timeout))
    try:
        staging = _staging_everywhere(comm, writer)
        rounds = [[b for b in range(n) if owner[b] == w] for w in ranks]
        bar = tqdm(total=sum(file_bytes[b] for b in range(n) if owner[b] == me), unit="B",
                   unit_scale=True, desc="export", disable=not (progress and me in ranks))
        try:
            for k in range(max(len(r) for r in rounds)):
                _export_round([r[k] for r in rounds if k < len(r)], stream, params, owner,
                              names, file_bytes, staging, header, bar, timeout)
        finally:
            _close_quietly(bar)
        index = None
        if writer is not None:
            weight_map = {str(stream._names[i]): names[b] for b in range(n) for i in params[b]}
            index = {"metadata": {"total_size": sum(file_bytes)}, "weight_map": weight_map}
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    # dst's adopting and committing, told to every rank
    done = Agreement("save_safetensors", "save_safetensors: committed")
    if writer is not None:
        done.capture(lambda: _adopt_and_commit(writer, names, index))
    done.run(comm, _setup_timeout(timeout))
    return os.path.join(out_dir, INDEX_NAME) if writer is not None else None


def _export_round(files, stream, params, owner, names, file_bytes, staging, header, bar,
                  timeout):
    """One round: every writer receives the full tensors of ``files`` it owns in one reshard
    and writes them. What can fail on one rank (its tensors, a write) is agreed on, before the
    reshard and after the writes, so it raises on every rank instead of leaving them waiting."""
    from .layouts import Box, TensorLayout

    comm, me, world = stream._comm, stream.rank, stream._comm.size
    specs = stream._specs
    order = [i for b in files for i in params[b]]
    layouts = [TensorLayout(tuple(specs[i].full_shape), specs[i].dtype,
                            _source_boxes(specs[i], world),
                            [(owner[b], Box((0,) * len(specs[i].full_shape),
                                            tuple(specs[i].full_shape)))])
               for b in files for i in params[b]]
    ready = Agreement("save_safetensors", "save_safetensors: round ready")
    sources = ready.capture(lambda: [_real_part(stream._tensors[i], specs[i], me, world)
                                     for i in order])
    full = ready.capture(lambda: {i: torch.empty(tuple(specs[i].full_shape),
                                                 dtype=specs[i].dtype)
                                  for b in files if owner[b] == me for i in params[b]})
    ready.run(comm, _setup_timeout(timeout))
    plan = ReshardPlan(layouts, world, me, hosts=comm.hosts or None, timeout=timeout,
                       _stage="save_safetensors: round")
    plan.execute(sources, [full[i] for i in order if i in full], comm)
    wrote = Agreement("save_safetensors", "save_safetensors: round written")
    for b in files:
        if owner[b] == me:
            tensors = {str(stream._names[i]): full[i] for i in params[b]}
            wrote.capture(lambda: _write_file(staging, names[b], tensors, header))
            _update_quietly(bar, file_bytes[b])
    wrote.run(comm, _setup_timeout(timeout))


def _adopt_and_commit(writer, names, index):
    """On dst: takes in every writer's file, then commits; aborts on any failure."""
    try:
        for name in names:
            writer.adopt(name)
    except BaseException:
        writer.abort()
        raise
    _commit_or_abort(writer, index)


def _update_quietly(bar, n):
    """A progress bar never fails an export (a broken stderr pipe would reach this rank alone)."""
    try:
        bar.update(n)
    except Exception:  # noqa: BLE001
        pass



def _real_part(shard, spec, rank, world):
    """The rows of ``shard`` that hold data (FSDP pads shards to one size)."""
    dim, sizes = _split(spec, world)
    return shard.narrow(dim, 0, sizes[rank]) if shard.shape[dim] != sizes[rank] else shard


def _write_file(staging, name, tensors, header):
    """Writes one file into the staging directory: under a temporary name first, so a file of
    its final name is always whole."""
    path = os.path.join(staging, name)
    tmp = os.path.join(staging, ".part." + name)
    try:
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _close_quietly(bar):
    """A progress bar never fails an export: closing it runs after the stream ended, where an
    error (a broken stderr pipe) would reach this rank alone."""
    try:
        bar.close()
    except Exception:  # noqa: BLE001
        pass


def _commit(stream, writer, index, timeout, out_dir):
    """Makes the new checkpoint ``out_dir``'s on ``dst``; one agreement after it, so that a
    failure there (a full disk, a permission) raises on every rank, not on ``dst`` alone."""
    done = Agreement("save_safetensors", "save_safetensors: committed")
    if writer is not None:
        done.capture(lambda: _commit_or_abort(writer, index))
    done.run(stream._comm, _setup_timeout(timeout))
    return os.path.join(out_dir, INDEX_NAME) if writer is not None else None


def _commit_or_abort(writer, index):
    try:
        writer.commit(index)
    except BaseException as e:
        writer.abort()
        if isinstance(e, OSError):  # told to every rank as the argument it is about: out_dir
            raise InvalidArgumentError("committing the checkpoint in %s failed: %s"
                                       % (writer.out_dir, e)) from None
        raise


def _check_export(out_dir, dst, progress, metadata, names, world):
    """The domain of the export's own arguments; ``names`` (None when the shards were already
    refused) must stay distinct once converted to str, as safetensors names are."""
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InvalidTypeError("out_dir must be a str or os.PathLike, got %s"
                               % type(out_dir).__name__)
    check_int("dst", dst, 0, world - 1, "a rank of the group's %d" % world)
    if not isinstance(progress, bool):
        raise InvalidTypeError("progress must be a bool, got %s" % type(progress).__name__)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidTypeError("metadata must be a dict of str to str, got %r" % (metadata,))
    seen = {}
    for k in names or ():
        if str(k) in seen:
            raise InvalidArgumentError(
                "keys %r and %r are both %r once converted to str (safetensors names are "
                "strings): one would overwrite the other" % (seen[str(k)], k, str(k)))
        seen[str(k)] = k


def _check_premade(stream, dst, check, timeout, writers, quantize):
    """The export's arguments against a stream made beforehand: one agreement on every rank,
    so that an error raises everywhere and leaves the stream usable for the next save."""
    agreement = Agreement("save_safetensors", "save_safetensors: premade stream")
    agreement.capture(lambda: check(stream._names, stream._specs_q))
    # Agreed on once every rank's value is known to be an int in range.
    agreement.options = [("writers", writers if agreement.error is None else None)]
    if agreement.error is None and stream.dst != dst:
        agreement.fail(InvalidArgumentError, "the stream gathers to %s, not dst=%s"
                       % (stream.dst, dst))
    if agreement.error is None and quantize is not None:
        agreement.fail(InvalidArgumentError, "quantize: a stream made beforehand quantizes as "
                       "it was made to (pass quantize= to unshard_stream)")
    agreement.run(stream._comm, _setup_timeout(timeout))


def _world_of(state_dict, specs, group, timeout):
    """The size of the group the stream will run over (for dst's domain)."""
    return communicator(_stream_group(state_dict, specs, group), _setup_timeout(timeout)).size
