"""checkpoint_dir.CheckpointWriter: a checkpoint directory is replaced whole or not at all.

Stdlib and pytest only: the module is loaded from its source file, so neither torch nor the
built extension is needed. Every fake shard holds "<checkpoint tag>:<file name>", and every
index names its tag in its metadata, so a mix of two checkpoints is detectable.
"""

import errno
import importlib.util
import json
import os
import shutil
import warnings

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
    """Every file's bytes and every directory (None), by relative path."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), d) + "/"] = None
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


LEFTOVER = cd.STAGING_PREFIX + "1-dead"
STALE_TMP = "model-00002-of-00005.safetensors.tmp"


def old_state(d, old_names, extras=False):
    """The old checkpoint (None: a single-file model.safetensors) with the other files; with
    ``extras``, also a stale .tmp and a dead writer's staging dir, which the next commit's
    clean-up removes (after its commit point only)."""
    if old_names is not None:
        old_checkpoint(d, names=old_names)
    else:
        os.makedirs(d)
        write_bytes(os.path.join(d, "model.safetensors"), content("old", "model.safetensors"))
        for name, data in OTHERS.items():
            write_bytes(os.path.join(d, name), data)
        os.mkdir(os.path.join(d, "subdir"))
    if extras:
        write_bytes(os.path.join(d, STALE_TMP), b"partial")
        os.mkdir(os.path.join(d, LEFTOVER))
        write_bytes(os.path.join(d, LEFTOVER, "model-00001-of-00009.safetensors"), b"x")


def writer_with(d, tag, names):
    w = cd.CheckpointWriter(d)
    for name in names:
        w.write(name, lambda p, name=name: write_bytes(p, content(tag, name)))
    return w


SPIED = ("replace", "unlink", "rmdir", "fsync")


def spy_on(monkeypatch, d, k, make_exc, spied=SPIED):
    """Patches the os calls ``spied`` (those that change ``d``, and fsync) to check, before
    each, that a loader finds one whole checkpoint or none, and to raise ``make_exc()``
    instead of the (k+1)-th. Returns the call counter and a function that unpatches."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test here
    real = {f: getattr(os, f) for f in spied}
    calls = [0]

    def spy(f):
        def op(*args, **kwargs):
            assert consistent_tag(d) in ("old", "new", None)  # at every instant
            calls[0] += 1
            if calls[0] == k + 1:
                raise make_exc()
            return real[f](*args, **kwargs)
        return op

    for f in spied:
        monkeypatch.setattr(os, f, spy(f))
    return calls, lambda: [monkeypatch.setattr(os, f, real[f]) for f in spied]


