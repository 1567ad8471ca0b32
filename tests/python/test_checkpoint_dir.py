"""checkpoint_dir.CheckpointWriter: a checkpoint directory is replaced whole or not at all.

Stdlib and pytest only: the module is loaded from its source file, so neither torch nor the
built extension is needed. Every fake shard holds "<checkpoint tag>:<file name>", and every
index names its tag in its metadata, so a mix of two checkpoints is detectable.
"""

import importlib.util
import json
import os

import pytest

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python",
                    "shardgather", "checkpoint_dir.py")
_spec = importlib.util.spec_from_file_location("shardgather_checkpoint_dir", _SRC)
cd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cd)

INDEX = cd.INDEX_NAME
OTHERS = {"config.json": b'{"model_type": "x"}\n', "tokenizer.json": b"{}\n",
          "pytorch_model.bin": b"old bin", "notes.tmp": b"user notes"}


class Crash(BaseException):
    """The process dies here (not an OSError: nothing may catch it)."""


def shard_names(n):
    return ["model-%05d-of-%05d.safetensors" % (i + 1, n) for i in range(n)]


def content(tag, name):
    return ("%s:%s" % (tag, name)).encode()


def index_for(tag, names):
    return {"metadata": {"total_size": 0, "checkpoint": tag},
            "weight_map": {"w%d" % i: name for i, name in enumerate(names)}}


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


def old_checkpoint(d, tag="old", names=None, others=True):
    """An existing checkpoint as export.py writes it: the files, then the index."""
    os.makedirs(d, exist_ok=True)
    names = shard_names(5) if names is None else names
    for name in names:
        write_bytes(os.path.join(d, name), content(tag, name))
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(index_for(tag, names), f)
    if others:
        for name, data in OTHERS.items():
            write_bytes(os.path.join(d, name), data)
    os.mkdir(os.path.join(d, "subdir"))


def export(d, tag, names):
    w = cd.CheckpointWriter(d)
    for name in names:
        w.write(name, lambda p, name=name: write_bytes(p, content(tag, name)))
    return w.commit(index_for(tag, names))


def snapshot(d):
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, d)] = fh.read()
    return out


def staging_dirs(d):
    return [n for n in os.listdir(d) if n.startswith(cd.STAGING_PREFIX)]


def consistent_tag(d):
    """The tag of the checkpoint a loader would read now (None: none), asserting that every
    file the index names is complete and from that same checkpoint, and that no single-file
    model.safetensors it does not name shadows it (transformers would read that instead)."""
    path = os.path.join(d, INDEX)
    single = os.path.join(d, "model.safetensors")
    if not os.path.exists(path):
        if os.path.exists(single):  # transformers would read it: it must be whole
            with open(single, "rb") as f:
                return f.read().split(b":")[0].decode()
        return None
    with open(path) as f:
        index = json.load(f)
    tag = index["metadata"]["checkpoint"]
    assert ("model.safetensors" in index["weight_map"].values()
            or not os.path.exists(single)), "model.safetensors shadows index %s" % tag
    for name in set(index["weight_map"].values()):
        with open(os.path.join(d, name), "rb") as f:
            assert f.read() == content(tag, name), "index %s names a foreign %s" % (tag, name)
    return tag


def assert_exactly(d, tag, names, others=True):
    expect = set(names) | {INDEX} | (set(OTHERS) | {"subdir"} if others else set())
    assert set(os.listdir(d)) == expect
    assert consistent_tag(d) == tag
    if others:
        for name, data in OTHERS.items():
            with open(os.path.join(d, name), "rb") as f:
                assert f.read() == data


def test_fresh_dir(tmp_path):
    d = str(tmp_path / "a" / "ckpt")
    assert export(d, "new", shard_names(3)) == os.path.join(d, INDEX)
    assert_exactly(d, "new", shard_names(3), others=False)


