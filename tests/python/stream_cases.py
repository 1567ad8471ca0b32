"""unshard_stream cases. Each check_* takes (rank, world, group) and runs on any backend: a
spawned Gloo group (the case_* wrappers, group=None), the threads backend and MPI (group: a
Communicator). Expected full tensors are rebuilt on every rank from the seeded shards."""

import pytest
import torch

import shardgather
from plan_cases import _expected_full, _local_shard, _param_specs, same

T = 30.0


def _specs(world):
    """Every dim kind, uneven, padded and empty shards, three times over (buckets hold several
    parameters), plus one parameter larger than the small buckets."""
    specs = _param_specs(world) * 3
    specs.append(shardgather.ShardSpec(torch.float32, (64, 33), 1))
    return specs


def _shards(specs, rank, world):
    return [_local_shard(s, rank, world, i) for i, s in enumerate(specs)]


def check_stream_every_shape(rank, world, group):
    specs = _specs(world)
    shards = _shards(specs, rank, world)
    for dst in (None, 0, world - 1):
        for prefetch in (0, 1, 2):
            for bucket_bytes in (512, 1 << 20):
                seen = []
                with shardgather.unshard_stream(shards, specs, group, bucket_bytes=bucket_bytes,
                                                prefetch=prefetch, dst=dst, timeout=T) as s:
                    buffers = set()
                    for b, bucket in enumerate(s):
                        names = s.bucket_names(b)
                        seen.extend(names)
                        receives = dst is None or dst == rank
                        assert list(bucket) == (names if receives else []), (b, list(bucket))
                        for i, t in bucket.items():
                            same(t, _expected_full(specs[i], world, i), "param %d" % i)
                        if bucket:
                            buffers.add(next(iter(bucket.values())).untyped_storage().data_ptr())
                    assert len(buffers) <= prefetch + 1, buffers
                assert seen == list(range(len(specs)))
                if bucket_bytes == 512:
                    assert s.num_buckets > 4


def check_stream_state_dict_and_copy(rank, world, group):
    """A state dict in, dicts of names out; copy=True tensors outlive their bucket."""
    specs = _specs(world)
    names = ["layers.%d.w" % i for i in range(len(specs))]
    state = dict(zip(names, _shards(specs, rank, world)))
    kept = {}
    with shardgather.unshard_stream(state, dict(zip(names, specs)), group, bucket_bytes=700,
                                    copy=True, timeout=T) as s:
        for bucket in s:
            kept.update(bucket)
    assert list(kept) == names
    for i, name in enumerate(names):
        same(kept[name], _expected_full(specs[i], world, i), name)


def check_stream_reused(rank, world, group):
    """A stream iterated again gathers the shards' current values over the same buffers."""
    specs = _specs(world)
    shards = _shards(specs, rank, world)
    s = shardgather.unshard_stream(shards, specs, group, bucket_bytes=700, timeout=T)
    ptrs = []
    for step in (0, 1):
        if step == 1:  # the trainer updated its shards in place
            for i, sp in enumerate(specs):
                shards[i].copy_(_local_shard(sp, rank, world, i, step=1))
        seen = set()
        with s:
            for bucket in s:
                for i, t in bucket.items():
                    same(t, _expected_full(specs[i], world, i, step=step), "step %d %d" % (step, i))
                    seen.add(t.untyped_storage().data_ptr())
        ptrs.append(seen)
    assert ptrs[0] == ptrs[1], ptrs


def check_stream_consumer_raises(rank, world, group):
    """A consumer raising on the last rank ends the stream on every rank with its error."""
    specs = _specs(world)
    shards = _shards(specs, rank, world)
    for at in (1, "last"):
        with pytest.raises(shardgather.InvalidArgumentError) as info:
            with shardgather.unshard_stream(shards, specs, group, bucket_bytes=512,
                                            timeout=T) as s:
                stop = s.num_buckets - 1 if at == "last" else at
                for b, _ in enumerate(s):
                    if rank == world - 1 and b == stop:
                        raise ValueError("disk full at bucket %d" % b)
        msg = str(info.value)
        assert "rank %d" % (world - 1) in msg and "disk full" in msg, msg
        with pytest.raises(shardgather.InvalidArgumentError, match="failed earlier"):
            with s:  # a failed stream does not run again, on any rank
                pass
    # A loop left with break and no `with` (on every rank alike), then the stream dropped: its
    # started buckets complete before the shards go, and the group stays in step.
    s = shardgather.unshard_stream(shards, specs, group, bucket_bytes=512, prefetch=2, timeout=T)
    for b, _ in enumerate(s):
        if b == 1:
            break
    del s, _
    import gc

    gc.collect()
    # The group is still usable.
    full = shardgather.unshard(shards, specs, group, timeout=T)
    for i, s in enumerate(specs):
        same(full[i], _expected_full(s, world, i), "after %d" % i)


