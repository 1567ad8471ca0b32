"""Sharded state dict to a Hugging Face safetensors checkpoint, written by one rank.

    from shardgather.export import save_safetensors
    save_safetensors(model.state_dict(), "out/", group=None, dst=0, bucket_bytes=1 << 30)

writes ``out/model-00001-of-0000N.safetensors`` .. and ``out/model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), the layout
``transformers``' ``from_pretrained`` and ``safetensors.safe_open`` read. It is one
:func:`shardgather.unshard_stream` to ``dst``: the other ranks only send, and hold no full
tensor; on ``dst`` each bucket becomes one file, written while the next bucket gathers, so
``dst``'s extra memory is about (prefetch + 1) x bucket_bytes whatever the model's size. Files are
written under a temporary name and renamed once complete; the index is written last.

Collective over the group (for DTensors: their mesh): every rank calls it with the same layouts.
A failure on any rank (a write error on ``dst`` included) raises on every rank.
"""

import json
import os

from . import InvalidArgumentError
from .stream import UnshardStream

__all__ = ["save_safetensors", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


def save_safetensors(state_dict, out_dir, specs=None, group=None, *, dst=0,
                     bucket_bytes=1 << 30, prefetch=1, progress=True, timeout=None,
                     metadata=None):
    """Writes the full tensors of ``state_dict`` (shards with ``specs``, or DTensors with
    ``specs=None``, as for :func:`shardgather.unshard_stream`) to ``out_dir`` on rank ``dst``.
    ``state_dict`` may also be an UnshardStream made with the same ``dst``: a checkpoint saved
    every N steps then reuses its buckets (the other arguments but ``out_dir`` are its own).

    ``progress``: a tqdm bar on ``dst`` (bytes written). ``metadata``: extra string pairs for
    each file's header (``{"format": "pt"}`` is always set). Returns the index's path on ``dst``,
    None elsewhere.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if isinstance(state_dict, UnshardStream):  # one made once, run again on every save
        stream = state_dict
        if stream.dst != dst:
            raise InvalidArgumentError("save_safetensors: the stream gathers to %s, not dst=%s"
                                       % (stream.dst, dst))
    else:
        stream = UnshardStream(state_dict, specs, group, bucket_bytes=bucket_bytes,
                               prefetch=prefetch, dst=dst, timeout=timeout)
    writer = stream.rank == dst
    n = stream.num_buckets
    names = ["model-%05d-of-%05d.safetensors" % (b + 1, n) for b in range(n)]
    header = dict(metadata or {}, format="pt")
    weight_map, total = {}, 0
    bar = tqdm(total=stream.total_bytes, unit="B", unit_scale=True, desc="export",
               disable=not (writer and progress))
    with bar, stream:
        if writer:
            os.makedirs(out_dir, exist_ok=True)
        for b, bucket in enumerate(stream):
            if not writer:
                continue
            # CUDA buckets (a stream over CUDA shards) are written from host copies.
            tensors = {str(k): t.cpu() for k, t in bucket.items()}
            _write_atomic(os.path.join(out_dir, names[b]),
                          lambda path: save_file(tensors, path, metadata=header))
            size = sum(t.nbytes for t in tensors.values())
            total += size
            weight_map.update(dict.fromkeys(tensors, names[b]))
            bar.update(size)
    if not writer:
        return None
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path = os.path.join(out_dir, INDEX_NAME)
    _write_atomic(path, lambda p: _write_json(p, index))
    return path


def _write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def _write_atomic(path, write):
    """``write(tmp)`` then rename: a reader never sees a half-written file under its name."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)
