"""A run's progress as a person reads it: one line per event worth one (`describe`), and a
progress bar or plain progress lines that follow the run directory's events.jsonl and
metrics.jsonl (`RunProgress`).

`elastic.fit` shows the progress in the driver process (`LoggingConfig.progress`; by default
a bar when stdout is a terminal, else nothing); `elastic run` through it, with lines when
stdout is not a terminal; `elastic demo` prints `describe` lines. `elastic logs` prints every
event, so `log_description` says what each one means (`_LOG_RENDERERS` for the kinds
`describe` has no line for).

No Ray and no torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from elastic.events import (
    BatchPlanned,
    Chaos,
    CheckpointBusy,
    CheckpointConfigChanged,
    CheckpointFailed,
    CheckpointSkipped,
    CheckpointWritten,
    ControllerRestarted,
    DeadlineMissed,
    DetachedExit,
    DrainRequested,
    Evaluate,
    Event,
    Failed,
    FinalModelFailed,
    FinalModelWritten,
    Finish,
    Generation,
    GenerationFailed,
    Grouped,
    HeadDraining,
    KillRequested,
    LoggerBehind,
    LoggerDropped,
    LoggerFailed,
    MemberUnreachable,
    MicroBatchTuned,
    Nonfinite,
    OomBackoff,
    Planned,
    PlannedDeparture,
    PreemptionNotice,
    Rebalanced,
    RebalanceJudged,
    Recovered,
    Resized,
    RestoredFromCheckpoint,
    Resumed,
    ScaleRequested,
    ShardsLost,
    SpareLost,
    SparePromoted,
    SpareReady,
    Start,
    StateChanged,
    Stopping,
    StopRequested,
    StragglerFound,
    UserError,
    WorkerFailure,
    WorkerHung,
    WorkerJoined,
    WorkerLost,
    WorkerRemoved,
    WorkerRetired,
    WorkerStartFailed,
    WorkerStarting,
    parse,
    record_fields,
)

Mode = Literal["bar", "lines"]


def describe(event: Event) -> str | None:
    """One line saying what `event` means, or None for an event not worth a line of its own."""
    render = _RENDERERS.get(type(event))
    return render(event) if render is not None else None


def _fields(event: Event) -> str:
    return f"{event.kind}: {record_fields(event)}"


def _worker_failure(e: WorkerFailure) -> str:
    ranks = ", ".join(map(str, e.lost_ranks)) or "none"
    if e.planned:
        return f"killed rank {ranks} on purpose at step {e.step}; {e.survivors} survivors go on"
    reasons = "; ".join(r for r in e.reasons if r)
    return (f"worker lost: rank {ranks} at step {e.step}, {e.survivors} survivors"
            + (f" (Ray: {reasons})" if reasons else ""))


def _recovered(e: Recovered) -> str:
    return (f"ring rebuilt {e.world_before} -> {e.world_after} workers in {e.total_s:.2f} s "
            f"(abort {e.abort_s * 1e3:.0f} ms, rebuild {e.rebuild_s * 1e3:.0f} ms, restore "
            f"{e.restore_s * 1e3:.0f} ms, first step {e.first_step_s * 1e3:.0f} ms)")


def _micro_batch_tuned(e: MicroBatchTuned) -> str:
    rates = ", ".join(f"{k}: {v:.0f}/s" for k, v in e.samples_per_s.items())
    return f"micro-batch {e.micro_batch} chosen after trying {rates}"


def _rebalance_judged(e: RebalanceJudged) -> str | None:
    if e.delivered:
        return None
    return (f"the re-split saved {e.realised_saving_s * 1e3:.1f} ms of a predicted "
            f"{e.predicted_saving_s * 1e3:.1f} ms; the next one needs {e.threshold:.0%} and is "
            f"watched for {e.window} chunks")


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, (int, float)) else str(value)


def _batch_planned(e: BatchPlanned) -> str:
    return (f"global batch {e.global_batch_size} for {e.world_size} workers, learning-rate factor "
            f"{e.lr_factor_from:.3g} -> {e.lr_factor_to:.3g} over {e.warmup_steps} steps")


def _resumed(e: Resumed) -> str:
    by = f" of run {e.from_run}" if e.from_run else ""
    at = f" at world size {e.world_size_then}" if e.world_size_then is not None else ""
    changed = "; changed: " + "; ".join(e.changes) if e.changes else ""
    redone = (f"; {e.work_lost_steps} steps redone (it had reached step {e.reached})"
              if e.reached is not None else "")
    return f"resumed from step {e.step}{by}, written{at} ({e.path}){redone}{changed}"


_RENDERERS: dict[type[Event], Callable[[Any], str | None]] = {
    Resumed: _resumed,
    PreemptionNotice: lambda e: (f"notice ({e.source}): rank(s) {_ids(e.ranks)} leave at the "
                                 "next step boundary"),
    PlannedDeparture: lambda e: (f"rank(s) {_ids(e.ranks)} left at step {e.step} on notice; "
                                 "no step redone"),
    DeadlineMissed: lambda e: f"worker {e.worker_id} missed its deadline; recovering",
    HeadDraining: lambda e: ("the head node drains: " + ("checkpoint at the next step"
                             if e.checkpoint else "no checkpoints to write")),
    StragglerFound: lambda e: (f"rank {e.rank} (worker {e.worker_id}) is a straggler: "
                               f"{e.samples_per_s:.0f} samples/s against "
                               f"{e.others_median_samples_per_s:.0f}; a spare takes its place"),
    WorkerFailure: _worker_failure,
    Recovered: _recovered,
    WorkerJoined: lambda e: f"worker {e.worker_id} joined",
    SparePromoted: lambda e: (f"spare(s) {_ids(e.worker_ids)} took the place(s) of workers gone: "
                              f"{e.world_size} workers"),
    Resized: lambda e: f"resized to {e.world_size} workers (generation {e.generation})",
    UserError: lambda e: f"user code raised at step {e.step} on ranks {e.ranks}: {e.error}",
    Evaluate: lambda e: (f"evaluation at step {e.step} ({e.epoch} epochs done): "
                         + ", ".join(f"{k} {_number(v)}" for k, v in sorted(e.metrics.items()))),
    MicroBatchTuned: _micro_batch_tuned,
    OomBackoff: lambda e: (f"out of memory on rank {e.rank} at step {e.step}: micro-batch "
                           f"{e.micro_batch_before} -> {e.micro_batch_after}, step redone"),
    Rebalanced: lambda e: (f"shares rebalanced {e.shares_before} -> {e.shares_after} (predicted "
                           f"compute {e.predicted_before_s * 1e3:.0f} -> "
                           f"{e.predicted_after_s * 1e3:.0f} ms)"),
    RebalanceJudged: _rebalance_judged,
    BatchPlanned: _batch_planned,
    CheckpointWritten: lambda e: (f"checkpoint of step {e.step} written in {e.seconds:.2f} s"
                                  + (f"; retention left older ones: {e.prune_error}"
                                     if e.prune_error else "")),
    # A chaos kill is told by the failure it causes (as planned).
    Chaos: lambda e: None if e.action == "kill" else _fields(e),
    WorkerHung: _fields,
    Stopping: _fields,
    Failed: _fields,
    LoggerBehind: lambda e: (f"logger {e.logger} is {e.queued} points behind: those from "
                             f"step {e.step} on are dropped until it catches up"),
    LoggerDropped: lambda e: (f"logger {e.logger} dropped {e.points} points (steps "
                              f"{e.first_step} to {e.last_step}); metrics.jsonl has them"),
    LoggerFailed: lambda e: (f"logger {e.logger} failed"
                             + (f" at step {e.step}" if e.step is not None else "")
                             + f" ({e.error}); it is off for the rest of the run"),
}




# --- following a run -----------------------------------------------------------------------------


def resolve(setting: str, terminal: bool, otherwise: Mode | None = None) -> Mode | None:
    """The display for `LoggingConfig.progress` `setting`: 'auto' is a bar on a terminal and
    `otherwise` elsewhere; None shows nothing."""
    if setting == "auto":
        return "bar" if terminal else otherwise
    if setting in ("bar", "lines"):
        return "bar" if setting == "bar" else "lines"
    return None


@contextlib.contextmanager
def follow(run_dir: str, setting: str) -> Iterator[None]:
    """Shows the progress of the run writing to `run_dir` while the block runs (`setting`
    as `LoggingConfig.progress`; 'auto' shows nothing when stdout is not a terminal)."""
    from rich.console import Console

    console = Console()
    mode = resolve(setting, console.is_terminal)
    if mode is None:
        yield
        return
    with RunProgress(run_dir, mode, console):
        yield


def _records(lines: list[str]) -> list[dict[str, Any]]:
    """The records among `lines`; a line a failed write cut short (a full disk, a crash) is
    passed over, as `elastic.events.iter_jsonl` does: the display goes on."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
    return records


