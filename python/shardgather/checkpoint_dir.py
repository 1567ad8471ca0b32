"""Replaces the sharded safetensors checkpoint in a directory atomically, at the checkpoint level.

    w = CheckpointWriter(out_dir)                       # makes out_dir and a private staging dir
    w.write("model-00001-of-00002.safetensors", fn)     # fn(path) writes the file at `path`
    w.write("model-00002-of-00002.safetensors", fn)
    w.commit({"metadata": {...}, "weight_map": {...}})  # the new checkpoint is now out_dir's

or ``with CheckpointWriter(out_dir) as w: ...``: leaving the block by an exception, or without
calling :meth:`commit`, discards the new checkpoint (:meth:`abort`).

Stdlib only. A checkpoint is the index ``<stem>.safetensors.index.json`` (default
``model.safetensors.index.json``, ``{"metadata": ..., "weight_map": {tensor: file}}``) and the
``*.safetensors`` files it names, plain file names in ``out_dir``.

Contract (the "old" checkpoint is what ``out_dir`` held before; "at any instant" includes a crash
of the process or of the machine there, as files and directories are fsynced before each step
that depends on them):

* Until :meth:`commit` starts, ``out_dir`` is untouched but for the hidden staging directory
  ``.shardgather-staging-<pid>-<random>`` inside it, where the new files are written.
  :meth:`abort` (or a failed :meth:`write`, then abort) removes it: the old checkpoint stays
  byte-identical and readable.
* During :meth:`commit`, at any instant ``out_dir`` holds either the old index with every old
  file intact, or no index at all, or the new index with every new file complete. An index
  never names a mix of old and new files. (A single-file ``<stem>.safetensors`` old checkpoint
  stays whole until it is deleted, just before the new index appears.)
* After :meth:`commit` returns, nothing a loader could confuse with the new checkpoint remains:
  every ``*.safetensors`` file the old index named that the new one does not; every file named
  like a shard, ``<stem>-NNNNN-of-NNNNN.safetensors``, that the new index does not name; a
  single-file ``<stem>.safetensors`` (``transformers`` prefers it to the index, so it would
  shadow the new checkpoint) unless the new index names it; ``<name>.tmp`` files of those names
  and of the index (``export.py``'s temporaries); and staging directories left by crashed
  exports of this module (a retired index they hold counts as an old index).
* Every other entry of ``out_dir`` is left alone: ``config.json``, tokenizer files, ``*.bin``
  checkpoints and their index, subdirectories, any other user file.
* An unreadable or malformed old index counts as no old index: the name-pattern rules above
  still apply.
* If :meth:`commit` itself fails (an OSError) after the old index is gone, ``out_dir`` is left
  with no index; :meth:`abort` then keeps only the retired old index in the staging directory
  so that the next export can finish the clean-up. A process that dies leaves its whole
  staging directory, which the next export's commit removes.
* One writer at a time per directory: two concurrent writers (threads, processes, hosts) are
  not supported; a commit removes other writers' staging directories.
"""

import json
import os
import re
import secrets
import shutil

__all__ = ["CheckpointWriter", "INDEX_NAME", "STAGING_PREFIX"]

INDEX_NAME = "model.safetensors.index.json"
STAGING_PREFIX = ".shardgather-staging-"
_INDEX_SUFFIX = ".safetensors.index.json"
_RETIRED_INDEX = ".retired.index.json"  # hidden: write() refuses hidden names, so no clash


