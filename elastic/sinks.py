"""What runs beside a run's record files: its loggers and callbacks, fed by the run's log.

The controller opens them on its run thread before the state machine runs (`RunSinks.start`)
and ends them after it (`RunSinks.end`); `RunLog.add_sinks` says on which thread they run.
`elastic.loggers` and `elastic.callbacks` say what each does with a record and with a failure.

No Ray here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from elastic.callbacks import CallbackSink
from elastic.config import LoggingConfig
from elastic.control.states import Failed, Finished, Machine, State
from elastic.errors import ElasticError
from elastic.loggers import LoggerSink, open_loggers
from elastic.runlog import RunLog

logger = logging.getLogger(__name__)


class RunSinks:
    """A run's loggers (`config`) and callbacks, from the start of its machine to its end.

    Args:
        config: which loggers.
        callbacks: `TrainJob.callbacks`.
        machine: the run's state machine (its context holds the log, name and step).
    """

    def __init__(self, config: LoggingConfig, callbacks: Sequence[Any], machine: Machine) -> None:
        self.config = config
        self.machine = machine
        ctx = machine.ctx
        self.log: RunLog = ctx.log
        self.loggers = LoggerSink([], self.log, config.queue_points,
                                  config.flush_timeout.total_seconds())
        self.callbacks = CallbackSink(callbacks, self.log, lambda: ctx.step, self._stop)
        self.weights_left: dict[str, Any] | None = None
        """After `end`: the final weights of a run whose training finished but which a
        callback then failed (the caller gets the error, not the weights: the controller
        leaves them in the run dir)."""

    def _stop(self, reason: str) -> None:
        """A callback's `StopRun`: a stop request, unless the run ends there anyway (the
        chunk whose records are being handed out reached its last step, or it has ended)."""
        ctx = self.machine.ctx
        recorded = ctx.batching.recorded if ctx.batching is not None else 0
        reached = max(ctx.step, recorded)
        if not self.machine.state.label.is_terminal and reached < ctx.total_steps:
            ctx.request_stop(reason)

    def start(self) -> None:
        """Opens the loggers and hands them and the callbacks every record from now on, on
        this thread. A missing logger package fails the run (the machine enters `Failed`
        with the ConfigError, so that its `run` returns at once), as does a callback that raises
        on the `logger_failed` event of a logger that could not open (its CallbackError).
        A run with neither adds nothing to its log."""
        config = self.config
        if not self.callbacks.callbacks and config.csv is config.tensorboard is config.mlflow is None:
            return
        self.log.add_sinks(self.loggers, self.callbacks)
        try:
            ctx = self.machine.ctx
            self.loggers.add(open_loggers(self.config, ctx.name, self.log, ctx.restarted))
        except ElasticError as e:  # a missing package, or a callback raising on a logger's failure
            self.machine.enter(Failed(e))

    def end(self) -> State:
        """After the machine's run: delivers the records left and calls every callback's
        `on_finish`. A callback error that could not end the run at once (raised on the
        records of the run's last state change, or by `on_finish`) fails it now. Returns the
        final state."""
        trained = self.machine.state
        self.log.deliver()
        self._fail(self.callbacks.take_error())
        self._fail(self.callbacks.finish(self._summary()))
        state, error = self.machine.state, self.callbacks.error
        if isinstance(trained, Finished) and state is not trained:
            self.weights_left = trained.model_state
        if error is not None and not (isinstance(state, Failed) and state.error is error):
            logger.warning("run %s failed of its own error; a callback raised too: %s",
                           self.machine.ctx.name, error)
        return state

    def close(self) -> None:
        """Closes the loggers (after the run's last record) and stops feeding the sinks.
        Never raises: the run's end is decided by now."""
        try:
            for step in (self.log.deliver, lambda: self.loggers.close(self._summary()["state"]),
                         self.log.deliver):  # the last: a `logger_failed` event of a failing close
                try:
                    step()
                except Exception:  # a callback after an error of ours that skipped `end`
                    logger.exception("closing the loggers and callbacks of run %s",
                                     self.machine.ctx.name)
        finally:
            self.log.remove_sinks()

    def _fail(self, error: BaseException | None) -> None:
        if error is None:
            return
        if isinstance(self.machine.state, Failed):  # the first failure stays the run's
            return
        self.machine.enter(Failed(error))
        self.log.deliver()

    def _summary(self) -> dict[str, Any]:
        ctx, state = self.machine.ctx, self.machine.state
        failed = isinstance(state, Failed)
        error = state.error if isinstance(state, Failed) else None
        return {"name": ctx.name, "run_dir": self.log.run_dir,
                "state": "failed" if failed else "stopped" if ctx.stopped_early else "finished",
                "step": ctx.step,
                "error": f"{type(error).__name__}: {error}" if error is not None else None}
