"""A run's progress as a person reads it: one line per event worth one (`describe`), and a
progress bar or plain progress lines that follow the run directory's events.jsonl and
metrics.jsonl (`RunProgress`).

`elastic.fit` shows the progress in the driver process (`LoggingConfig.progress`; by default
a bar when stdout is a terminal, else nothing); `elastic run` through it, with lines when
stdout is not a terminal; `elastic logs` and `elastic demo` print `describe` lines.

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
    CheckpointWritten,
    Evaluate,
    Event,
    Failed,
    LoggerFailed,
    MicroBatchTuned,
    OomBackoff,
    Planned,
    Rebalanced,
    RebalanceJudged,
    Recovered,
    Resized,
    Stopping,
    UserError,
    WorkerFailure,
    WorkerHung,
    WorkerJoined,
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


_RENDERERS: dict[type[Event], Callable[[Any], str | None]] = {
    WorkerFailure: _worker_failure,
    Recovered: _recovered,
    WorkerJoined: lambda e: f"worker {e.worker_id} joined",
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
    CheckpointWritten: lambda e: f"checkpoint of step {e.step} written in {e.seconds:.2f} s",
    # A chaos kill is told by the failure it causes (as planned).
    Chaos: lambda e: None if e.action == "kill" else _fields(e),
    WorkerHung: _fields,
    Stopping: _fields,
    Failed: _fields,
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


class _Tail:
    """The complete lines appended to a file since the last read (a line still being
    written waits for the next)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0  # this run's only

    def read(self) -> list[str]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [line for line in complete.decode().splitlines() if line.strip()]


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
        self.flush()
        if self._bar is not None:
            self._bar.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL_SECONDS):
            self.flush()

    def flush(self) -> None:
        """Shows the records appended since the last call, events and steps in time order
        (a step's time is its workers' clock, an event's the controller's: on one host, or
        hosts whose clocks agree, the order is right to the millisecond)."""
        events = [parse(json.loads(line)) for line in self.events.read()]
        for event in events:
            if isinstance(event, Planned):  # before any step, whatever the clocks say
                self.total = event.total_steps
        records: list[tuple[float, Event | dict[str, Any]]] = [(e.time or 0.0, e) for e in events]
        records += [(m.get("time") or 0.0, m) for m in map(json.loads, self.metrics.read())]
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
