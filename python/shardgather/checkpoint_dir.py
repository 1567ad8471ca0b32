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

:meth:`commit`'s steps: (1) the new files and index are fsynced in the staging directory;
(2) the old index is renamed into it (retired); (3) each new file is renamed into ``out_dir``,
an old file of its name first renamed into the staging directory, and then so is a single-file
``<stem>.safetensors`` the new index does not name (``transformers`` prefers it to an index, so
it would shadow the new checkpoint); (4) the new index is renamed into ``out_dir``, then
fsynced: the **commit point**; (5) best-effort clean-up. Nothing is deleted before the commit
point: everything the commit displaces until then is kept, under a hidden name, in the staging
directory, so that it can be put back.

Contract (the "old" checkpoint is what ``out_dir`` held before; "at any instant" includes a crash
of the process or of the machine there, as files and directories are fsynced before each step
that depends on them):

* Until :meth:`commit` starts, ``out_dir`` is untouched but for the hidden staging directory
  ``.shardgather-staging-<pid>-<random>`` inside it, where the new files are written.
  :meth:`abort` (or a failed :meth:`write`, then abort) removes it: the old checkpoint stays
  byte-identical and readable.
* During :meth:`commit`, and during :meth:`abort`'s restore, at any instant ``out_dir`` holds
  either the old index with every old file intact, or no index at all, or the new index with
  every new file complete. An index never names a mix of old and new files, and while there is
  no index a ``<stem>.safetensors`` there is a whole file of one checkpoint.
* If :meth:`commit` raises before its commit point (any exception, e.g. an OSError of a
  rename; after it, only a KeyboardInterrupt or the like can make it raise, with the new
  checkpoint in place), :meth:`abort` (which ``with`` calls) restores the old checkpoint: renames
  back every file set aside, then the old index, last. ``out_dir`` is byte-identical to before,
  with the same entries, none of this writer's. If a rename back fails, abort warns
  (``RuntimeWarning``) and stops there: ``out_dir`` may have no index (never a mix), and the
  staging directory is left with the retired index and the old files not yet put back.