class _Tail:
    """The complete lines appended to a file since the last read (a line still being
    written waits for the next). The file stays open between reads, so that its inode
    cannot be reused; when the path names another file (`RunLog` replaced metrics.jsonl to
    drop the records of steps a resumed run redoes), the new one is read from its start,
    less the lines the old one held up to where this had read: what was kept of them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.file: Any = None
        self._open()
        if self.file is not None:  # the lines there before belong to an earlier run: this run's only
            for raw in self.file:  # a line at a time: a long run's metrics are gigabytes
                if not raw.endswith(b"\n"):
                    break
                self.offset += len(raw)

    def _open(self) -> bool:
        try:
            self.file = open(self.path, "rb")  # held open between reads
        except FileNotFoundError:
            return False
        self.offset = 0
        return True

    def _complete(self, data: bytes) -> list[str]:
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [line for line in complete.decode().splitlines() if line.strip()]

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != os.fstat(self.file.fileno()).st_ino
        except FileNotFoundError:
            return False

    def read(self) -> list[str]:
        if self.file is None:
            return self._complete(self.file.read()) if self._open() else []
        if not self._replaced():
            self.file.seek(self.offset)
            return self._complete(self.file.read())
        old, read = self.file, self.offset
        if not self._open():
            old.close()
            self.file = None
            return []
        try:
            return self._unseen(old, read)
        finally:
            old.close()

    def _unseen(self, old: Any, read: int) -> list[str]:
        """The complete lines of the file now open that are not among the first `read` bytes
        of `old`, the file it replaced: the new one holds some of those lines, in order, then
        new ones. Both are read a line at a time."""
        old.seek(0)
        earlier = iter(old.readline, b"")
        left, fresh, lines = read, False, []
        for raw in self.file:
            if not raw.endswith(b"\n"):
                break  # still being written: the next read takes it
            self.offset += len(raw)
            while not fresh:  # the old lines passed over were dropped by the replacement
                before = next(earlier, b"") if left > 0 else b""
                if not before:
                    fresh = True
                    break
                left -= len(before)
                if before == raw:
                    break
            if fresh and raw.strip():
                lines.append(raw.decode().rstrip("\n"))
        self.file.seek(self.offset)
        return lines

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class RunProgress:
    """Follows a run's events.jsonl and metrics.jsonl on a thread and shows them: every
    event worth a line, and a progress bar (steps done of the total, epoch, loss, samples/s,
    world size, last event) or, as plain lines, a progress line at every tenth of the run.
    A context manager: leaving it shows what is left and stops.

    Args:
        run_dir: the run directory (its files may not exist yet; records already in them
            belong to an earlier run and are skipped).
        mode: 'bar' or 'lines'.
        console: a `rich.console.Console` (default: stdout's).
    """

    POLL_SECONDS = 0.2

    def __init__(self, run_dir: str, mode: Mode, console: Any = None) -> None:
        from rich.console import Console

        self.mode = mode
        self.console = console or Console()
        self.events = _Tail(os.path.join(run_dir, "events.jsonl"))
        self.metrics = _Tail(os.path.join(run_dir, "metrics.jsonl"))
        self.total: int | None = None
        self.last: dict[str, Any] = {}  # the newest metrics line
        self.last_event = ""
        self._tenth = -1  # the last tenth of the run a progress line was printed for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elastic-progress", daemon=True)
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> RunProgress:
        if self.mode == "bar":
            self._bar = _progress_bar(self.console)
            self._task = self._bar.add_task("steps", total=None, info="starting")
            self._bar.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.flush()
        finally:
            self.events.close()
            self.metrics.close()
            if self._bar is not None:
                self._bar.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            self.flush()

    def flush(self) -> None:
        """Shows the records appended since the last call, events and steps in time order
        (a step's time is its workers' clock, an event's the controller's: on one host, or
        hosts whose clocks agree, the order is right to the millisecond)."""
        events = [parse(record) for record in _records(self.events.read())]
        for event in events:
            if isinstance(event, Planned):  # before any step, whatever the clocks say
                self.total = event.total_steps
        records: list[tuple[float, Event | dict[str, Any]]] = [(e.time or 0.0, e) for e in events]
        records += [(m.get("time") or 0.0, m) for m in _records(self.metrics.read())]
        for _, record in sorted(records, key=lambda r: r[0]):
            if isinstance(record, Event):
                self._event(record)
            else:
                self._step(record)

    def _event(self, event: Event) -> None:
        text = describe(event)
        if text:
            self.last_event = text
            self.console.print(f"[cyan]event[/cyan] {text}")
        self._update()

    def _step(self, record: dict[str, Any]) -> None:
        self.last = record
        done = int(record["step"]) + 1
        if self.mode == "lines" and self.total:
            tenth = min(10, done * 10 // self.total)
            if tenth > self._tenth:
                self._tenth = tenth
                self.console.print(f"step {done}/{self.total}  {self._info()}")
        self._update()

    def _update(self) -> None:
        if self._bar is None:
            return
        done = int(self.last["step"]) + 1 if self.last else 0
        total = max(self.total, done) if self.total is not None else None
        self._bar.update(self._task, completed=done, total=total,
                         info=f"{self._info()}  {self.last_event[:60]}".strip())

    def _info(self) -> str:
        """Epoch, loss, samples/s and world size of the newest step."""
        m = self.last
        if not m:
            return ""
        parts = [f"epoch {m.get('epoch')}"]
        if isinstance(m.get("loss"), int | float):
            parts.append(f"loss {m['loss']:.4g}")
        if isinstance(m.get("samples_per_s"), int | float):
            parts.append(f"{m['samples_per_s']:.0f} samples/s")
        world = m.get("world_size")
        parts.append(f"{world} worker{'' if world == 1 else 's'}")
        return "  ".join(parts)


def _progress_bar(console: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=console, auto_refresh=True)


def log_description(event: Event) -> str:
    """What `event` means, in one line, for every known kind; a kind this version does not
    know (written by a newer one) by its name."""
    render = _LOG_RENDERERS.get(type(event))
    return (render(event) if render is not None else describe(event)) or event.kind


def _state(e: StateChanged) -> str:
    details = []
    if e.world_size is not None:
        details.append(f"{e.world_size} workers" + (f", target {e.target}" if e.target is not None else ""))
    elif e.target is not None:
        details.append(f"target {e.target} workers")
    if e.lost_ranks:
        details.append(f"lost ranks {', '.join(map(str, e.lost_ranks))}")
    return f"{e.previous} -> {e.state}" + (f" ({'; '.join(details)})" if details else "")


def _generation(e: Generation) -> str:
    return (f"generation {e.generation}: {e.world_size} workers ({e.reason}), state of step {e.step} "
            f"from rank {e.source_rank} over {e.transport}; workers by rank "
            f"{', '.join(map(str, e.workers))}"
            + (f"; {e.shard_copies} owners of each parameter's optimizer state"
               if e.shard_copies is not None else ""))


def _start(e: Start) -> str:
    scaling = e.config.get("scaling") or {}
    batch = e.config.get("batch") or {}
    parts = [f"run {e.name} started"]
    if "num_workers" in scaling:
        parts.append(f"{scaling['num_workers']} workers")
    if "global_batch_size" in batch:
        parts.append(f"global batch {batch['global_batch_size']}")
    return ", ".join(parts)


def _chaos(e: Chaos) -> str:
    if e.action == "slow":
        lasting = f"{e.steps} steps" if e.steps is not None else "the rest of its life"
        return f"chaos at step {e.step}: rank {e.rank} slowed {e.factor:g}x for {lasting}"
    return f"chaos at step {e.step}: {e.action} rank {e.rank} in phase {e.phase}"


def _rebalance_judged(e: RebalanceJudged) -> str:
    return describe(e) or (f"the re-split saved {e.realised_saving_s * 1e3:.1f} ms of a predicted "
                           f"{e.predicted_saving_s * 1e3:.1f} ms, as predicted")


def _finish(e: Finish) -> str:
    return (f"run {'stopped' if e.stopped else 'finished'} at step {e.step} after {e.samples} "
            "samples")


def _ids(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"


_WHY_START = {"replacement": "to replace lost ones", "capacity": "on free capacity",
              "spare": "as hot spares"}


def _loaded(what: str) -> Callable[[Any], str]:
    return lambda e: (f"{what} the checkpoint of step {e.step} ({e.path}); "
                      f"{e.work_lost_steps} steps redone")


_LOG_RENDERERS: dict[type[Event], Callable[[Any], str]] = {
    Start: _start,
    ControllerRestarted: lambda e: (f"the controller of run {e.name} restarted; it resumes from "
                                    "the newest checkpoint"),
    Planned: lambda e: (f"{e.total_steps} steps planned ({e.steps_per_epoch} per epoch over "
                        f"{e.dataset_size} samples)"),
    Grouped: lambda e: ((f"batch groups of {e.group_size}" if e.groups else "batch groups off")
                        + (", the split pinned" if e.pinned else "") + f": {e.reason}"),
    StateChanged: _state,
    Stopping: lambda e: f"stop request takes effect at step {e.step}",
    Finish: _finish,
    Failed: lambda e: f"run failed at step {e.step}: {e.error}",
    DetachedExit: lambda e: "detached controller exits" + (" (the run failed)" if e.failed else ""),
    FinalModelWritten: lambda e: f"final model written to {e.path}",
    FinalModelFailed: lambda e: f"the final model could not be written to {e.path}: {e.error}",
    ScaleRequested: lambda e: f"scale to {e.num_workers} workers requested",
    KillRequested: lambda e: f"kill of rank {e.rank} (worker {e.worker_id}) requested",
    DrainRequested: lambda e: (f"drain of worker(s) {_ids(e.worker_ids)} requested"
                               + (f", within {e.deadline_s:g} s" if e.deadline_s is not None
                                  else "")),
    PreemptionNotice: lambda e: (f"notice ({e.source}): rank(s) {_ids(e.ranks)} leave at the "
                                 "next step boundary" + (f"; {e.reason}" if e.reason else "")),
    PlannedDeparture: lambda e: (f"rank(s) {_ids(e.ranks)} left at step {e.step}, "
                                 f"{e.notice_to_gone_s:.2f} s after the notice; "
                                 f"{e.steps_redone} steps redone"),
    DeadlineMissed: lambda e: (f"worker {e.worker_id} still trained at its deadline; killed "
                               "(the run recovers as from a failure)"),
    HeadDraining: lambda e: (f"{e.reason}: the cluster ends with it; "
                             + ("the committed state is written at the next step boundary"
                                if e.checkpoint else "the run has no checkpoints to write it to")),
    StopRequested: lambda e: (f"stop requested{f' by {e.reason}' if e.reason else ''}; the run "
                              "stops at the next step boundary"),
    Chaos: _chaos,
    WorkerStarting: lambda e: (f"starting workers {_WHY_START.get(e.reason, e.reason)} until the "
                               f"run has {e.target}"),
    WorkerStartFailed: lambda e: f"a worker failed to start: {e.error}",
    WorkerRemoved: lambda e: f"worker {e.worker_id} removed to shrink the run",
    SpareReady: lambda e: f"worker {e.worker_id} (pid {e.pid}) waits as a hot spare",
    SpareLost: lambda e: f"spare worker {e.worker_id} died while it waited; another one starts",
    WorkerRetired: lambda e: (f"{e.role} worker {e.worker_id} let go on notice ({e.source}); "
                              "another one starts"),
    WorkerLost: lambda e: f"rank {e.rank} (worker {e.worker_id}) dropped: {e.why}",
    MemberUnreachable: lambda e: f"worker {e.worker_id} did not answer",
    WorkerHung: lambda e: (f"rank {e.rank} (worker {e.worker_id}) made no progress in "
                           f"{e.phase}; killed"),
    Generation: _generation,
    GenerationFailed: lambda e: (f"generation {e.generation} failed to form (attempt {e.attempt}): "
                                 + "; ".join(e.errors)),
    Nonfinite: lambda e: (f"non-finite loss or gradients at step {e.step} on ranks "
                          f"{', '.join(map(str, e.ranks))}; policy {e.policy}"),
    RebalanceJudged: _rebalance_judged,
    Resumed: lambda e: _resumed(e),
    RestoredFromCheckpoint: _loaded("no survivor held the state; restored"),
    ShardsLost: lambda e: (f"every owner of the optimizer state of {len(e.parts)} parameter(s) "
                           f"was lost at step {e.step}; restoring the newest checkpoint"),
    CheckpointFailed: lambda e: f"checkpoint of step {e.step} failed: {e.error}",
    CheckpointBusy: lambda e: f"checkpoint of step {e.step} skipped: {e.note}",
    CheckpointSkipped: lambda e: f"checkpoint {e.path} not loaded: {e.reason}",
    CheckpointConfigChanged: lambda e: f"checkpoint {e.path}: {e.note}",
}
