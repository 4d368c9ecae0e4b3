"""A run's records on disk: `events.jsonl`, `metrics.jsonl` and (opt-in) `ledger.jsonl`.

Events are only ever appended (a run's whole history, resumes included). metrics.jsonl and
ledger.jsonl hold one record per committed step of the run's current history: a step redone
after a resume or a restore from a checkpoint replaces the records of that step and after it.

`RunLog.emit` is the one writer of events; `elastic.events` defines their records and reads
them back. Sinks (the run's loggers and callbacks, `elastic.sinks`) get every event and metrics
line after it is written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Protocol

from elastic.events import Event, build, iter_jsonl, read_jsonl, to_record
from elastic.private import ensure_private_dir, open_private_append, write_private

logger = logging.getLogger(__name__)

__all__ = ["RunLog", "Sink", "read_jsonl"]  # read_jsonl lives with the events; kept here for its callers


DISK_ONLY = ("timeline",)
"""Fields of a metrics line kept in metrics.jsonl and handed to the sinks, but not in
`RunLog.metrics` (nor so in `FitResult.metrics`): the per-rank step timeline is three quarters
of a line, and a long run's controller would hold every one (64 ranks: 18 KB a step)."""


class Sink(Protocol):
    """What `RunLog.add_sinks` takes: called with each record as written (do not change it)."""

    def on_metric(self, record: dict[str, Any]) -> None:
        """One committed step's metrics line."""

    def on_event(self, record: dict[str, Any]) -> None:
        """One event record (`{"time": ..., "event": kind, **fields}`)."""