def check_stream_disagreement(rank, world, group):
    """Bucket sizes that differ on the last rank: every rank raises before anything moves; and
    leaving the stream early is reported on every rank."""
    specs = _specs(world)
    shards = _shards(specs, rank, world)
    if world > 1:
        with pytest.raises(shardgather.MismatchError):
            with shardgather.unshard_stream(shards, specs, group, timeout=T,
                                            bucket_bytes=1024 if rank == world - 1 else 512):
                pass
    with pytest.raises(shardgather.InvalidArgumentError, match="left the stream after 2 of"):
        with shardgather.unshard_stream(shards, specs, group, bucket_bytes=512, timeout=T) as s:
            for b, _ in enumerate(s):
                if b == 1:
                    break
    bad = list(shards)
    if rank == world - 1:
        bad[3] = torch.zeros(1, 1)
    with pytest.raises(shardgather.InvalidArgumentError, match="rank %d" % (world - 1)):
        with shardgather.unshard_stream(bad, specs, group, bucket_bytes=512, timeout=T):
            pass


def case_stream_every_shape(rank, world):
    check_stream_every_shape(rank, world, None)


def case_stream_state_dict_and_copy(rank, world):
    check_stream_state_dict_and_copy(rank, world, None)


def case_stream_reused(rank, world):
    check_stream_reused(rank, world, None)


def case_stream_consumer_raises(rank, world):
    check_stream_consumer_raises(rank, world, None)


def case_stream_disagreement(rank, world):
    check_stream_disagreement(rank, world, None)


def case_stream_dtensors(rank, world):
    """A DTensor state dict (Shard(0), Shard(1), Replicate) streams like full_tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    fulls = {"a": torch.randn(9, 4), "b": torch.randn(3, 7).to(torch.bfloat16),
             "c": torch.randn(5), "d": torch.randn(1, 6)}
    places = {"a": [Shard(0)], "b": [Shard(1)], "c": [Replicate()], "d": [Shard(0)]}
    state = {k: distribute_tensor(v, mesh, places[k]) for k, v in fulls.items()}
    got = {}
    with shardgather.unshard_stream(state, bucket_bytes=64, copy=True, timeout=T) as s:
        for bucket in s:
            got.update(bucket)
    assert list(got) == list(fulls)
    for k, v in fulls.items():
        same(got[k], v, k)


def case_stream_many_chunks(rank, world):
    """Streams larger than the torch transport's 8 MiB chunks, to every rank and to one, along
    dims 0 and 1 (the chunks then cut through rows of the full tensor)."""
    specs = [shardgather.ShardSpec(torch.float32, (2000, 5000), 1),
             shardgather.ShardSpec(torch.bfloat16, (4099, 2048), 0),
             shardgather.ShardSpec(torch.float32, (3, 7), 0)]
    shards = _shards(specs, rank, world)
    for dst in (None, world - 1):
        with shardgather.unshard_stream(shards, specs, bucket_bytes=1 << 20, dst=dst,
                                        timeout=T) as s:
            for bucket in s:
                for i, t in bucket.items():
                    same(t, _expected_full(specs[i], world, i), "param %d" % i)


def _llama_like(world, layers=2, hidden=64, vocab=1000, ffn=172):
    """(name, spec) of a small sharded Llama-like model: uneven embedding rows, bf16 and fp32,
    the MLP's down projection sharded along dim 1, and a parameter with empty shards."""
    uneven = [vocab - 3 * (world - 1)] + [3] * (world - 1)
    out = [("model.embed_tokens.weight",
            shardgather.ShardSpec(torch.bfloat16, (vocab, hidden), 0, sizes=uneven))]
    for i in range(layers):
        p = "model.layers.%d." % i
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + "self_attn.%s.weight" % proj,
                        shardgather.ShardSpec(torch.bfloat16, (hidden, hidden), 0)))
        out.append((p + "mlp.gate_proj.weight", shardgather.ShardSpec(torch.bfloat16, (ffn, hidden), 0)))
        out.append((p + "mlp.up_proj.weight", shardgather.ShardSpec(torch.bfloat16, (ffn, hidden), 0)))
        out.append((p + "mlp.down_proj.weight", shardgather.ShardSpec(torch.bfloat16, (hidden, ffn), 1)))
        out.append((p + "input_layernorm.weight", shardgather.ShardSpec(torch.float32, (hidden,), 0)))
        out.append((p + "post_attention_layernorm.weight",
                    shardgather.ShardSpec(torch.float32, (hidden,), 0)))
    out.append(("model.norm.weight", shardgather.ShardSpec(torch.float32, (1,), 0)))  # empty shards
    out.append(("lm_head.weight", shardgather.ShardSpec(torch.float32, (vocab, hidden), 0)))
    return out


