"""Atomic, checksummed checkpoints on any fsspec storage (a local path, `memory://`, `s3://`).

Layout: `ROOT/step-000000000123/` holds one file per part of the state (`model.pt`,
`optimizer.pt`, `scheduler.pt`, ...) and `MANIFEST.json`. Every file is written under a
temporary name, flushed and fsynced (on local disks), then renamed; the manifest, which
carries the sha256 and size of every file, is written last and is the commit marker. A
directory without a valid manifest, or whose files do not match it, is not a checkpoint.
Loading never unpickles arbitrary objects: `torch.load(weights_only=True)`.

With a key (`elastic.checkpoint.signing`), the manifest is signed and only checkpoints signed
with that key are loaded or counted by retention. On a local disk the root and every step
folder are 0700 and the files 0600, written through fresh no-follow names and renamed.

Sharded optimizer state is written by its owners, each its own file in the step's folder
(`write_shard`, `optimizer-shard-<rank>-<write id>.pt`): the state of the parameters it is the
first owner of, as `optimizer.state_dict()['state']` holds them (by state id). The member that
writes the manifest waits for every owner's file to be on disk and lists them with their
sha256 and size like its own files, and which state ids each holds (`"shards"`);
`optimizer.pt` holds the rest of the optimizer's state dict (its parameter groups). So the
manifest is still the one commit marker and signs every byte; loading joins the shards into
the whole optimizer state (`verify`), so a loaded checkpoint looks the same whether its state
was sharded or not.

Writing a step that has a checkpoint already (a run resumed or restored at that step that ends
or evaluates there) leaves that checkpoint whole until the new manifest replaces it: the new
files get names of their own (`model-<write id>.pt`, the manifest's `"part_names"` maps them
back to their parts), and the files no manifest lists are removed once it is committed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

from elastic.checkpoint.retention import MONITOR, Candidate, Retention, best, kept, monitored_value
from elastic.checkpoint.signing import sign, signature_problem
from elastic.errors import (
    CheckpointCorruptError,
    CheckpointSignatureError,
    CheckpointTimeoutError,
    CheckpointUncommittedError,
    ConfigError,
)
from elastic.private import ensure_private_dir, write_private

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:012d}"


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def check_root(root: str, limit_s: float | None = None) -> None:
    """Makes sure checkpoints can be written under `root` (creating it), before any worker
    starts, waiting for the storage `limit_s` seconds at most (None: for ever).

    Raises:
        ConfigError: the URL's protocol is unknown, `root` is a file, it cannot be created,
            or (on a local disk) it is another user's or writable by group or others.
        CheckpointTimeoutError: the storage did not answer in time.
    """
    _within(limit_s, lambda: _check_root(root),
            f"checking that checkpoint.path {root!r} can be written",
            "fix the storage or point checkpoint.path elsewhere")


def _check_root(root: str) -> None:
    try:
        fs, path = _fs(root)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"checkpoint.path {root!r} cannot be used: {e}") from e
    try:
        if fs.exists(path) and not fs.isdir(path):
            raise ConfigError(f"checkpoint.path {root!r} is a file, not a directory; point it at "
                              "a directory")
        if _is_local(fs):
            ensure_private_dir(path, "checkpoint.path")
        else:
            fs.makedirs(path, exist_ok=True)
        probe = f"{path.rstrip('/')}/.elastic-write-probe"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint.path {root!r} is not writable: {e}") from e


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    if _is_local(fs):
        write_private(path, data)
        return
    tmp = f"{path}.tmp"
    with fs.open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if _is_local(fs):
            os.fsync(f.fileno())
    fs.mv(tmp, path)


def _fsync_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    if _is_local(fs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def serialize(obj: Any) -> bytes:
    """torch.save to bytes (tensors, numbers, strings, lists and dicts of them)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _step_directory(fs: fsspec.AbstractFileSystem, base: str, step: int) -> str:
    """The step's folder, created (private on a local disk)."""
    directory = f"{base}/{step_dir_name(step)}"
    if _is_local(fs):
        ensure_private_dir(base, "checkpoint.path")
        ensure_private_dir(directory, "checkpoint.path")
    else:
        fs.makedirs(directory, exist_ok=True)
    return directory