def test_overwrite_5_shards_with_3_removes_old_extras_keeps_others(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    export(d, "new", shard_names(3))
    assert_exactly(d, "new", shard_names(3))


def test_abort_after_two_of_three_leaves_old_byte_identical(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    before = snapshot(d)
    w = cd.CheckpointWriter(d)
    for name in shard_names(3)[:2]:
        w.write(name, lambda p, name=name: write_bytes(p, content("new", name)))
    assert staging_dirs(d)
    w.abort()
    w.abort()  # idempotent
    assert snapshot(d) == before and not staging_dirs(d)
    with pytest.raises(RuntimeError):
        w.write("model-00003-of-00003.safetensors", lambda p: write_bytes(p, b""))


def test_exception_in_context_manager_leaves_old_byte_identical(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    before = snapshot(d)
    with pytest.raises(KeyError):
        with cd.CheckpointWriter(d) as w:
            w.write(shard_names(3)[0], lambda p: write_bytes(p, b"new"))
            raise KeyError("gather failed")
    assert snapshot(d) == before and not staging_dirs(d)


def test_failing_write_fn_and_missing_commit_discard(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    before = snapshot(d)

    def half_then_fail(path):
        write_bytes(path, b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        with cd.CheckpointWriter(d) as w:
            w.write(shard_names(3)[0], half_then_fail)
    with cd.CheckpointWriter(d) as w:  # leaving the block without commit() discards
        w.write(shard_names(3)[0], lambda p: write_bytes(p, b"new"))
    assert snapshot(d) == before and not staging_dirs(d)


SCENARIOS = {  # old files -> new files
    "5_to_3": (shard_names(5), shard_names(3)),
    "3_to_5": (shard_names(3), shard_names(5)),
    "same_names": (shard_names(3), shard_names(3)),
    "custom_names": (["a.safetensors", "b.safetensors"], shard_names(2)),
    "single_file": (None, shard_names(2)),
    "single_to_single": (None, ["model.safetensors"]),
}


@pytest.mark.parametrize("abort_after", [False, True], ids=["killed", "aborted"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_crash_at_every_commit_step(tmp_path, monkeypatch, scenario, abort_after):
    old_names, new_names = SCENARIOS[scenario]
    # A simulated crash is a process death, which fsync does not affect: skip its cost here.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    real = {f: getattr(os, f) for f in ("replace", "unlink", "rmdir")}
    k = 0
    while True:
        d = str(tmp_path / ("k%d" % k))
        if old_names is None:  # an old single-file checkpoint
            os.makedirs(d)
            write_bytes(os.path.join(d, "model.safetensors"), content("old", "model.safetensors"))
        else:
            old_checkpoint(d, names=old_names)
        w = cd.CheckpointWriter(d)
        for name in new_names:
            w.write(name, lambda p, name=name: write_bytes(p, content("new", name)))
        calls = [0]

        def spy(f):
            def op(*args, **kwargs):
                assert consistent_tag(d) in ("old", "new", None)  # at every instant
                calls[0] += 1
                if calls[0] == k + 1:
                    raise Crash()
                return real[f](*args, **kwargs)
            return op

        for f in real:
            monkeypatch.setattr(os, f, spy(f))
        try:
            w.commit(index_for("new", new_names))
            crashed = False
        except Crash:
            crashed = True
        for f in real:
            monkeypatch.setattr(os, f, real[f])
        assert consistent_tag(d) in ("old", "new", None)
        if not crashed:
            assert_exactly(d, "new", new_names, others=old_names is not None)
            break
        if abort_after:
            w.abort()
        # A later export over whatever was left cleans it all up.
        export(d, "third", shard_names(4))
        assert_exactly(d, "third", shard_names(4), others=old_names is not None)
        assert not staging_dirs(d)
        k += 1
    assert k >= 3  # retire, move, index at least


def test_crash_while_writing_leaves_old_intact_and_next_export_cleans(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    before = snapshot(d)
    w = cd.CheckpointWriter(d)
    w.write(shard_names(3)[0], lambda p: write_bytes(p, b"new"))
    del w  # the process died: its staging dir stays
    assert {k: v for k, v in snapshot(d).items() if not k.startswith(".")} == before
    assert consistent_tag(d) == "old"
    export(d, "new", shard_names(2))
    assert_exactly(d, "new", shard_names(2))


def test_old_single_file_checkpoint_removed(tmp_path):
    d = str(tmp_path)
    write_bytes(tmp_path / "model.safetensors", b"old single file")
    write_bytes(tmp_path / "config.json", b"{}")
    export(d, "new", shard_names(2))
    assert set(os.listdir(d)) == set(shard_names(2)) | {INDEX, "config.json"}


@pytest.mark.parametrize("bad", [b"{not json", b"[1, 2]", b'{"weight_map": [1]}', b"\xff\xfe"])
def test_corrupt_old_index_counts_as_none(tmp_path, bad):
    d = str(tmp_path)
    old_checkpoint(d, names=shard_names(4) + ["custom.safetensors"])
    write_bytes(tmp_path / INDEX, bad)
    export(d, "new", shard_names(2))
    # Shard-pattern files go; a custom name only the unreadable index knew of cannot be known.
    assert_exactly(d, "new", shard_names(2) + ["custom.safetensors"])


def test_old_index_names_only_safetensors_deleted(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d, names=["custom.safetensors", "config.json"])
    export(d, "new", shard_names(1))
    assert_exactly(d, "new", shard_names(1))  # config.json kept, custom.safetensors gone


def test_stale_tmp_files_and_leftover_staging_removed(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    for name in ("model-00002-of-00005.safetensors.tmp", INDEX + ".tmp",
                 "model.safetensors.tmp"):
        write_bytes(tmp_path / name, b"partial")
    leftover = tmp_path / (cd.STAGING_PREFIX + "1-dead")
    leftover.mkdir()
    write_bytes(leftover / "model-00001-of-00009.safetensors", b"x")
    export(d, "new", shard_names(3))
    assert_exactly(d, "new", shard_names(3))  # notes.tmp (a user file) is kept


def test_invalid_use_is_refused_before_touching_out_dir(tmp_path):
    d = str(tmp_path)
    old_checkpoint(d)
    before = snapshot(d)
    with cd.CheckpointWriter(d) as w:
        for bad in ("../x.safetensors", "sub/x.safetensors", ".x.safetensors", "x.bin", INDEX,
                    "", None):
            with pytest.raises(ValueError):
                w.write(bad, lambda p: write_bytes(p, b""))
        with pytest.raises(RuntimeError):
            w.write("x.safetensors", lambda p: None)  # write_fn wrote nothing
        w.write(shard_names(2)[0], lambda p: write_bytes(p, b"new"))
        with pytest.raises(ValueError):
            w.write(shard_names(2)[0], lambda p: write_bytes(p, b"new"))
        with pytest.raises(ValueError):  # names a file not written: it would be an old one
            w.commit(index_for("new", shard_names(2)))
        with pytest.raises(ValueError):
            w.commit({"weight_map": {"w": ["not", "a", "name"]}})
    assert snapshot(d) == before and not staging_dirs(d)
    with pytest.raises(ValueError):
        cd.CheckpointWriter(d, index_name="model.json")


def test_custom_index_name(tmp_path):
    d = str(tmp_path)
    write_bytes(tmp_path / "adapter-00001-of-00002.safetensors", b"old")
    write_bytes(tmp_path / "model-00001-of-00002.safetensors", b"other checkpoint kept")
    w = cd.CheckpointWriter(d, index_name="adapter.safetensors.index.json")
    w.write("adapter-00001-of-00001.safetensors", lambda p: write_bytes(p, b"new"))
    w.commit({"weight_map": {"w": "adapter-00001-of-00001.safetensors"}})
    assert set(os.listdir(d)) == {"adapter-00001-of-00001.safetensors",
                                  "adapter.safetensors.index.json",
                                  "model-00001-of-00002.safetensors"}
