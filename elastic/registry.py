"""The run index: one record per run under the storage root, so that a run can be found by
name, live or ended, without knowing its run directory, and after the Ray cluster is gone.

The controller publishes its record at every state change and step boundary (a small JSON
file replaced atomically); `elastic status` and `elastic list` read it without starting a
Ray driver. Records are private (0600 in a 0700 folder): they name the run directory and the
controller's control channel.

No Ray here.
"""

from __future__ import annotations

import json
import os
import re
import socket
from typing import Any

from elastic.config import storage_root
from elastic.private import make_private_dirs, refusal, write_private

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # FitConfig.name's pattern
TERMINAL_STATES = ("finished", "stopped", "failed")
LOST = "lost"
"""Shown for a record that says a run is live whose controller no longer answers (its
process was killed, or the cluster stopped, before it could write its end)."""


def mark_lost(record: dict[str, Any]) -> dict[str, Any]:
    """A record that says a run is live whose controller no longer answers, as `status` shows
    it: `lost`, with no workers (they died with the controller that owned them), and the
    steps it committed, which metrics.jsonl in its run dir holds to the last one (the record
    itself was last published at a chunk boundary, or earlier); only lines this run wrote
    count (a reused run dir holds an earlier run's)."""
    lost = {**record, "state": LOST, "workers": [], "joining_workers": 0, "starting_workers": 0}
    if "spares" in record:  # absent from the records of older runs
        lost.update(spares=[], spare_workers=0)
    if record.get("run_dir"):
        last = _last_step(os.path.join(record["run_dir"], "metrics.jsonl"), record.get("started_at") or 0.0)
        lost["step"] = max(record.get("step", 0), last + 1)
    return lost


def _last_step(path: str, since: float, tail_bytes: int = 1 << 16) -> int:
    """The step of the last complete record of a metrics.jsonl written at `since` or later
    (its `time`; -1: none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            lines = f.read().split(b"\n")[:-1]  # the last piece: a line still being written
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record["step"] if (record.get("time") or 0.0) >= since else -1
    return -1


def this_host() -> str:
    return socket.gethostname()


class RunRegistry:
    """The records under `<root>/runs/NAME.json`.

    Args:
        root: the storage root; default `elastic.config.storage_root()`.
    """

    def __init__(self, root: str | None = None) -> None:
        self.directory = os.path.join(root or storage_root(), "runs")

    def _path(self, name: str) -> str:
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"{name!r} is not a run name")
        return os.path.join(self.directory, f"{name}.json")

    def write(self, record: dict[str, Any]) -> None:
        """Replaces the record of `record["name"]` atomically (readers never see half a file).

        Raises:
            OSError: the index folder cannot be made private to this user.
        """
        make_private_dirs(self.directory)
        if not _private(self.directory):
            raise PermissionError(f"refusing the run index {self.directory}: it must be a folder of "
                                  "this user that no one else can write (set ELASTIC_HOME elsewhere)")
        write_private(self._path(record["name"]), json.dumps(record).encode(), fsync=False)

    def read(self, name: str) -> dict[str, Any] | None:
        """The record of run `name`, or None (also for a string that is no run name, and in an
        index folder that is not private to this user: its records could be planted)."""
        if not _private(self.directory):
            return None
        try:
            with open(self._path(name)) as f:
                return json.load(f)
        except (ValueError, FileNotFoundError):  # JSONDecodeError is a ValueError
            return None

    def all(self) -> list[dict[str, Any]]:
        """Every record, newest first (by start time)."""
        if not _private(self.directory):
            return []
        try:
            names = [n[:-5] for n in os.listdir(self.directory) if n.endswith(".json")]
        except FileNotFoundError:
            return []
        records = [r for r in (self.read(n) for n in names) if r is not None]
        return sorted(records, key=lambda r: r.get("started_at") or 0.0, reverse=True)


def is_terminal(record: dict[str, Any]) -> bool:
    return record.get("state") in TERMINAL_STATES


def _private(path: str) -> bool:
    """Whether `path` is a real folder (not a link) of this user that no one else can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True  # nothing there yet: nothing planted
    return refusal(path, st) is None  # lstat: a link to a folder is refused too
