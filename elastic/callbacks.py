"""Callbacks: user code that the controller calls with a run's committed steps, its events,
evaluations and checkpoints, and its end.

Subclass `Callback`, override the hooks you need and pass instances in
`TrainJob(callbacks=[...])`. Callbacks run in the controller process, never inside a worker's
step, one record at a time after the record is written to the run directory (the order of
`events.jsonl` and `metrics.jsonl`); a slow hook delays the next chunk of steps, not the step
in flight. A callback travels to the controller pickled, so it must be picklable, and what it
keeps lives in the controller process: write results to a file or a service, not to the object
in the driver.

A hook that raises ends the run: `elastic.errors.CallbackError` (a `UserCodeError`) naming the
class and hook, with the hook's traceback. No hook of any callback is called after that except
`on_finish`, which every callback gets for a finished, stopped or failed run.

No Ray here.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from elastic.errors import CallbackError
from elastic.events import CheckpointWritten, Evaluate, parse

if TYPE_CHECKING:
    from elastic.runlog import RunLog

__all__ = ["Callback", "CallbackSink"]


class Callback:
    """Base of a callback: every hook does nothing. Records are copies (changing one changes
    nothing else)."""

    def on_step(self, record: dict[str, Any]) -> None:
        """A committed step's metrics line, as in metrics.jsonl (`step`, `epoch`, `loss`, `lr`,
        `samples_per_s`, `world_size`, `global_batch_size`, and `metrics`, `grad_norm`,
        `scale` when the step has them). Steps come in increasing order, except that a run
        that restores an older checkpoint logs the steps after it again."""

    def on_event(self, record: dict[str, Any]) -> None:
        """Every event, as in events.jsonl (`{"time": ..., "event": kind, **fields}`)."""

    def on_evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        """An evaluation's results, after `step` committed steps (after its `on_event`)."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """The checkpoint of `step` is complete at `path` (after its `on_event`)."""

    def on_finish(self, summary: dict[str, Any]) -> None:
        """The run ended: `{"name", "run_dir", "state": "finished" | "stopped" | "failed",
        "step": committed steps, "error": "Type: message" or None}`."""


# Events the state machine writes while it changes state: an exception raised there would read
# as a bug of the controller (ControllerError), so a hook's error on them ends the run later.
_TRANSITIONS = ("state", "failed")


class CallbackSink:
    """Feeds callbacks from the run's log (an `elastic.runlog.Sink`) and turns a hook's
    exception into `CallbackError`.

    The error is raised from the log call that wrote the record, inside the state that wrote
    it, so that the state machine fails the run with it. The error of a record written by
    another thread (a control request's), or of a state change (`state`, `failed`, written
    while the machine changes state), waits for the next record the run writes itself, or for
    `take_error`.

    Args:
        callbacks: objects with any of the `Callback` hooks.
        log: the run's log (it says who wrote the record being handed out).
        committed_step: the run's committed step, for the error of a hook whose record has no
            step (otherwise the error names the record's).
    """

    def __init__(self, callbacks: Sequence[Any], log: RunLog, committed_step: Callable[[], int]) -> None:
        self.callbacks = list(callbacks)
        self.log = log
        self.committed_step = committed_step
        self.error: CallbackError | None = None
        self._raised = False
        self._finished = False  # on_finish is the last hook a callback gets
        self._step: Any = None  # the step of the record being handed out, if it has one

    def on_metric(self, record: dict[str, Any]) -> None:
        if self._finished:
            return
        self._step = record.get("step")
        for callback in self.callbacks:
            self._call(callback, "on_step", copy.deepcopy(record))
        self._raise()

    def on_event(self, record: dict[str, Any]) -> None:
        if self._finished:
            return
        event = parse(record)
        self._step = record.get("step")
        for callback in self.callbacks:
            self._call(callback, "on_event", copy.deepcopy(record))
            if isinstance(event, Evaluate):
                self._call(callback, "on_evaluate", event.step, copy.deepcopy(event.metrics))
            elif isinstance(event, CheckpointWritten):
                self._call(callback, "on_checkpoint", event.step, event.path)
        if record.get("event") not in _TRANSITIONS:
            self._raise()

    def finish(self, summary: dict[str, Any]) -> CallbackError | None:
        """Calls every callback's `on_finish` (no hook is called after it); returns the first
        hook error not raised yet."""
        self._finished = True
        self._step = None
        for callback in self.callbacks:
            self._call(callback, "on_finish", copy.deepcopy(summary))
        return self.take_error()

    def take_error(self) -> CallbackError | None:
        """The first hook error if it has not been raised yet (taken: it is never raised)."""
        if self._raised or self.error is None:
            return None
        self._raised = True
        return self.error

    def _call(self, callback: Any, hook: str, *args: Any) -> None:
        method = getattr(callback, hook, None)
        if method is None or (self.error is not None and hook != "on_finish"):
            return
        try:
            method(*args)
        except Exception as e:
            if self.error is None:
                self.error = CallbackError(
                    f"callback {type(callback).__name__}.{hook} raised {type(e).__name__}: {e}",
                    rank=-1, step=self._step if isinstance(self._step, int) else self.committed_step(),
                    traceback=traceback.format_exc())

    def _raise(self) -> None:
        if self.error is not None and not self._raised and self.log.handing_own:
            self._raised = True
            raise self.error
