"""Events as text: the one place that turns a run's events into lines for the terminal.

`run` prints them live (`EventTail`), `demo` after the run, `logs` for any run.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable
from typing import Any

from cli.output import console
from elastic.events import (
    BatchPlanned,
    Chaos,
    CheckpointWritten,
    Evaluate,
    Event,
    Failed,
    MicroBatchTuned,
    OomBackoff,
    Rebalanced,
    RebalanceJudged,
    Recovered,
    Resized,
    Stopping,
    UserError,
    WorkerFailure,
    WorkerHung,
    WorkerJoined,
    read_events,
    record_fields,
)


def describe(event: Event) -> str | None:
    """One line saying what `event` means, or None for an event not worth a line of its own."""
    render = _RENDERERS.get(type(event))
    return render(event) if render is not None else None


def log_line(event: Event) -> str:
    """The line `elastic logs` prints for `event`: its kind, then what it means."""
    return f"{event.kind:>16}  {describe(event) or event.kind}"


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


def _batch_planned(e: BatchPlanned) -> str:
    return (f"global batch {e.global_batch_size} for {e.world_size} workers, learning-rate factor "
            f"{e.lr_factor_from:.3g} -> {e.lr_factor_to:.3g} over {e.warmup_steps} steps")


_RENDERERS: dict[type[Event], Callable[[Any], str | None]] = {
    WorkerFailure: _worker_failure,
    Recovered: _recovered,
    WorkerJoined: lambda e: f"worker {e.worker_id} joined",
    Resized: lambda e: f"resized to {e.world_size} workers (generation {e.generation})",
    UserError: lambda e: f"user code raised at step {e.step} on ranks {e.ranks}: {e.error}",
    Evaluate: lambda e: f"epoch {e.epoch} evaluation: {e.metrics}",
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
}


class EventTail:
    """Prints a run's events as they are appended to its events.jsonl (`run`'s live progress).

    Args:
        path: the run's events.jsonl (it may not exist yet).
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.seen = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self.flush()

    def flush(self) -> None:
        """Prints the events appended since the last call."""
        events = read_events(self.path)
        for event in events[self.seen:]:
            line = describe(event)
            if line:
                console.print(f"[cyan]event[/cyan] {line}")
        self.seen = len(events)
