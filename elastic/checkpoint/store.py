"""Atomic, checksummed checkpoints on any fsspec storage (a local path, `memory://`, `s3://`).

Layout: `ROOT/step-000000000123/` holds one file per part of the state (`model.pt`,
`optimizer.pt`, `scheduler.pt`, ...) and `MANIFEST.json`. Every file is written under a
temporary name, flushed and fsynced (on local disks), then renamed; the manifest, which
carries the sha256 and size of every file, is written last and is the commit marker. A
directory without a valid manifest, or whose files do not match it, is not a checkpoint.
Loading never unpickles arbitrary objects: `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

from elastic.errors import CheckpointCorruptError, ConfigError

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
_PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:012d}"


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def check_root(root: str) -> None:
    """Makes sure checkpoints can be written under `root` (creating it), before any worker
    starts.

    Raises:
        ConfigError: the URL's protocol is unknown, `root` is a file, or it cannot be created.
    """
    try:
        fs, path = _fs(root)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"checkpoint.path {root!r} cannot be used: {e}") from e
    try:
        if fs.exists(path) and not fs.isdir(path):
            raise ConfigError(f"checkpoint.path {root!r} is a file, not a directory; point it at "
                              "a directory")
        fs.makedirs(path, exist_ok=True)
        probe = f"{path.rstrip('/')}/.elastic-write-probe"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint.path {root!r} is not writable: {e}") from e


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
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


def write_checkpoint(root: str, step: int, parts: Mapping[str, bytes], meta: Mapping[str, Any],
                     after_part: Callable[[str], None] | None = None) -> str:
    """Writes one checkpoint atomically and returns its directory.

    Args:
        root: the checkpoint root (local path or fsspec URL).
        step: the global step the state belongs to (the next step to run).
        parts: file name (without `.pt`) -> serialised bytes.
        meta: extra manifest fields (epoch, world size, config fingerprint, ...).
        after_part: called with each part's name once it is on disk, before the manifest
            commits the checkpoint (chaos injects a crash mid-write here).
    """
    fs, base = _fs(root)
    directory = f"{base}/{step_dir_name(step)}"
    fs.makedirs(directory, exist_ok=True)
    if fs.exists(f"{directory}/{MANIFEST}"):
        fs.rm(f"{directory}/{MANIFEST}")  # re-writing a step: uncommit it first
    files = {}
    for name, data in parts.items():
        filename = f"{name}.pt"
        _write_atomically(fs, f"{directory}/{filename}", data)
        files[filename] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        if after_part is not None:
            after_part(name)
    _fsync_dir(fs, directory)
    manifest = {
        "format": FORMAT_VERSION, "step": step, "created": time.time(), "files": files,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        **meta,
    }
    _write_atomically(fs, f"{directory}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    _fsync_dir(fs, directory)
    return directory


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


def verify(root: str, step: int) -> LoadedCheckpoint:
    """Loads and verifies the checkpoint of `step`.

    Raises:
        CheckpointCorruptError: missing or unreadable manifest, a checksum or size mismatch,
            or a file that is not plain tensor data (a pickle that would run code).
    """
    fs, base = _fs(root)
    directory = f"{base}/{step_dir_name(step)}"
    try:
        with fs.open(f"{directory}/{MANIFEST}", "rb") as f:
            manifest = json.loads(f.read().decode())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION or manifest.get("step") != step:
            raise ValueError("manifest does not describe this step")
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"{directory}: no manifest (an interrupted write)") from e
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{directory}: unreadable manifest: {e}") from e
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
            parts[filename.removesuffix(".pt")] = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckpointCorruptError(
                f"{directory}/{filename}: refused, not plain tensor data ({type(e).__name__})"
            ) from e
    return LoadedCheckpoint(path=directory, step=step, parts=parts, manifest=manifest)


def load_checkpoint(root: str, step: int | None = None) -> LoadedCheckpoint | None:
    """The newest checkpoint under `root` that verifies (or exactly `step`), or None.

    Newer checkpoints that fail verification are skipped and listed in `skipped`.

    Raises:
        CheckpointCorruptError: `step` was given and that checkpoint does not verify.
    """
    if step is not None:
        return verify(root, step)
    skipped: list[tuple[str, str]] = []
    for candidate in list_steps(root):
        try:
            loaded = verify(root, candidate)
        except CheckpointCorruptError as e:
            skipped.append((step_dir_name(candidate), str(e)))
            continue
        loaded.skipped = skipped
        return loaded
    return None


def _complete(root: str, step: int) -> bool:
    """Cheap validity for retention: a committed manifest whose files exist with the recorded
    sizes. (Full verification reads and hashes every byte; `load_checkpoint` does that.)"""
    fs, base = _fs(root)
    directory = f"{base}/{step_dir_name(step)}"
    try:
        with fs.open(f"{directory}/{MANIFEST}", "rb") as f:
            files = json.loads(f.read().decode())["files"]
        return all(fs.size(f"{directory}/{name}") == meta["bytes"] for name, meta in files.items())
    except (FileNotFoundError, ValueError, KeyError, UnicodeDecodeError):
        return False


def prune(root: str, keep_last: int) -> list[int]:
    """Deletes all but the newest `keep_last` complete checkpoints, and incomplete directories
    older than the newest complete one. Never deletes the only complete checkpoint. Returns
    the steps deleted."""
    fs, base = _fs(root)
    valid, invalid = [], []
    for candidate in list_steps(root):
        (valid if _complete(root, candidate) else invalid).append(candidate)
    doomed = valid[max(1, keep_last):]
    if valid:
        doomed += [s for s in invalid if s < valid[0]]
    for s in doomed:
        fs.rm(f"{base}/{step_dir_name(s)}", recursive=True)
    return sorted(doomed)