def check_export(rank, world, group):
    """save_safetensors to rank world - 1, read back with safetensors: bit-exact, in HF layout."""
    import json
    import os
    import shutil
    import tempfile

    from safetensors import safe_open

    from shardgather.export import INDEX_NAME, save_safetensors

    named = _llama_like(world)
    specs = {k: s for k, s in named}
    state = {k: _local_shard(s, rank, world, i) for i, (k, s) in enumerate(named)}
    out = tempfile.mkdtemp(prefix="sg-export-")
    try:
        index = save_safetensors(state, out, specs, group, dst=world - 1, bucket_bytes=40000,
                                 progress=False, timeout=T)
        # A stream made once and saved again (a checkpoint every N steps) writes the same.
        stream = shardgather.unshard_stream(state, specs, group, bucket_bytes=40000,
                                            dst=world - 1, timeout=T)
        for _ in range(2):
            shutil.rmtree(out)
            os.makedirs(out)
            index = save_safetensors(stream, out, dst=world - 1, progress=False)
        if rank != world - 1:
            assert index is None and os.listdir(out) == []
            return
        with open(index) as f:
            meta = json.load(f)
        assert os.path.basename(index) == INDEX_NAME
        assert list(meta["weight_map"]) == [k for k, _ in named]
        files = sorted(set(meta["weight_map"].values()))
        assert len(files) > 2 and sorted(os.listdir(out)) == sorted(files + [INDEX_NAME])
        total = 0
        for name in files:
            with safe_open(os.path.join(out, name), "pt") as f:
                assert f.metadata()["format"] == "pt"
                for k in f.keys():
                    i = [n for n, _ in named].index(k)
                    t = f.get_tensor(k)
                    same(t, _expected_full(named[i][1], world, i), k)
                    assert meta["weight_map"][k] == name
                    total += t.nbytes
        assert meta["metadata"]["total_size"] == total
    finally:
        shutil.rmtree(out, ignore_errors=True)


def case_export(rank, world):
    check_export(rank, world, None)


def case_export_with_writers_is_byte_identical(rank, world):
    """save_safetensors with W writers (2 and the world) writes the same files, byte for byte,
    and the same index as with one writer, for uneven, empty and dim-1 shards."""
    import filecmp
    import os
    import shutil
    import tempfile

    from shardgather.export import save_safetensors

    named = _llama_like(world)
    specs = {k: s for k, s in named}
    state = {k: _local_shard(s, rank, world, i) for i, (k, s) in enumerate(named)}
    dirs = [tempfile.mkdtemp(prefix="sg-export-w%d-" % w) for w in (1, 2, world, 0)]
    try:
        for out, w in zip(dirs, (1, min(2, world), world)):
            save_safetensors(state, out, specs, dst=world - 1, bucket_bytes=40000,
                             progress=False, timeout=T, writers=w)
        # A stream made once (a checkpoint every N steps), saved by every rank as a writer.
        stream = shardgather.unshard_stream(state, specs, bucket_bytes=40000, dst=world - 1,
                                            timeout=T)
        save_safetensors(stream, dirs[3], dst=world - 1, progress=False, writers=world)
        if rank != world - 1:
            return
        one = sorted(os.listdir(dirs[0]))
        assert len(one) > 3, one
        for other in dirs[1:]:
            assert sorted(os.listdir(other)) == one, (os.listdir(other), one)
            _, mismatch, errors = filecmp.cmpfiles(dirs[0], other, one, shallow=False)
            assert not mismatch and not errors, (mismatch, errors)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def timeout_case_stream_stalled_consumer(rank, world):
    """The last rank's consumer stalls past the deadline mid-stream: every rank's stream ends
    with an error within a few deadlines (the peers time out; the stalled rank's own next
    bucket then cannot complete), and nothing hangs."""
    import time

    if world == 1:
        return
    specs = _specs(world)
    shards = _shards(specs, rank, world)
    t0 = time.monotonic()
    with pytest.raises((shardgather.CollectiveTimeout, shardgather.RemoteError)) as info:
        with shardgather.unshard_stream(shards, specs, bucket_bytes=512, timeout=1.0) as s:
            for b, _ in enumerate(s):
                if rank == world - 1 and b == 1:
                    time.sleep(3.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    if rank != world - 1:
        assert isinstance(info.value, shardgather.CollectiveTimeout), info.value


CHECKS = [check_stream_every_shape, check_stream_state_dict_and_copy, check_stream_reused,
          check_stream_consumer_raises, check_stream_disagreement, check_export]
CASES = sorted(name for name in dir() if name.startswith(("case_", "timeout_case_")))