@pytest.mark.parametrize("abort_after", [False, True], ids=["killed", "aborted"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_crash_at_every_commit_step(tmp_path, monkeypatch, scenario, abort_after):
    old_names, new_names = SCENARIOS[scenario]
    k = 0
    while True:
        d = str(tmp_path / ("k%d" % k))
        old_state(d, old_names)
        before = snapshot(d)
        w = writer_with(d, "new", new_names)
        # A death at an fsync is one at the next call: fsync is not counted here.
        _, unpatch = spy_on(monkeypatch, d, k, Crash, spied=SPIED[:-1])
        try:
            w.commit(index_for("new", new_names))
            crashed = False
        except Crash:
            crashed = True
        if crashed and abort_after:  # a BaseException in commit, then abort: it restores
            w.abort()
        unpatch()
        assert consistent_tag(d) in ("old", "new", None)
        if not crashed:
            assert_exactly(d, "new", new_names)
            break
        if abort_after and consistent_tag(d) != "new":  # the crash came before the commit point
            assert snapshot(d) == before
        # A later export over whatever was left cleans it all up.
        export(d, "third", shard_names(4))
        assert_exactly(d, "third", shard_names(4))
        assert not staging_dirs(d)
        k += 1
    assert k >= 3  # retire, move, index at least


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_oserror_at_every_commit_step_then_abort_restores_old(tmp_path, monkeypatch, scenario):
    """An OSError from the k-th rename/unlink/rmdir/fsync, for every k: before the commit
    point, commit raises and abort restores out_dir byte-identical (the stale .tmp and the
    dead writer's staging dir included, as clean-up waits for the commit point); after it,
    commit succeeds and warns of what its clean-up left. A fresh export then succeeds."""
    old_names, new_names = SCENARIOS[scenario]
    k = raised = warned = 0
    while True:
        d = str(tmp_path / ("k%d" % k))
        old_state(d, old_names, extras=True)
        before = snapshot(d)
        w = writer_with(d, "new", new_names)
        calls, unpatch = spy_on(monkeypatch, d, k, lambda: OSError(errno.EIO, "injected EIO"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                w.commit(index_for("new", new_names))
                failed = False
            except OSError:
                failed = True
                w.abort()
        unpatch()
        if failed:
            raised += 1
            assert not caught  # the restore itself succeeded
            assert snapshot(d) == before and staging_dirs(d) == [LEFTOVER]
        elif calls[0] > k:  # the OSError hit the clean-up, after the commit point
            warned += 1
            assert consistent_tag(d) == "new" and w.not_removed
            assert [str(c.message) for c in caught if "injected EIO" in str(c.message)]
        else:
            assert_exactly(d, "new", new_names)
            break
        export(d, "third", shard_names(4))
        assert_exactly(d, "third", shard_names(4))
        assert not staging_dirs(d)
        k += 1
    assert raised >= 4 and warned >= 2


@pytest.mark.parametrize("fail_on", ["old_file", "retired_index"])
def test_failed_restore_leaves_what_the_next_commit_needs(tmp_path, monkeypatch, fail_on):
    """The commit fails at the index rename and putting back an old file (or the old index)
    fails for good: abort warns, out_dir has no index (never a mix), and the staging dir keeps
    the retired index, so the next export still removes custom.safetensors, which only the
    old index named."""
    d = str(tmp_path)
    old_checkpoint(d, names=shard_names(3) + ["custom.safetensors"])
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    real_replace = os.replace

    def replace(src, dst):
        src_name = os.path.basename(src)
        if ((src_name == INDEX and os.path.dirname(src) != d)  # the new index's rename
                or (fail_on == "old_file" and src_name.startswith(".old."))
                or (fail_on == "retired_index" and src_name == ".retired.index.json"
                    and os.path.basename(dst) == INDEX)):
            raise OSError(errno.ESTALE, "injected ESTALE")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    w = writer_with(d, "new", shard_names(3))
    with pytest.raises(OSError):
        w.commit(index_for("new", shard_names(3)))
    with pytest.warns(RuntimeWarning, match="could not restore"):
        w.abort()
    monkeypatch.setattr(os, "replace", real_replace)
    assert consistent_tag(d) is None
    assert staging_dirs(d) == [os.path.basename(w.staging_dir)]
    assert os.path.exists(os.path.join(w.staging_dir, ".retired.index.json"))
    # The next writer's commit is as safe: failing too, it restores what it found.
    left = snapshot(d)
    w = writer_with(d, "next", shard_names(2))
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        w.commit(index_for("next", shard_names(2)))
    monkeypatch.setattr(os, "replace", real_replace)
    w.abort()
    assert snapshot(d) == left
    export(d, "third", shard_names(2))
    assert_exactly(d, "third", shard_names(2))
    assert not staging_dirs(d)


def test_undeletable_leftover_staging_does_not_fail_the_commit(tmp_path, monkeypatch):
    """Another user's leftover staging dir that cannot be deleted: every commit succeeds,
    warns naming it, and removes the files its retired index names; once it can be deleted,
    the next commit does."""
    d = str(tmp_path)
    old_checkpoint(d)
    leftover = os.path.join(d, LEFTOVER)
    os.mkdir(leftover)
    with open(os.path.join(leftover, ".retired.index.json"), "w") as f:
        json.dump(index_for("older", ["custom.safetensors"]), f)
    write_bytes(os.path.join(d, "custom.safetensors"), b"older")
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.abspath(path) == leftover:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(cd.shutil, "rmtree", rmtree)
    for tag in ("new", "newer"):
        w = writer_with(d, tag, shard_names(3))
        with pytest.warns(RuntimeWarning, match=LEFTOVER):
            w.commit(index_for(tag, shard_names(3)))
        assert w.not_removed and LEFTOVER in w.not_removed[0]
        assert set(os.listdir(d)) == (set(shard_names(3)) | {INDEX, LEFTOVER, "subdir"}
                                      | set(OTHERS))
        assert consistent_tag(d) == tag
    monkeypatch.setattr(cd.shutil, "rmtree", real_rmtree)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(d, "third", shard_names(2))
    assert_exactly(d, "third", shard_names(2))


def test_undeletable_stale_file_is_retried_by_the_next_commit(tmp_path, monkeypatch):
    """custom.safetensors, named only by the old index, cannot be deleted: the commit warns,
    keeps its name for the next commit, which deletes it."""
    d = str(tmp_path)
    old_checkpoint(d, names=shard_names(2) + ["custom.safetensors"])
    custom = os.path.join(d, "custom.safetensors")
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if path == custom:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    w = writer_with(d, "new", shard_names(3))
    with pytest.warns(RuntimeWarning, match="custom.safetensors"):
        w.commit(index_for("new", shard_names(3)))
    assert consistent_tag(d) == "new" and os.path.exists(custom)
    assert staging_dirs(d) == [os.path.basename(w.staging_dir)]  # kept: it names custom
    monkeypatch.setattr(os, "unlink", real_unlink)
    export(d, "third", shard_names(1))
    assert_exactly(d, "third", shard_names(1))
    assert not staging_dirs(d)


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