* After :meth:`commit` returns (the commit point passed), the new checkpoint is ``out_dir``'s.
  Its clean-up then removes what a loader could confuse with it: every ``*.safetensors`` file
  the old index named that the new one does not; every file named like a shard,
  ``<stem>-NNNNN-of-NNNNN.safetensors``, that the new index does not name; ``<name>.tmp`` files
  (``export.py``'s temporaries) of those names, of the new files and of the index; and the
  staging directories of other writers (a retired index they hold counts as an old index).
  These wait until the commit point because none can mislead before it (there is no index
  meanwhile) nor after it (the new index names none of them). So a failure to remove one does
  not fail the commit: what could not be removed is in :attr:`not_removed` and a
  ``RuntimeWarning``, and the next commit retries it (names that only an old index knew are
  kept for it in an index left in this writer's staging directory).
* A process that dies leaves its staging directory, and ``out_dir`` in one of the states above.
  A new writer does not restore a dead writer's checkpoint: if that left no index, ``out_dir``
  has none until the next commit, which is as safe as any (it sets aside, and restores on
  failure, what it finds) and, after its commit point, treats the retired index left there as
  an old index and removes that staging directory with the old files it held.
* Every other entry of ``out_dir`` is left alone: ``config.json``, tokenizer files, ``*.bin``
  checkpoints and their index, subdirectories, any other user file.
* An unreadable or malformed old index counts as no old index: the name-pattern rules above
  still apply.
* One writer at a time per directory: two concurrent writers (threads, processes, hosts) are
  not supported; a commit removes other writers' staging directories.
"""

import json
import os
import re
import secrets
import shutil
import warnings

__all__ = ["CheckpointWriter", "INDEX_NAME", "STAGING_PREFIX"]

INDEX_NAME = "model.safetensors.index.json"
STAGING_PREFIX = ".shardgather-staging-"
_INDEX_SUFFIX = ".safetensors.index.json"
# Hidden names in the staging directory: write() refuses hidden names, so neither can clash.
_RETIRED_INDEX = ".retired.index.json"
_SET_ASIDE = ".old."  # + the name of an old file displaced by commit, to be put back on abort


class CheckpointWriter:
    """Writes a new checkpoint into a staging directory, then swaps it in (see the module).
    ``not_removed``: after :meth:`commit`, the paths its clean-up could not remove."""

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
        self.not_removed = []
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

    def adopt(self, file_name):
        """Takes ``file_name``, written into the staging directory by another process (a
        writer rank of a multi-writer export, on this filesystem), as one of this checkpoint's
        files; fsyncs it. Returns its staging path."""
        self._check_state("adopt")
        self._check_file_name(file_name)
        path = os.path.join(self.staging_dir, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError("CheckpointWriter.adopt: %r was not written" % path)
        _fsync_file(path)
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
        index's path. ``index["weight_map"]`` must name exactly the files written. If it
        raises, :meth:`abort` restores the old checkpoint (see the module)."""
        self._check_state("commit")
        self._check_index(index)
        self._check_targets()  # fail here, with out_dir untouched, not halfway through
        staged_index = os.path.join(self.staging_dir, self.index_name)
        _write_json(staged_index, index)
        _fsync_file(staged_index)
        _fsync_dir(self.staging_dir)  # 1. the whole new checkpoint is durable in staging
        self._state = "committing"    #    from here on, abort() restores
        self._retire_old_index()      # 2. no index now: no later step can create a mix
        self._fsync_both()            #    (durable before any old file is displaced)
        self._move_in()               # 3. new files in, displaced old ones set aside
        self._fsync_both()            #    (all durable before the index can appear)
        index_path = os.path.join(self.out_dir, self.index_name)
        os.replace(staged_index, index_path)  # 4. the new index appears ...
        _fsync_dir(self.out_dir)
        self._state = "committed"             #    ... durably: the commit point
        self.not_removed = self._clean_up()   # 5. best-effort: the commit has succeeded
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
            if _is_real_dir(os.path.join(self.out_dir, name)):
                raise IsADirectoryError("CheckpointWriter.commit: %r is a directory"
                                        % os.path.join(self.out_dir, name))

    def _retire_old_index(self):
        """Moves the old index (if any) into staging: a rename, so at every instant out_dir
        holds it whole or not at all; kept there to be put back, or to name the old files."""
        try:
            os.replace(os.path.join(self.out_dir, self.index_name),
                       os.path.join(self.staging_dir, _RETIRED_INDEX))
        except FileNotFoundError:
            pass

    def _move_in(self):
        """Step 3. There is no index meanwhile, so out_dir's shard files may mix; only a
        single-file checkpoint is loaded without one, and it is whole old or whole new."""
        for name in sorted(self._names):
            self._set_aside(name)  # not deleted: abort() puts it back
            os.replace(os.path.join(self.staging_dir, name), os.path.join(self.out_dir, name))
        if self._single_name not in self._names:
            # It must be gone before the new index appears, or it would shadow it.
            self._set_aside(self._single_name)

    def _set_aside(self, name):
        path = os.path.join(self.out_dir, name)
        if os.path.lexists(path) and not _is_real_dir(path):
            os.replace(path, os.path.join(self.staging_dir, _SET_ASIDE + name))

    def _fsync_both(self):
        # A rename between the two directories: both entries durable, in whichever order.
        _fsync_dir(self.out_dir)
        _fsync_dir(self.staging_dir)

    # ---- cleaning up, after the commit point ----------------------------------------------

    def _clean_up(self):
        """Step 5: removes what the new index could be confused with, best-effort (the new
        checkpoint is complete and indexed, so a failure here must not fail the commit).
        Returns the paths not removed, and warns of them."""
        failed, stale_failed = [], []
        try:
            leftovers = self._leftover_staging()
            old_names = self._old_names(leftovers)
            # Files before staging dirs: the retired indexes in these name some of the files.
            for entry in os.scandir(self.out_dir):
                if self._is_stale_entry(entry, old_names) and not _remove(entry.path, failed):
                    stale_failed.append(entry.name)
            for path in leftovers:
                _remove(path, failed)
            self._finish_staging(stale_failed, failed)
        except OSError as e:  # out_dir unreadable: all our staging dir stays, for the next one
            failed.append("%s (%s)" % (self.out_dir, e))
        if failed:
            warnings.warn("CheckpointWriter.commit: the new checkpoint is in place in %s, but "
                          "its clean-up could not remove %s; the next commit retries"
                          % (self.out_dir, ", ".join(failed)), RuntimeWarning, stacklevel=3)
        return failed

    def _leftover_staging(self):
        return [e.path for e in os.scandir(self.out_dir)
                if e.name.startswith(STAGING_PREFIX) and e.path != self.staging_dir]

    def _old_names(self, leftovers):
        names = set()
        for staging in [self.staging_dir] + leftovers:
            names |= _names_in_index(os.path.join(staging, _RETIRED_INDEX))
        return names

    def _is_stale_entry(self, entry, old_names):
        return (not entry.name.startswith(STAGING_PREFIX) and not entry.is_dir(
            follow_symlinks=False) and self._is_stale(entry.name, old_names))

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

    def _finish_staging(self, stale_failed, failed):
        """Removes this writer's staging dir (the retired index, the old files set aside), or,
        if stale files stayed, keeps it holding just an index naming them: the next commit
        reads it as a retired index, so it retries names that only an old index knew."""
        if not stale_failed:
            _remove(self.staging_dir, failed)
            return
        # Of a stale "x.tmp", "x": it was new, stale or the index, so is safe to name.
        names = sorted({n[:-len(".tmp")] if n.endswith(".tmp") else n for n in stale_failed})
        for entry in os.scandir(self.staging_dir):
            if entry.name.startswith(_SET_ASIDE):
                _remove(entry.path, failed)
        path = os.path.join(self.staging_dir, _RETIRED_INDEX)
        _write_json(path + ".tmp", {"weight_map": {n: n for n in names}})
        os.replace(path + ".tmp", path)  # whole: the old retired index, or this one

    # ---- aborting -------------------------------------------------------------------------

    def abort(self):
        """Discards the new checkpoint: restores the old one after a failed commit (see the
        module; it warns if it cannot), then removes the staging directory. Idempotent."""
        if self._state in ("committed", "aborted"):
            return
        restore = self._state == "committing"
        self._state = "aborted"
        if restore:
            try:
                self._roll_back()
            except OSError as e:  # keep what the next commit needs: see the module
                warnings.warn("CheckpointWriter.abort: could not restore the old checkpoint in"
                              " %s (%s); %s keeps the retired index and the old files not put"
                              " back" % (self.out_dir, e, self.staging_dir), RuntimeWarning,
                              stacklevel=2)
                return
        _rmtree_quietly(self.staging_dir)

    def _roll_back(self):
        """Undoes steps 2-4 in the reverse order: from the new index (if it appeared) to no
        index, to the old files back, to the old index. Raises the first OSError."""
        index_path = os.path.join(self.out_dir, self.index_name)
        if not os.path.lexists(os.path.join(self.staging_dir, self.index_name)):
            _unlink_if_present(index_path)  # step 4 ran (its fsync failed): the index first
        for name in self._names:
            staged = os.path.join(self.staging_dir, name)
            set_aside = os.path.join(self.staging_dir, _SET_ASIDE + name)
            # Moved in, over no old file: not the old checkpoint's, so it goes.
            if not os.path.lexists(staged) and not os.path.lexists(set_aside):
                _unlink_if_present(os.path.join(self.out_dir, name))
        for entry in os.scandir(self.staging_dir):
            if entry.name.startswith(_SET_ASIDE):  # back, over a new file of its name if any
                os.replace(entry.path, os.path.join(self.out_dir, entry.name[len(_SET_ASIDE):]))
        _fsync_dir(self.out_dir)  # every old file back, durably, before the index
        retired = os.path.join(self.staging_dir, _RETIRED_INDEX)
        if os.path.lexists(retired):
            os.replace(retired, index_path)
            _fsync_dir(self.out_dir)

    def _check_state(self, what):
        if self._state != "open":
            raise RuntimeError("CheckpointWriter.%s: the writer is %s" % (what, self._state))


# ---- helpers ----------------------------------------------------------------------------


def _is_plain_name(name):
    return (bool(name) and name not in (".", "..") and os.path.basename(name) == name
            and "/" not in name and (os.altsep is None or os.altsep not in name))


def _is_real_dir(path):
    return os.path.isdir(path) and not os.path.islink(path)


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


def _remove(path, failed):
    """Removes a file or a whole directory tree; on failure appends "path (error)" to
    ``failed`` and returns False."""
    try:
        if _is_real_dir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        failed.append("%s (%s)" % (path, e))
        return False


def _unlink_if_present(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmtree_quietly(path):
    shutil.rmtree(path, ignore_errors=True)