def shard_name(rank: int, write: str = "") -> str:
    """The file name (without `.pt`) of the optimizer-state shard rank `rank` writes in write
    `write` (its id names the file: a write of a step that has a checkpoint already never
    replaces that checkpoint's shards before its own manifest replaces the old one)."""
    return f"optimizer-shard-{rank:05d}" + (f"-{write[:12]}" if write else "")


def write_shard(root: str, step: int, name: str, data: bytes) -> dict[str, Any]:
    """Writes one owner's shard of the checkpoint of `step` (see the module), atomically, as
    `<name>.pt`; returns its manifest entry (sha256 and size) for the member that writes the
    manifest. A file left by an earlier write of the same step is replaced."""
    fs, base = _fs(root)
    directory = _step_directory(fs, base, step)
    _write_atomically(fs, f"{directory}/{name}.pt", data)
    _fsync_dir(fs, directory)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def write_checkpoint(root: str, step: int, parts: Mapping[str, bytes], meta: Mapping[str, Any],
                     after_part: Callable[[str], None] | None = None,
                     key: bytes | None = None,
                     written: Callable[[], Mapping[str, dict[str, Any]]] | None = None) -> str:
    """Writes one checkpoint atomically and returns its directory.

    Args:
        root: the checkpoint root (local path or fsspec URL).
        step: the global step the state belongs to (the next step to run).
        parts: file name (without `.pt`) -> serialised bytes.
        meta: extra manifest fields (epoch, world size, config fingerprint, ...).
        after_part: called with each part's name once it is on disk, before the manifest
            commits the checkpoint (chaos injects a crash mid-write here).
        key: signs the manifest (see `elastic.checkpoint.signing`); None writes it unsigned.
        written: called once this member's files are on disk, before the manifest: the other
            owners' shards of the optimizer state, each on disk by then (file name -> its
            `write_shard` entry), listed in the manifest with this member's files. It raises
            if one could not be written: then no manifest is.
    """
    fs, base = _fs(root)
    directory = _step_directory(fs, base, step)
    # Re-writing a step: the checkpoint there stays whole until this manifest replaces its own.
    write = f"-{secrets.token_hex(6)}" if fs.exists(f"{directory}/{MANIFEST}") else ""
    files, part_names = {}, {}
    for name, data in parts.items():
        filename = f"{name}{write}.pt"
        if write:
            part_names[filename] = name
        _write_atomically(fs, f"{directory}/{filename}", data)
        files[filename] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        if after_part is not None:
            after_part(name)
    _fsync_dir(fs, directory)
    if written is not None:
        for filename, entry in written().items():
            if "/" in filename or filename in files:
                raise ValueError(f"an owner's shard is named {filename!r}: not a new plain name")
            files[filename] = {"sha256": entry["sha256"], "bytes": entry["bytes"]}
    manifest = {
        "format": FORMAT_VERSION, "step": step, "created": time.time(), "files": files,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        **({"part_names": part_names} if part_names else {}), **meta,
    }
    if key is not None:
        manifest = sign(manifest, key)
    _write_atomically(fs, f"{directory}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    _fsync_dir(fs, directory)
    _drop_stray_files(fs, directory, files)
    return directory


def _drop_stray_files(fs: fsspec.AbstractFileSystem, directory: str,
                      listed: Mapping[str, Any]) -> None:
    """Once a checkpoint of a step is committed, the files its manifest does not list: those
    of the checkpoint it replaced, or optimizer-state shards of an earlier write of that step
    that failed or was skipped after some members wrote theirs. Retention deletes whole step
    folders only, so they would stay as long as the checkpoint. Best effort: a file that
    cannot be removed stays."""
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(directory, detail=False)]
        for name in names:
            if name.endswith(".pt") and name not in listed:
                fs.rm(f"{directory}/{name}")
    except OSError as e:
        logger.warning("cannot remove stray files from %s: %s", directory, e)


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint and its contents.

    Attributes:
        path: its directory.
        step: the step it holds (the next step to run).
        parts: file name (without `.pt`) -> loaded object.
        manifest: the parsed manifest.
        skipped: newer checkpoints that did not verify: (directory, reason).
    """

    path: str
    step: int
    parts: dict[str, Any]
    manifest: dict[str, Any]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def list_steps(root: str) -> list[int]:
    """Steps that have a checkpoint directory (valid or not), newest first."""
    fs, base = _fs(root)
    if not fs.exists(base):
        return []
    steps = []
    for entry in fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
            steps.append(int(name[len(_PREFIX):]))
    return sorted(steps, reverse=True)


def verify(root: str, step: int, key: bytes | None = None) -> LoadedCheckpoint:
    """Loads and verifies the checkpoint of `step` (and, with `key`, its signature).

    Raises:
        CheckpointCorruptError: missing or unreadable manifest, a manifest not validly signed
            with `key`, a checksum or size mismatch, or a file that is not plain tensor data
            (a pickle that would run code).
    """
    fs, base = _fs(root)
    directory = f"{base}/{step_dir_name(step)}"
    try:
        with fs.open(f"{directory}/{MANIFEST}", "rb") as f:
            manifest = json.loads(f.read().decode())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("manifest is not an object with a 'files' object")
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
            raise ValueError("manifest does not describe this step")
        if not all(isinstance(e, dict) and isinstance(e.get("bytes"), int)
                   and isinstance(e.get("sha256"), str) and isinstance(n, str) and "/" not in n
                   for n, e in files.items()):
            raise ValueError("manifest lists a file without a plain name, size and sha256")
        part_names = manifest.get("part_names", {})
        if not isinstance(part_names, dict) or not all(
                n in files and isinstance(p, str) for n, p in part_names.items()):
            raise ValueError("manifest names parts of files it does not list")
        named = [part_names.get(n, n.removesuffix(".pt")) for n in files]
        if len(set(named)) != len(named):  # one file would silently replace another's part
            raise ValueError("manifest names two files as one part")
        shards = _listed_shards(manifest)
    except FileNotFoundError as e:
        raise CheckpointUncommittedError(f"{directory}: no manifest (an interrupted write)") from e
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{directory}: unreadable manifest: {e}") from e
    if key is not None:
        problem = signature_problem(manifest, key)
        if problem is not None:
            raise CheckpointSignatureError(f"{directory}: refused, {problem}")
    parts: dict[str, Any] = {}
    for filename, expected in files.items():
        try:
            with fs.open(f"{directory}/{filename}", "rb") as f:
                data = f.read()
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{directory}/{filename}: missing") from e
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointCorruptError(f"{directory}/{filename}: checksum mismatch")
        try:
            # weights_only: a checkpoint is data; a pickle that would run code is refused.
            part = part_names.get(filename, filename.removesuffix(".pt"))
            parts[part] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:
            if _allocation_failed(e):  # the reader's memory, not the checkpoint, is short
                raise
            raise CheckpointCorruptError(
                f"{directory}/{filename}: refused, not plain tensor data ({type(e).__name__})"
            ) from e
    if shards:
        _join_shards(directory, shards, parts)
    return LoadedCheckpoint(path=directory, step=step, parts=parts, manifest=manifest)


def _allocation_failed(error: BaseException) -> bool:
    """Whether loading failed for want of memory (torch's CPU allocator raises a plain
    RuntimeError): the checkpoint is not skipped as corrupt then, which would fall back to an
    older one, or at a resume with none left start the run over."""
    return (isinstance(error, (MemoryError, torch.OutOfMemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


def _listed_shards(manifest: dict[str, Any]) -> dict[str, list[int]]:
    """The manifest's optimizer-state shards: name -> the state ids it holds.

    Raises:
        ValueError: the list is malformed.
    """
    shards = manifest.get("shards", {})
    if not isinstance(shards, dict) or not all(
            isinstance(name, str) and name.startswith("optimizer-shard-") and "/" not in name
            and isinstance(ids, list) and all(isinstance(i, int) for i in ids)
            for name, ids in shards.items()):
        raise ValueError("manifest lists shards that are not plain names with state ids")
    return shards


def _join_shards(directory: str, shards: dict[str, list[int]], parts: dict[str, Any]) -> None:
    """Joins the listed shards (loaded and verified as files of the manifest) into
    `parts['optimizer']['state']`, by state id, and drops them from `parts`.

    Raises:
        CheckpointCorruptError: a shard is not among the files, holds other state ids than
            the manifest lists, or two hold one id.
    """
    optimizer = parts.get("optimizer")
    if not isinstance(optimizer, dict):
        raise CheckpointCorruptError(f"{directory}: lists optimizer shards but has no optimizer")
    state: dict[int, Any] = dict(optimizer.get("state", {}))
    for name, ids in sorted(shards.items()):
        if name not in parts:
            raise CheckpointCorruptError(f"{directory}: the manifest lists shard {name} but "
                                         "not its file")
        held = parts.pop(name)
        if not isinstance(held, dict) or sorted(held) != sorted(ids):
            raise CheckpointCorruptError(f"{directory}/{name}.pt: holds other state than the "
                                         "manifest lists")
        if state.keys() & held.keys():
            raise CheckpointCorruptError(f"{directory}/{name}.pt: holds state another shard "
                                         "holds too")
        state.update(held)
    parts["optimizer"] = {**optimizer, "state": dict(sorted(state.items()))}


def load_checkpoint(root: str, step: int | None = None,
                    key: bytes | None = None) -> LoadedCheckpoint | None:
    """The newest checkpoint under `root` that verifies (or exactly `step`), or None.

    Newer checkpoints that fail verification (with `key`: also those not validly signed with
    it) are skipped and listed in `skipped`.

    Raises:
        CheckpointCorruptError: `step` was given and that checkpoint does not verify.
    """
    if step is not None:
        return verify(root, step, key)
    return newest_checkpoint(root, key)[0]


def newest_checkpoint(root: str, key: bytes | None = None
                      ) -> tuple[LoadedCheckpoint | None, list[tuple[str, CheckpointCorruptError]]]:
    """Like `load_checkpoint`, and also the newer checkpoints skipped (directory, error) when
    none verifies: a caller must be able to tell "no checkpoint" from "none with this key"
    (`CheckpointSignatureError`)."""
    skipped: list[tuple[str, CheckpointCorruptError]] = []
    for candidate in list_steps(root):
        try:
            loaded = verify(root, candidate, key)
        except CheckpointCorruptError as e:
            skipped.append((step_dir_name(candidate), e))
            continue
        loaded.skipped = [(d, str(e)) for d, e in skipped]
        return loaded, skipped
    return None, skipped


def none_loaded(skipped: list[tuple[str, CheckpointCorruptError]]) -> dict[str, Any]:
    """What a restore that found no checkpoint to load answers (`restore_checkpoint`): every
    step folder `skipped` (directory, reason), and among them those `unsigned` (intact but not
    signed with the run's key) and those `damaged` (committed, yet they do not verify); an
    interrupted write is neither."""
    return {"step": None, "path": None,
            "skipped": [(d, str(e)) for d, e in skipped],
            "unsigned": [(d, str(e)) for d, e in skipped
                         if isinstance(e, CheckpointSignatureError)],
            "damaged": [(d, str(e)) for d, e in skipped if not isinstance(
                e, CheckpointSignatureError | CheckpointUncommittedError)]}


def newest_checkpoint_within(root: str, key: bytes | None, limit_s: float | None
                             ) -> tuple[LoadedCheckpoint | None, list[tuple[str, CheckpointCorruptError]]]:
    """`newest_checkpoint`, waited for `limit_s` seconds at most (None: for ever).

    Raises:
        CheckpointTimeoutError: it did not finish in time.
        what `newest_checkpoint` raises.
    """
    return _within(limit_s, lambda: newest_checkpoint(root, key),
                   f"loading the newest checkpoint under {root}",
                   "once it does, resume the run (elastic resume)")


def _within(limit_s: float | None, call: Callable[[], Any], what: str, then: str) -> Any:
    """`call()`, on a thread of its own, waited for `limit_s` seconds at most (None: for ever):
    storage that stops answering cannot release that thread, which is left behind, holding
    nothing of the caller's. `what` it does and what to do `then` make the error's message.

    Raises:
        CheckpointTimeoutError: it did not finish in time.
        what `call` raises.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # handed to the caller
            outcome["error"] = e

    worker = threading.Thread(target=run, name="elastic-ckpt-storage", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise CheckpointTimeoutError(
            f"{what} did not finish within checkpoint.timeout ({limit_s:g} s): the storage may "
            f"not answer; {then}, or raise checkpoint.timeout if the storage is this slow")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def has_complete_checkpoint(root: str, key: bytes | None = None) -> bool:
    """Whether `root` holds a checkpoint whose manifest is committed, whose files have their
    recorded sizes and (with `key`) is validly signed, without reading its data (a run that
    resumes verifies every byte when it loads it)."""
    return any(_retention_state(root, step, key)[0] == "valid" for step in list_steps(root))


def _retention_state(root: str, step: int, key: bytes | None) -> tuple[str, dict[str, Any]]:
    """Cheap validity for retention (full verification reads and hashes every byte;
    `load_checkpoint` does that), and the manifest: "incomplete" without a committed manifest
    whose files exist with the recorded sizes; "foreign" when complete but not validly signed
    with `key`; else "valid". A foreign checkpoint (planted, or written with another key) never
    counts towards `keep_last` or `keep_best`, so it cannot push a real one out (nor claim a
    best value); retention never deletes it either, so a mistaken key costs no data (only a
    step of this run with the same number replaces it)."""
    fs, base = _fs(root)
    directory = f"{base}/{step_dir_name(step)}"
    try:
        with fs.open(f"{directory}/{MANIFEST}", "rb") as f:
            manifest = json.loads(f.read().decode())
        files = manifest["files"]
        if not all(fs.size(f"{directory}/{name}") == meta["bytes"] for name, meta in files.items()):
            return "incomplete", {}
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return "incomplete", {}
    if key is not None and signature_problem(manifest, key) is not None:
        return "foreign", {}
    return "valid", manifest


def prune(root: str, keep_last: int, key: bytes | None = None,
          retention: Retention | None = None, written: int | None = None,
          problems: list[str] | None = None) -> list[int]:
    """Deletes all but the newest `keep_last` valid checkpoints (signed with `key`, if given)
    and, with `retention` (which then replaces `keep_last`), the best `keep_best` by its
    monitored metric besides; and incomplete directories older than the newest valid one.
    Never deletes the only valid checkpoint, nor a complete one signed otherwise. Returns the
    steps deleted. A folder that cannot be removed (a file held open on NFS, a permission) is
    left and the others still go; what went wrong is appended to `problems` (without it, the
    first such OSError is raised once the others are gone).

    `written`: the step just written. Checkpoints of later steps belong to a history the run
    left: it restored an older one, having skipped them as unreadable (a corruption that
    keeps the files' sizes passes this cheap check). They neither count nor are deleted
    (before, with keep_last=1, such a one pushed out every checkpoint the run wrote); the
    run's own write of that step replaces one."""
    fs, base = _fs(root)
    retention = retention or Retention(keep_last=keep_last)
    valid: list[Candidate] = []
    incomplete: list[int] = []
    for candidate in list_steps(root):
        if written is not None and candidate > written:
            continue
        state, manifest = _retention_state(root, candidate, key)
        if state == "valid":
            valid.append(Candidate(candidate, monitored_value(manifest, retention.monitor)))
        elif state == "incomplete":
            incomplete.append(candidate)
    keep = kept(valid, retention)
    doomed = [c.step for c in valid if c.step not in keep]
    if valid:
        doomed += [s for s in incomplete if s < valid[0].step]
    deleted, failed = [], []
    for s in sorted(doomed):
        try:
            fs.rm(f"{base}/{step_dir_name(s)}", recursive=True)
        except OSError as e:
            failed.append(e)
            if problems is not None:
                problems.append(f"cannot remove {step_dir_name(s)}: {type(e).__name__}: {e}")
            continue
        deleted.append(s)
    if failed and problems is None:
        raise failed[0]
    return deleted


def best_checkpoint(root: str, key: bytes | None = None) -> LoadedCheckpoint | None:
    """The checkpoint with the best monitored value under `root` that verifies (by the metric
    and mode the newest monitored checkpoint records), or None when no valid checkpoint
    records one."""
    records = []
    for step in list_steps(root):
        state, manifest = _retention_state(root, step, key)
        record = manifest.get(MONITOR) if state == "valid" else None
        if isinstance(record, dict):
            records.append((step, record))
    if not records:
        return None
    name, mode = records[0][1].get("name"), records[0][1].get("mode", "min")
    candidates = [Candidate(step, monitored_value({MONITOR: record}, name)) for step, record in records]
    for step in best(candidates, mode, len(candidates)):
        try:
            return verify(root, step, key)
        except CheckpointCorruptError:
            continue
    return None