class RunLog:
    """Appends JSON lines to the run directory and keeps the events in memory.

    Args:
        run_dir: created 0700 if missing; an existing one must be this user's and writable by
            no one else. Files are 0600 and never written through a link.

    Raises:
        ConfigError: `run_dir`, or a file in it, is not private to this user.
    """

    def __init__(self, run_dir: str, metrics_kept: int | None = None) -> None:
        self.run_dir = run_dir
        self.metrics_kept = metrics_kept  # the newest this many in `metrics` (None: all)
        ensure_private_dir(run_dir, "run_dir")
        self._lock = threading.Lock()
        # Held while metrics.jsonl or ledger.jsonl is rewritten (`_supersede`: a long run's
        # file is gigabytes), instead of `_lock`: status reads and other threads' events do
        # not wait for the rewrite (a controller that did not answer in 10 s read as lost).
        self._rewriting = threading.Lock()
        self._files: dict[str, int] = {}
        self._last_step: dict[str, int] = {}  # the newest step in each file (`_supersede`)
        self._cut: set[str] = set()  # files whose last record a failed write cut short
        self._unwritten = 0  # records the disk refused since the last one it took
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []  # every committed step's line, but `DISK_ONLY`
        self._sinks: list[Sink] = []
        self._sink_thread: int | None = None
        # (hook, record, own: see `handing_own`), in the order written
        self._pending: deque[tuple[str, dict[str, Any], bool]] = deque()
        self._delivering = False
        self.handing_own = True
        """Whether the record being handed to the sinks is the thread's own: written on the
        sinks' thread, not by a sink (another thread's record waits for one of these)."""
        self._descriptor("events.jsonl")  # a planted file or link fails the run at its start

    def _descriptor(self, name: str) -> int:
        fd = self._files.get(name)
        if fd is None:
            path = os.path.join(self.run_dir, name)
            fd = self._files[name] = open_private_append(path)
            if os.fstat(fd).st_size:
                with open(path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
                if torn:  # an earlier run's last record, cut short by a crash: end its line
                    self._cut.add(name)  # (the next record does, should this write fail)
                    try:
                        if os.write(fd, b"\n") == 1:
                            self._cut.discard(name)
                    except OSError as e:  # a full disk: the next record that goes through
                        logger.error("run log %s: cannot end the cut record of %s (%s)",
                                     self.run_dir, name, e)
        return fd

    def _append(self, name: str, record: dict[str, Any]) -> None:
        """Appends one record. A write the disk refuses (full, or an I/O error) loses that
        record from the file, not the run: it stays in memory (`events`, `metrics`), the
        controller's log says so once per outage, and the next record that goes through
        starts a line of its own."""
        data = _line(record)
        try:
            fd = self._descriptor(name)
            if name in self._cut:  # a record was cut short: end its line first
                data = b"\n" + data
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            if data != _line(record):  # part of it may be in the file
                self._cut.add(name)
            if not self._unwritten:
                logger.error("run log %s: cannot write %s (%s); records are kept in memory "
                             "only until the disk takes them again", self.run_dir, name, e)
            self._unwritten += 1
            return
        self._cut.discard(name)
        if self._unwritten:
            logger.warning("run log %s: writing again; %d records were not written",
                           self.run_dir, self._unwritten)
            self._unwritten = 0

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
            if self._sinks:
                self._pending.append(("on_event", record, self._own()))
        self.deliver()
        return record

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Records one event by kind name: `emit(elastic.events.build(kind, **fields))`.

        Raises:
            ValueError: `kind` is not a known kind, or a required field is missing.
            TypeError: a field is not one of `kind`'s.
        """
        return self.emit(build(kind, **fields))

    def metric(self, **fields: Any) -> None:
        """Records one step's metrics (a redone step supersedes the records from it on: `_supersede`)."""
        if "step" in fields:
            with self._rewriting:  # records of metrics.jsonl are written on one thread
                self._supersede("metrics.jsonl", fields["step"])
        with self._lock:
            if "step" in fields:
                if self.metrics and self.metrics[-1].get("step", -1) >= fields["step"]:
                    self.metrics = [m for m in self.metrics if m.get("step", -1) < fields["step"]]
            self.metrics.append({k: v for k, v in fields.items() if k not in DISK_ONLY})
            kept = self.metrics_kept
            if kept is not None and len(self.metrics) > kept + max(1, kept // 8):
                del self.metrics[:-kept]  # in batches: not a copy of the list every step
            self._append("metrics.jsonl", fields)
            if self._sinks:
                self._pending.append(("on_metric", fields, self._own()))
        self.deliver()

    def add_sinks(self, *sinks: Sink) -> None:
        """Hands every record written from now on to `sinks`, in order, after it is written.

        Sinks run on the thread that added them, one record at a time: a record another thread
        writes (a control request's event) waits until this thread writes its next record or
        calls `deliver`, so that a sink never runs on two threads at once, and a hook that has
        the controller write an event on another thread (a stop request) does not wait on
        itself.
        """
        with self._lock:
            self._sinks.extend(sinks)
            self._sink_thread = threading.get_ident()

    def remove_sinks(self) -> None:
        """Stops handing records to sinks (records not yet delivered are dropped)."""
        with self._lock:
            self._sinks, self._sink_thread = [], None
            self._pending.clear()

    def deliver(self) -> None:
        """Hands the records written so far to the sinks, if called on the sinks' thread.

        Raises:
            Exception: the first exception a sink raised, once every sink has had the record
                (the records after it wait for the next call).
        """
        if not self._on_sink_thread() or self._delivering:
            return  # a sink writing a record: the loop below delivers it next
        self._delivering = True
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    hook, record, self.handing_own = self._pending.popleft()
                    sinks = list(self._sinks)
                _hand(sinks, hook, record)
        finally:
            self._delivering = False
            self.handing_own = True

    def _on_sink_thread(self) -> bool:
        return threading.get_ident() == self._sink_thread

    def _own(self) -> bool:
        return self._on_sink_thread() and not self._delivering

    def last_metric(self) -> dict[str, Any] | None:
        """The newest metrics line in memory (None before the first)."""
        with self._lock:
            return self.metrics[-1] if self.metrics else None

    def newest_metrics(self) -> list[dict[str, Any]]:
        """A copy of the newest `metrics_kept` records of `metrics` (every one for None)."""
        with self._lock:
            kept = self.metrics_kept
            return list(self.metrics if kept is None else self.metrics[-kept:])

    def ledger(self, step: int, epoch: int, indices: list[int]) -> None:
        """Records which data set indices a committed step consumed."""
        with self._rewriting:
            self._supersede("ledger.jsonl", step)
        with self._lock:
            self._append("ledger.jsonl", {"step": step, "epoch": epoch, "indices": indices})

    def drop_from(self, step: int) -> None:
        """Drops the records of steps `step` and later from metrics.jsonl and ledger.jsonl,
        and from `metrics`: the run ends at committed step `step` without redoing them (it
        restored an older checkpoint, then stopped), so its weights hold none of them."""
        for name in ("metrics.jsonl", "ledger.jsonl"):
            with self._rewriting:
                newest = self.newest_step(name)
                if newest is not None and newest >= step:
                    self._supersede(name, step)
                    self._last_step.pop(name, None)  # read again if asked
        with self._lock:
            self.metrics = [m for m in self.metrics if m.get("step", -1) < step]

    def newest_step(self, name: str = "metrics.jsonl") -> int | None:
        """The newest step recorded in `name` of this run dir (by this run, or by an earlier
        run in the same dir: a run resumed by name), or None if none is."""
        with self._lock:
            last = self._last_step.get(name)
            if last is None:
                last = self._last_step[name] = max(
                    (_step(r) for r in iter_jsonl(os.path.join(self.run_dir, name))), default=-1)
        return last if last >= 0 else None

    def _supersede(self, name: str, step: int) -> None:
        """Before step `step`'s record goes into `name` (metrics.jsonl, ledger.jsonl): if the
        file holds records of that step or later (a run resumed from the checkpoint of an
        earlier step, by a new `fit` or a restarted controller, or restored from one while it
        runs, redoes those steps), they are dropped, so that every step is in the file once,
        as the run that holds the weights took it (as the loggers do). The file is replaced
        atomically; the newest step written is kept, so the file is read only once a run, a
        line at a time (a long run's metrics are gigabytes)."""
        path = os.path.join(self.run_dir, name)
        last = self._last_step.get(name)
        if last is None:
            last = max((_step(r) for r in iter_jsonl(path)), default=-1)
        if step <= last:
            with self._lock:
                fd = self._files.pop(name, None)
            if fd is not None:
                os.close(fd)
            try:
                write_private(path, (_line(r) for r in iter_jsonl(path) if _step(r) < step))
            except OSError as e:  # a full disk: the file keeps them; the run goes on
                logger.error("run log %s: cannot drop the records of steps %d and after from "
                             "%s (%s); the file holds them twice", self.run_dir, step, name, e)
        self._last_step[name] = step


def _step(record: dict[str, Any]) -> int:
    step = record.get("step", -1)
    return step if isinstance(step, int) else -1


def _line(record: dict[str, Any]) -> bytes:
    """One record as its files hold it: a JSON line."""
    return (json.dumps(record) + "\n").encode()


def _hand(sinks: list[Sink], hook: str, record: dict[str, Any]) -> None:
    """Calls `hook` of every sink; then raises the first exception one raised."""
    error: Exception | None = None
    for sink in sinks:
        try:
            getattr(sink, hook)(record)
        except Exception as e:  # the other sinks still get the record
            error = error or e
    if error is not None:
        raise error
