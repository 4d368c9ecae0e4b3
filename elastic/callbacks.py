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
`on_finish`, which every callback gets for a finished, stopped or failed run. A hook that
raises `StopRun` instead stops the run as `elastic stop` does, at the next step boundary
(state 'stopped'; the final checkpoint, evaluation and model as for any stop): this is how
`EarlyStopping` ends a run whose monitored metric stopped improving.

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

__all__ = ["Callback", "CallbackSink", "EarlyStopping", "StopRun"]


class StopRun(Exception):
    """Raised by a callback hook: the run stops at the next step boundary, as on `elastic
    stop` (its message is the `stop_requested` event's reason)."""


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


class EarlyStopping(Callback):
    """Stops the run when the evaluation metric `monitor` has not improved for `patience`
    evaluations in a row, as Lightning's `EarlyStopping` and Transformers'
    `EarlyStoppingCallback` do; with `checkpoint.monitor` set to the same metric, the best
    checkpoint is kept.

    An evaluation improves on the best one before it when it is lower by more than
    `min_delta` (`mode` 'min'; higher by more than it for 'max'). A run restored from an
    older checkpoint evaluates those steps again: the evaluations of steps from the restored
    one on are replaced, not counted twice.

    Args:
        monitor: the evaluation metric (a key of what `evaluate` or `eval_step` returns).
        patience: evaluations without improvement that stop the run (at least 1).
        mode: 'min' (a loss) or 'max' (an accuracy).
        min_delta: the smallest change that counts as an improvement (at least 0).

    Raises:
        ValueError: an argument out of its range (when it is made).
    """

    def __init__(self, monitor: str, patience: int = 3, mode: str = "min",
                 min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping patience must be an integer of at least 1, got "
                             f"{patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping min_delta must be at least 0, got {min_delta!r}")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.history: list[tuple[int, float]] = []  # (step, value) of each evaluation

    def on_evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        if self.monitor not in metrics:
            returned = ", ".join(sorted(metrics)) or "no metrics"
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, but the evaluation "
                           f"returned {returned}")
        value = float(metrics[self.monitor])
        self.history = [(s, v) for s, v in self.history if s < step] + [(step, value)]
        best, waited = None, 0
        for s, v in self.history:
            if best is None or self._better(v, best[1]):
                best, waited = (s, v), 0
            else:
                waited += 1
        if best is not None and waited >= self.patience:
            raise StopRun(f"{self.monitor} has not improved for {waited} evaluations (best "
                          f"{best[1]:.6g} at step {best[0]})")

    def _better(self, value: float, best: float) -> bool:
        if value != value:  # NaN never improves
            return False
        if best != best:
            return True
        return (value < best - self.min_delta if self.mode == "min"
                else value > best + self.min_delta)


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
        stop: stops the run, with the reason (a hook raised `StopRun`; None: nothing stops).
    """

    def __init__(self, callbacks: Sequence[Any], log: RunLog, committed_step: Callable[[], int],
                 stop: Callable[[str], None] | None = None) -> None:
        self.callbacks = list(callbacks)
        self.log = log
        self.committed_step = committed_step
        self.stop = stop
        self._stopping = False  # a hook raised StopRun: the run stops (said once)
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
        except StopRun as e:
            if self.stop is not None and not self._stopping and not self._finished:
                self._stopping = True
                self.stop(f"{type(callback).__name__}.{hook}: {e}" if str(e)
                          else f"{type(callback).__name__}.{hook}")
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
