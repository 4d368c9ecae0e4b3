"""A run's records on disk: `events.jsonl`, `metrics.jsonl` and (opt-in) `ledger.jsonl`."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class RunLog:
    """Appends JSON lines to the run directory and keeps the events in memory.

    Args:
        run_dir: created if missing.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(os.path.join(self.run_dir, name), "a") as f:
            f.write(json.dumps(record) + "\n")

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Records one event (`kind` plus fields) with a wall-clock timestamp."""
        record = {"time": time.time(), "event": kind, **fields}
        with self._lock:
            self.events.append(record)
            self._append("events.jsonl", record)
        return record

    def metric(self, **fields: Any) -> None:
        """Records one step's metrics."""
        with self._lock:
            self.metrics.append(fields)
            self._append("metrics.jsonl", fields)

    def ledger(self, step: int, epoch: int, indices: list[int]) -> None:
        """Records which data set indices a committed step consumed."""
        with self._lock:
            self._append("ledger.jsonl", {"step": step, "epoch": epoch, "indices": indices})


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads a JSON-lines file written by `RunLog`; a last line still being written (no
    newline yet) is left for the next read."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]
