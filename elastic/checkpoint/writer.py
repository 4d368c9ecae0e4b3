"""Background checkpoint writing: the step pays only for a snapshot in host memory.

Every write runs on the writer's thread, for at most its time limit (`limit_s`,
`CheckpointConfig.timeout`) as far as anyone waiting for it is concerned: storage that
stops answering (a hung NFS mount, an object store that never replies) cannot stop a run, or
its end. A write past its limit is reported as failed; a thread cannot be stopped, so it runs
on, and no other write starts until it ends (those asked for meanwhile are skipped and say why).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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


@dataclass
class _Write:
    """The write in flight: its step, thread, time limit and deadline (monotonic; None: no
    limit); `done`: its outcome is recorded (set with it, under the writer's lock: the thread
    may still be ending); `overdue`: its time limit passed first and that was reported."""

    step: int
    started: float
    limit_s: float | None
    shard: str | None = None  # the write id, for a shard
    done: bool = False
    overdue: bool = False
    thread: threading.Thread = field(init=False)

    @property
    def deadline(self) -> float | None:
        return None if self.limit_s is None else self.started + self.limit_s


@dataclass(frozen=True)
class WriteReport:
    """One write: finished, or past its time limit (`error` says so; one that ends later is
    reported again then)."""

    step: int
    path: str | None
    seconds: float
    error: str | None = None
    pruned: tuple[int, ...] = ()
    prune_error: str | None = None  # retention could not remove a folder (the write stands)


class CheckpointWriter:
    """Writes at most one checkpoint at a time on a background thread.

    Args:
        root: checkpoint root (local path or fsspec URL).
        keep_last: how many valid checkpoints retention keeps.
        key: signs every manifest (see `elastic.checkpoint.signing`); None: unsigned.
        retention: what retention keeps, when it ranks checkpoints by a monitored metric too
            (its `keep_last` then replaces `keep_last`).
        limit_s: the longest anyone waits for a write (`CheckpointConfig.timeout`); None:
            for ever.
    """

    def __init__(self, root: str, keep_last: int, key: bytes | None = None,
                 retention: Retention | None = None, limit_s: float | None = None) -> None:
        self.root = root
        self.keep_last = keep_last
        self.key = key
        self.retention = retention or Retention(keep_last=keep_last)
        self.limit_s = limit_s
        self._lock = threading.Lock()
        self._running: _Write | None = None
        self._reports: list[WriteReport] = []
        self._shards: dict[str, dict[str, Any]] = {}  # write id -> `shard_entry`

    @property
    def writing(self) -> bool:
        """Whether a write is in flight (its thread competes with training for this process)."""
        with self._lock:
            return self._running is not None and not self._running.done

    def busy_note(self) -> str | None:
        """Why a write asked for now would be skipped (the one in flight, and how long it has
        run), or None when none is in flight."""
        with self._lock:
            self._check_overdue()
            running = self._running
            if running is None or running.done:
                return None
            ran = time.monotonic() - running.started
            if running.overdue:
                return (f"the write of step {running.step} has run {ran:.0f} s, past "
                        f"checkpoint.timeout ({running.limit_s:g} s): the storage may not "
                        "answer; nothing more is written until it ends, and this one was skipped")
            return (f"the write of step {running.step} is still in flight ({ran:.1f} s); this one "
                    "was skipped")

    def submit(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any],
               after_part: Callable[[str], None] | None = None,
               written: Written | None = None) -> bool:
        """Starts serialising and writing a snapshot (`parts`: name -> an object torch.save
        can write, already copied off the live state by the caller, into host memory: this
        thread never touches a GPU, and the files load where none is visible; `written`: the
        other owners' shards, waited for before the manifest); returns False (and writes
        nothing) if the previous write is still in flight, so snapshots never pile up."""
        return self._start(step, self._write, (step, dict(parts), dict(meta), after_part, written))

    def submit_shard(self, step: int, write: str, shard: Shard) -> bool:
        """Starts writing this member's shard of write `write` (of the checkpoint of `step`)
        alone; another member lists it in the manifest once `shard_entry` gives it. False if
        the previous write is still in flight (`shard_entry` then says so)."""
        if self._start(step, self._write_shard, (step, write, shard), shard=write):
            return True
        note = self.busy_note() or "the write before was still in flight"
        with self._lock:
            self._keep_shard(write, {"error": f"shard of step {step} not written: {note}"})
        return False

    def _start(self, step: int, target: Callable[..., Any], args: tuple,
               shard: str | None = None) -> bool:
        with self._lock:
            if self._running is not None and not self._running.done:
                return False
            record = _Write(step, time.monotonic(), self.limit_s, shard)
            record.thread = threading.Thread(target=self._run, args=(record, target, args),
                                             name=f"elastic-ckpt-{'shard-' if shard else ''}{step}",
                                             daemon=True)
            self._running = record
            record.thread.start()
            return True

    def _run(self, record: _Write, target: Callable[..., Any], args: tuple) -> None:
        """The writer's thread: the write, then its outcome recorded, and the write marked
        done, in one step under the lock (a flush at its deadline sees one or the other)."""
        outcome: Any = None
        try:
            outcome = target(*args)
        finally:  # a write that raised past its own handling still ends, and says so
            if outcome is None:
                error = f"the writer's thread ended without an outcome: {sys.exc_info()[1]!r}"
                outcome = ({"error": error} if record.shard is not None
                           else WriteReport(record.step, None, 0.0, error=error))
            with self._lock:
                if record.shard is None:
                    self._reports.append(outcome)
                else:
                    self._keep_shard(record.shard, outcome)
                record.done = True

    def write_now(self, step: int, parts: Mapping[str, Any], meta: Mapping[str, Any],
                  after_part: Callable[[str], None] | None = None,
                  written: Written | None = None) -> bool:
        """Writes (after the write in flight, if any) and applies retention, waiting for it up
        to the time limit; its report is taken with the background writes'. False (nothing
        written) if the write in flight is past its limit and still running (`busy_note`)."""
        self.flush()
        if not self.submit(step, parts, meta, after_part, written):
            return False
        self.flush()
        return True

    def write_shard_now(self, step: int, write: str, shard: Shard) -> None:
        """`submit_shard`, waited for up to the time limit (after the write in flight, if any)."""
        self.flush()
        if self.submit_shard(step, write, shard):
            self.flush()

    def shard_entry(self, write: str) -> dict[str, Any]:
        """Once this member's shard of write `write` is on disk (waiting for it up to the time
        limit): its name and manifest entry (`elastic.checkpoint.store.write_shard`), or the
        error that ended it. Any thread."""
        self.flush()
        with self._lock:
            return self._shards.get(write, {"error": f"this member wrote no shard of write {write}"})

    def _keep_shard(self, write: str, outcome: dict[str, Any]) -> None:
        """Under the lock."""
        self._shards[write] = outcome
        while len(self._shards) > _SHARDS_KEPT:
            self._shards.pop(next(iter(self._shards)))

    def _write_shard(self, step: int, write: str, shard: Shard) -> dict[str, Any]:
        """This member's shard, written: its entry (see `shard_entry`)."""
        name, value = shard
        try:
            return {"name": name, **write_shard(self.root, step, name, _bytes(value))}
        except Exception as e:
            return {"error": f"shard {name}: {type(e).__name__}: {e}"}

    def _write(self, step: int, parts: dict[str, Any], meta: dict[str, Any],
               after_part: Callable[[str], None] | None, written: Written | None = None
               ) -> WriteReport:
        """A checkpoint written, pruned after: its report."""
        started = time.perf_counter()
        try:
            blobs = {name: _bytes(value) for name, value in parts.items()}
            path = write_checkpoint(self.root, step, blobs, meta, after_part, self.key, written)
        except Exception as e:
            return WriteReport(step, None, time.perf_counter() - started,
                               error=f"{type(e).__name__}: {e}")
        # The checkpoint is committed: a folder retention cannot remove does not undo that.
        pruned: list[int] = []
        problems: list[str] = []
        try:
            pruned = prune(self.root, self.keep_last, self.key, self.retention, step, problems)
        except Exception as e:  # the storage failed listing or reading the folders
            problems.append(f"{type(e).__name__}: {e}")
        return WriteReport(step, path, time.perf_counter() - started, pruned=tuple(pruned),
                           prune_error="; ".join(problems) or None)

    def flush(self) -> None:
        """Waits for the write in flight, if any, up to its deadline (then reports it as
        failed; it runs on, and `busy_note` says so until it ends)."""
        with self._lock:
            running = self._running
        if running is None:
            return
        if running.deadline is None:
            running.thread.join()
        else:  # a join can return a hair before its timeout
            while running.thread.is_alive() and time.monotonic() < running.deadline:
                running.thread.join(running.deadline - time.monotonic())
        with self._lock:
            self._check_overdue()

    def _check_overdue(self) -> None:
        """Under the lock: reports the write in flight as failed once its deadline passed."""
        running = self._running
        if running is None or running.overdue or running.deadline is None \
                or time.monotonic() < running.deadline or running.done:
            return
        running.overdue = True
        error = (f"TimeoutError: the write did not finish within checkpoint.timeout "
                 f"({running.limit_s:g} s); the storage at {self.root} may not answer. Nothing more "
                 "is written until it ends (it may still finish and be reported then); raise "
                 "checkpoint.timeout if writes there are this slow")
        if running.shard is not None:
            self._keep_shard(running.shard, {"error": error})
        else:
            self._reports.append(WriteReport(running.step, None, time.monotonic() - running.started,
                                             error=error))

    def take_reports(self) -> list[WriteReport]:
        """Reports of writes finished (or past their time limit) since the last call."""
        with self._lock:
            self._check_overdue()
            reports, self._reports = self._reports, []
        return reports


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else serialize(value)