class CheckpointWriter:
    """Writes a new checkpoint into a staging directory, then swaps it in (see the module)."""

    def __init__(self, out_dir, index_name=INDEX_NAME):
        if not index_name.endswith(_INDEX_SUFFIX) or not _is_plain_name(index_name):
            raise ValueError("CheckpointWriter: index_name must be a plain '<stem>%s' file name,"
                             " not %r" % (_INDEX_SUFFIX, index_name))
        stem = index_name[:-len(_INDEX_SUFFIX)]
        self.out_dir = os.fspath(out_dir)
        self.index_name = index_name
        self._single_name = stem + ".safetensors"
        self._shard_re = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors\Z")
        os.makedirs(self.out_dir, exist_ok=True)
        # Inside out_dir, so on its filesystem: moving a file out of it is an atomic rename.
        self.staging_dir = os.path.join(
            self.out_dir, "%s%d-%s" % (STAGING_PREFIX, os.getpid(), secrets.token_hex(4)))
        os.mkdir(self.staging_dir)
        self._names = set()
        self._state = "open"  # -> "committing" -> "committed", or -> "aborted"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._state != "committed":
            self.abort()
        return False

    # ---- writing --------------------------------------------------------------------------

    def write(self, file_name, write_fn):
        """Calls ``write_fn(path)`` to write ``file_name`` at a staging path, then fsyncs it.
        Returns the staging path. ``file_name``: a plain, non-hidden ``*.safetensors`` name."""
        self._check_state("write")
        self._check_file_name(file_name)
        path = os.path.join(self.staging_dir, file_name)
        try:
            write_fn(path)
            if not os.path.isfile(path):
                raise RuntimeError("CheckpointWriter.write: write_fn did not create %r" % path)
            _fsync_file(path)  # write_fn may not have: commit's renames must not outrun data
        except BaseException:
            _remove_quietly(path)  # a half-written file must never be moved in
            raise
        self._names.add(file_name)
        return path

    def _check_file_name(self, name):
        if not isinstance(name, str) or not _is_plain_name(name) or name.startswith("."):
            raise ValueError("CheckpointWriter.write: %r is not a plain, non-hidden file name"
                             % (name,))
        if not name.endswith(".safetensors"):
            # Clean-up only ever deletes *.safetensors names: the files written must be such.
            raise ValueError("CheckpointWriter.write: %r is not a *.safetensors name" % name)
        if name in self._names:
            raise ValueError("CheckpointWriter.write: %r was already written" % name)

    # ---- committing -----------------------------------------------------------------------

    def commit(self, index):
        """Makes the written files, under ``index``, the directory's checkpoint; returns the
        index's path. ``index["weight_map"]`` must name exactly the files written."""
        self._check_state("commit")
        self._check_index(index)
        self._check_targets()  # fail here, with out_dir untouched, not halfway through
        staged_index = os.path.join(self.staging_dir, self.index_name)
        _write_json(staged_index, index)
        _fsync_file(staged_index)
        _fsync_dir(self.staging_dir)  # 1. the whole new checkpoint is durable in staging
        self._state = "committing"
        self._retire_old_index()      # 2. no index now: no later step can create a mix
        _fsync_dir(self.out_dir)      #    (durable before any old file is overwritten)
        for name in sorted(self._names):  # 3. new files in, over old ones of the same names
            os.replace(os.path.join(self.staging_dir, name), os.path.join(self.out_dir, name))
        self._remove_stale()          # 4. what the new index could be confused with
        _fsync_dir(self.out_dir)      #    (all durable before the index can appear)
        index_path = os.path.join(self.out_dir, self.index_name)
        os.replace(staged_index, index_path)  # 5. the commit point
        _fsync_dir(self.out_dir)
        self._state = "committed"
        _rmtree_quietly(self.staging_dir)     # 6. only the retired index is left in it
        return index_path

    def _check_index(self, index):
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError("CheckpointWriter.commit: the index needs a 'weight_map' dict")
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError("CheckpointWriter.commit: 'weight_map' values must be file names")
        named = set(weight_map.values())
        # An index naming a file not written here would name an old file: the mix to avoid.
        if named != self._names:
            raise ValueError("CheckpointWriter.commit: the index names %s but the files written"
                             " are %s" % (sorted(map(str, named)), sorted(self._names)))

    def _check_targets(self):
        for name in sorted(self._names) + [self.index_name]:
            path = os.path.join(self.out_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                raise IsADirectoryError("CheckpointWriter.commit: %r is a directory" % path)

    def _retire_old_index(self):
        """Moves the old index (if any) into staging: a rename, so at every instant out_dir
        holds it whole or not at all; kept there so a crash does not lose what it named."""
        try:
            os.replace(os.path.join(self.out_dir, self.index_name),
                       os.path.join(self.staging_dir, _RETIRED_INDEX))
        except FileNotFoundError:
            pass

    def _remove_stale(self):
        """Deletes the files of step 4 (module docstring) and other writers' staging dirs."""
        stale = set(_names_in_index(os.path.join(self.staging_dir, _RETIRED_INDEX)))
        entries = list(os.scandir(self.out_dir))
        for entry in entries:  # first: leftover staging dirs, and the indexes they retired
            if entry.name.startswith(STAGING_PREFIX) and entry.path != self.staging_dir:
                stale.update(_names_in_index(os.path.join(entry.path, _RETIRED_INDEX)))
                _remove_entry(entry)
        for entry in entries:
            if not entry.name.startswith(STAGING_PREFIX) and self._is_stale(entry.name, stale):
                if not entry.is_dir(follow_symlinks=False):
                    _remove_entry(entry)

    def _is_stale(self, name, old_names):
        if name in self._names or name == self.index_name:
            return False
        if name.endswith(".tmp"):  # a temporary of a checkpoint name: an interrupted write
            base = name[:-len(".tmp")]
            return base in self._names or base == self.index_name or self._is_stale(base,
                                                                                   old_names)
        if not name.endswith(".safetensors"):
            return False  # an old index naming config.json or *.bin does not get it deleted
        return name in old_names or name == self._single_name or bool(self._shard_re.match(name))

    # ---- aborting -------------------------------------------------------------------------

    def abort(self):
        """Discards the new checkpoint: removes the staging directory. Before commit the old
        checkpoint is untouched; after a failed commit, see the module docstring. Idempotent."""
        if self._state in ("committed", "aborted"):
            return
        retired = os.path.join(self.staging_dir, _RETIRED_INDEX)
        keep_retired = self._state == "committing" and os.path.lexists(retired)
        self._state = "aborted"
        if not keep_retired:
            _rmtree_quietly(self.staging_dir)
            return
        # The old index is gone from out_dir; what it named is still to clean up next time.
        for entry in os.scandir(self.staging_dir):
            if entry.name != _RETIRED_INDEX:
                _remove_entry(entry)

    def _check_state(self, what):
        if self._state != "open":
            raise RuntimeError("CheckpointWriter.%s: the writer is %s" % (what, self._state))


# ---- helpers ----------------------------------------------------------------------------


def _is_plain_name(name):
    return (bool(name) and name not in (".", "..") and os.path.basename(name) == name
            and "/" not in name and (os.altsep is None or os.altsep not in name))


def _names_in_index(path):
    """The file names an index names; none if it is missing, unreadable or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def _write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def _fsync_file(path):
    # fsync on any descriptor flushes the file's data, whoever wrote it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path):
    """Makes the directory's entries (renames, deletions) durable; no-op where unsupported."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_entry(entry):
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path)
    else:
        os.unlink(entry.path)


def _remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmtree_quietly(path):
    shutil.rmtree(path, ignore_errors=True)
