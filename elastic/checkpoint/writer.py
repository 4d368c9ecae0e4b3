"""Background checkpoint writing: the step pays only for a snapshot in host memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic.checkpoint.retention import Retention
from elastic.checkpoint.store import prune, serialize, write_checkpoint, write_shard

# A shard of a checkpoint (sharded optimizer state): its name and what it holds (an object
# torch.save can write, or its bytes).
Shard = tuple[str, Any]
# The other owners' shards, on disk, for the manifest (`write_checkpoint`'s `written`).
Written = Callable[[], Mapping[str, dict[str, Any]]]

# Shard writes whose outcome a writer remembers (the newest; one is asked for at a time).
_SHARDS_KEPT = 4


@dataclass(frozen=True)
class WriteReport:
    """One finished background write."""

    step: int
    path: str | None
    seconds: float
    error: str | None = None
    pruned: tuple[int, ...] = ()


class CheckpointWriter:
    """Writes at most one checkpoint at a time on a background thread.

    Args:
        root: checkpoint root (local path or fsspec URL).
        keep_last: how many valid checkpoints retention keeps.
        key: signs every manifest (see `elastic.checkpoint.signing`); None: unsigned.
        retention: what retention keeps, when it ranks checkpoints by a monitored metric too
            (its `keep_last` then replaces `keep_last`).
    """

    def __init__(self, root: str, keep_last: int, key: bytes | None = None,
                 retention: Retention | None = None) -> None:
        self.root = root
        self.keep_last = keep_last
        self.key = key
        self.retention = retention or Retention(keep_last=keep_last)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._reports: list[WriteReport] = []
        self._shards: dict[str, dict[str, Any]] = {}  # write id -> `shard_entry`

    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any],
               after_part: Callable[[str], None] | None = None,
               written: Written | None = None) -> bool:
        """Starts serialising and writing a snapshot (`parts`: name -> an object torch.save
        can write, already copied off the live state by the caller, into host memory: this
        thread never touches a GPU, and the files load where none is visible; `written`: the
        other owners' shards, waited for before the manifest); returns False (and writes
        nothing) if the previous write is still in flight, so snapshots never pile up."""
        return self._start(f"elastic-ckpt-{step}", self._write,
                           (step, dict(parts), dict(meta), after_part, written))

    def submit_shard(self, step: int, write: str, shard: Shard) -> bool:
        """Starts writing this member's shard of write `write` (of the checkpoint of `step`)
        alone; another member lists it in the manifest once `shard_entry` gives it. False if
        the previous write is still in flight."""
        return self._start(f"elastic-ckpt-shard-{step}", self._write_shard, (step, write, shard))

    def _start(self, name: str, target: Callable[..., None], args: tuple) -> bool:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return False
            self._thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._thread.start()
            return True

    def write_now(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any],
                  after_part: Callable[[str], None] | None = None,
                  written: Written | None = None) -> None:
        """Writes on the calling thread (after the write in flight, if any), then applies
        retention; its report is taken with the background writes'."""
        self.flush()
        self._write(step, dict(parts), dict(meta), after_part, written)

    def write_shard_now(self, step: int, write: str, shard: Shard) -> None:
        """`submit_shard` on the calling thread (after the write in flight, if any)."""
        self.flush()
        self._write_shard(step, write, shard)

    def shard_entry(self, write: str) -> dict[str, Any]:
        """Once this member's shard of write `write` is on disk (waiting for it): its name and
        manifest entry (`elastic.checkpoint.store.write_shard`), or the error that ended it.
        Any thread."""
        self.flush()
        with self._lock:
            return self._shards.get(write, {"error": f"this member wrote no shard of write {write}"})

    def _write_shard(self, step: int, write: str, shard: Shard) -> None:
        name, value = shard
        try:
            outcome = {"name": name, **write_shard(self.root, step, name, _bytes(value))}
        except Exception as e:
            outcome = {"error": f"shard {name}: {type(e).__name__}: {e}"}
        with self._lock:
            self._shards[write] = outcome
            while len(self._shards) > _SHARDS_KEPT:
                self._shards.pop(next(iter(self._shards)))

    def _write(self, step: int, parts: dict[str, Any], meta: dict[str, Any],
               after_part: Callable[[str], None] | None, written: Written | None = None) -> None:
        started = time.perf_counter()
        try:
            blobs = {name: _bytes(value) for name, value in parts.items()}
            path = write_checkpoint(self.root, step, blobs, meta, after_part, self.key, written)
            pruned = tuple(prune(self.root, self.keep_last, self.key, self.retention))
            report = WriteReport(step, path, time.perf_counter() - started, pruned=pruned)
        except Exception as e:
            report = WriteReport(step, None, time.perf_counter() - started,
                                 error=f"{type(e).__name__}: {e}")
        with self._lock:
            self._reports.append(report)

    def flush(self) -> None:
        """Waits for the write in flight, if any."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def take_reports(self) -> list[WriteReport]:
        """Reports of writes finished since the last call."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else serialize(value)
