"""A run's records on disk: `events.jsonl`, `metrics.jsonl` and (opt-in) `ledger.jsonl`.

`RunLog.emit` is the one writer of events; `elastic.events` defines their records and reads
them back.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from elastic.events import Event, build, read_jsonl, to_record
from elastic.private import ensure_private_dir, open_private_append

__all__ = ["RunLog", "read_jsonl"]  # read_jsonl lives with the events; kept here for its callers


class RunLog:
    """Appends JSON lines to the run directory and keeps the events in memory.

    Args:
        run_dir: created 0700 if missing; an existing one must be this user's and writable by
            no one else. Files are 0600 and never written through a link.

    Raises:
        ConfigError: `run_dir`, or a file in it, is not private to this user.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        ensure_private_dir(run_dir, "run_dir")
        self._lock = threading.Lock()
        self._files: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self._descriptor("events.jsonl")  # a planted file or link fails the run at its start

    def _descriptor(self, name: str) -> int:
        fd = self._files.get(name)
        if fd is None:
            fd = self._files[name] = open_private_append(os.path.join(self.run_dir, name))
        return fd

    def _append(self, name: str, record: dict[str, Any]) -> None:
        fd, data = self._descriptor(name), (json.dumps(record) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]

    def close(self) -> None:
        """Closes the files (a later record opens them again)."""
        with self._lock:
            files, self._files = self._files, {}
        for fd in files.values():
            os.close(fd)

    def emit(self, event: Event) -> dict[str, Any]:
        """Records one event, stamped with the wall-clock time.

        Args:
            event: the typed record (its own `time`, if any, is replaced).

        Returns:
            The record as written: `{"time": ..., "event": kind, **fields}`, also appended to
            `self.events`.
        """
        record = to_record(event, time.time())
        with self._lock:
            self.events.append(record)
            self._append("events.jsonl", record)
        return record

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Records one event by kind name: `emit(elastic.events.build(kind, **fields))`.

        Raises:
            ValueError: `kind` is not a known kind, or a required field is missing.
            TypeError: a field is not one of `kind`'s.
        """
        return self.emit(build(kind, **fields))

    def metric(self, **fields: Any) -> None:
        """Records one step's metrics."""
        with self._lock:
            self.metrics.append(fields)
            self._append("metrics.jsonl", fields)

    def ledger(self, step: int, epoch: int, indices: list[int]) -> None:
        """Records which data set indices a committed step consumed."""
        with self._lock:
            self._append("ledger.jsonl", {"step": step, "epoch": epoch, "indices": indices})

