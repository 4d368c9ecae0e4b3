"""Callbacks: each hook with the right arguments, in the order of the run's records, on the
controller's run thread; a hook that raises fails the run with CallbackError, never a
ControllerError, wherever it raised; on_finish runs for finished, stopped and failed runs.

The runs are the controller's state machine over simulated workers (no Ray)."""

from __future__ import annotations

import sys
import threading

import pytest

from elastic import Callback
from elastic.config import BatchConfig, FailureConfig, FitConfig, LoggingConfig, ScalingConfig
from elastic.control.context import Context
from elastic.control.simulation import SimulatedWorkers
from elastic.control.states import Failed, Finished, Machine
from elastic.errors import CallbackError, ConfigError, UserCodeError
from elastic.events import CheckpointWritten, Evaluate, StopRequested
from elastic.runlog import RunLog
from elastic.sinks import RunSinks
from elastic.trainer.replica import UserFailure


class Recorder(Callback):
    """Records every hook call; raises `ValueError("boom")` on the call `fail_on` matches."""

    def __init__(self, fail_on=lambda hook, arg: False) -> None:
        self.calls: list[tuple] = []
        self.threads: set[int] = set()
        self.fail_on = fail_on

    def _called(self, hook: str, *args) -> None:
        self.calls.append((hook, *args))
        self.threads.add(threading.get_ident())
        if self.fail_on(hook, args[0]):
            raise ValueError("boom")

    def on_step(self, record):
        self._called("on_step", record["step"])

    def on_event(self, record):
        self._called("on_event", record["event"])

    def on_evaluate(self, step, metrics):
        self._called("on_evaluate", step, metrics)

    def on_checkpoint(self, step, path):
        self._called("on_checkpoint", step, path)

    def on_finish(self, summary):
        self._called("on_finish", summary)


def _run(tmp_path, callbacks, steps=10, sim=None, **config):
    """Runs the machine with `callbacks` as the controller does; returns (end, context)."""
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=steps, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8, autotune=False), **config)
    sim = sim or SimulatedWorkers(dataset_size=8000, capacity=2)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    machine = Machine(ctx)
    sinks = RunSinks(LoggingConfig(), callbacks, machine)
    sinks.start()
    machine.run()
    end = sinks.end()
    sinks.close()
    return end, ctx


def _hook(calls, name):
    return [c[1:] for c in calls if c[0] == name]


def test_hooks_get_each_record_in_order_as_copies(tmp_path):
    from elastic.callbacks import CallbackSink

    log, recorder = RunLog(str(tmp_path)), Recorder()
    sink = CallbackSink([recorder, object()], log, committed_step=lambda: 1)  # hooks are optional
    log.add_sinks(sink)
    log.metric(step=0, loss=0.5, shares=[4, 4])
    log.emit(Evaluate(step=1, epoch=0, metrics={"mse": 0.25}))
    log.emit(CheckpointWritten(step=1, path="/ckpt/step-1", seconds=0.1, pruned=[]))
    assert sink.finish({"state": "finished"}) is None
    assert recorder.calls == [
        ("on_step", 0), ("on_event", "evaluate"), ("on_evaluate", 1, {"mse": 0.25}),
        ("on_event", "checkpoint_written"), ("on_checkpoint", 1, "/ckpt/step-1"),
        ("on_finish", {"state": "finished"})]


def test_a_hook_that_changes_its_record_changes_nothing_else(tmp_path):
    class Mutator(Callback):
        def on_step(self, record):
            record["shares"].append(99)
            record["loss"] = None

    end, ctx = _run(tmp_path, [Mutator()], steps=4)
    assert isinstance(end, Finished)
    assert [m["shares"] for m in ctx.log.metrics] == [[4, 4]] * 4
    assert None not in [m["loss"] for m in ctx.log.metrics]


def test_callbacks_see_every_committed_step_and_event_and_the_end_on_the_run_thread(tmp_path):
    recorder = Recorder()
    end, ctx = _run(tmp_path, [recorder])
    assert isinstance(end, Finished)
    assert _hook(recorder.calls, "on_step") == [(s,) for s in range(10)]
    assert _hook(recorder.calls, "on_event") == [(e["event"],) for e in ctx.log.events]
    assert recorder.calls[-1] == ("on_finish", {"name": "sim", "run_dir": str(tmp_path),
                                                "state": "finished", "step": 10, "error": None})
    assert recorder.threads == {threading.get_ident()}


def _raises_on(hook: str, arg) -> Recorder:
    return Recorder(fail_on=lambda h, a: h == hook and a == arg)


@pytest.mark.parametrize("hook, arg", [
    ("on_step", 5),  # in the middle of a chunk's metrics lines
    ("on_event", "generation"),  # an event a state writes
    ("on_event", "state"),  # the machine's own transition record: the error waits a record
    ("on_event", "finish"),
], ids=["on_step", "on_event-generation", "on_event-state", "on_event-finish"])
def test_a_raising_hook_fails_the_run_with_a_callback_error(tmp_path, hook, arg):
    raiser, bystander = _raises_on(hook, arg), Recorder()
    end, ctx = _run(tmp_path, [raiser, bystander])
    assert isinstance(end, Failed) and type(end.error) is CallbackError
    assert isinstance(end.error, UserCodeError)
    assert end.error.args[0] == f"callback Recorder.{hook} raised ValueError: boom"
    assert 'raise ValueError("boom")' in end.error.traceback
    [failed] = [e for e in ctx.log.events if e["event"] == "failed"]
    assert failed["error"].startswith(f"CallbackError: callback Recorder.{hook} raised")
    assert [e["state"] for e in ctx.log.events if e["event"] == "state"][-1] == "failed"
    # After the error no hook runs but on_finish, which every callback gets once.
    assert bystander.calls[-1] == ("on_finish", {"name": "sim", "run_dir": str(tmp_path),
                                                 "state": "failed", "step": ctx.step,
                                                 "error": failed["error"]})
    assert _hook(raiser.calls, "on_finish") == _hook(bystander.calls, "on_finish")
    if hook == "on_step":
        assert [m["step"] for m in ctx.log.metrics] == list(range(6))


def test_a_hook_that_raises_on_the_last_state_change_fails_the_finished_run(tmp_path):
    class RaiseAtTheEnd(Recorder):
        def on_event(self, record):
            if record["event"] == "state" and record["state"] == "finished":
                raise ValueError("boom")

    raiser = RaiseAtTheEnd()
    end, ctx = _run(tmp_path, [raiser], steps=4)
    states = [(e["previous"], e["state"]) for e in ctx.log.events if e["event"] == "state"]
    assert states[-2:] == [("finishing", "finished"), ("finished", "failed")]
    assert type(end.error) is CallbackError and end.error.step == 4
    assert end.error.args[0] == "callback RaiseAtTheEnd.on_event raised ValueError: boom"
    assert raiser.calls[-1][1]["state"] == "failed"


def test_a_raising_on_finish_fails_a_finished_run_and_leaves_its_weights(tmp_path):
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=4, scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), SimulatedWorkers(dataset_size=8000,
                                                                      capacity=2))
    machine = Machine(ctx)
    sinks = RunSinks(LoggingConfig(), [Recorder(fail_on=lambda h, a: h == "on_finish")], machine)
    sinks.start()
    machine.run()
    end = sinks.end()
    sinks.close()
    assert type(end.error) is CallbackError
    assert end.error.args[0] == "callback Recorder.on_finish raised ValueError: boom"
    assert ctx.log.events[-2]["event"] == "failed"
    # Before, the trained weights were dropped: the controller now writes them to final_model.pt.
    assert sinks.weights_left == {"step": 4}


def test_on_finish_runs_for_a_stopped_and_a_failed_run(tmp_path):
    def stop(step):
        if step >= 4:
            with ctx.requests.lock:
                ctx.requests.stop = True

    stopped = Recorder()
    ctx = None
    sim = SimulatedWorkers(dataset_size=8000, capacity=2, before_chunk=stop)
    cfg = FitConfig(run_dir=str(tmp_path / "a"), max_steps=100, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=8))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path / "a")), sim)
    machine = Machine(ctx)
    sinks = RunSinks(LoggingConfig(), [stopped], machine)
    sinks.start()
    machine.run()
    sinks.end()
    assert ctx.stopped_early
    assert stopped.calls[-1] == ("on_finish", {"name": "sim", "run_dir": str(tmp_path / "a"),
                                               "state": "stopped", "step": ctx.step, "error": None})

    failed = Recorder()
    failure = UserFailure(5, (1,), "Traceback\nKeyError: 'x'")
    end, _ = _run(tmp_path / "b", [failed], failure=FailureConfig(max_user_retries=0),
                  sim=SimulatedWorkers(dataset_size=8000, capacity=2, votes={5: [failure]}))
    assert type(end.error) is UserCodeError
    summary = failed.calls[-1][1]
    assert (summary["state"], summary["error"].splitlines()[0].split(":")[0]) == ("failed", "UserCodeError")


def test_a_hook_may_stop_its_own_run_through_another_thread(tmp_path):
    """`elastic.stop` from a hook reaches the controller on another thread, whose event waits
    for the run thread: neither waits on the other."""

    class StopAtThree(Callback):
        def on_step(self, record):
            if record["step"] == 3:
                helper = threading.Thread(target=self.stop)
                helper.start()
                helper.join()

        def stop(self):  # what Controller.stop does on a control thread
            with ctx.requests.lock:
                ctx.requests.stop = True
            ctx.log.emit(StopRequested())

    recorder = Recorder()
    ctx = None
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=100, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=8))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), SimulatedWorkers(dataset_size=8000, capacity=2))
    machine = Machine(ctx)
    sinks = RunSinks(LoggingConfig(), [StopAtThree(), recorder], machine)
    sinks.start()
    machine.run()
    end = sinks.end()
    assert isinstance(end, Finished) and ctx.stopped_early and ctx.step == 4
    events = _hook(recorder.calls, "on_event")
    assert events.index(("stop_requested",)) < events.index(("stopping",))
    assert recorder.threads == {threading.get_ident()}


def test_records_of_other_threads_reach_sinks_on_the_sink_thread_in_written_order(tmp_path):
    class Sink:
        def __init__(self):
            self.seen = []

        def on_metric(self, record):
            self.seen.append((threading.get_ident(), "metric", record["step"]))

        def on_event(self, record):
            self.seen.append((threading.get_ident(), record["event"]))

    log, sink = RunLog(str(tmp_path)), Sink()
    log.add_sinks(sink)
    other = threading.Thread(target=lambda: log.emit(StopRequested()))
    other.start()
    other.join()
    assert sink.seen == []  # it waits for the sink thread
    log.metric(step=0)
    me = threading.get_ident()
    assert sink.seen == [(me, "stop_requested"), (me, "metric", 0)]


def test_a_missing_logger_package_fails_the_run_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises
    recorder = Recorder()
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=4, scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8))
    sim = SimulatedWorkers(dataset_size=8000, capacity=2)
    machine = Machine(Context(cfg, "sim", RunLog(str(tmp_path)), sim))
    sinks = RunSinks(LoggingConfig(tensorboard=str(tmp_path / "tb")), [recorder], machine)
    sinks.start()
    end = machine.run()
    assert sinks.end() is end and type(end.error) is ConfigError
    assert "pip install 'elastic[loggers]'" in str(end.error)
    assert sim.workers == {}  # no worker was started
    assert _hook(recorder.calls, "on_event") == [("failed",), ("state",)]
    assert recorder.calls[-1][1]["state"] == "failed"


def test_the_error_of_another_threads_record_waits_for_a_record_of_the_run_itself(tmp_path):
    """A control request's event is handed out with the run thread's next record, which may
    be a state change (inside the machine's transition): the error waits for a safe record."""
    from elastic.callbacks import CallbackSink
    from elastic.events import StateChanged

    log = RunLog(str(tmp_path))
    sink = CallbackSink([_raises_on("on_event", "stop_requested")], log, committed_step=lambda: 4)
    log.add_sinks(sink)
    other = threading.Thread(target=lambda: log.emit(StopRequested()))
    other.start()
    other.join()
    log.emit(StateChanged(previous="running", state="finishing"))  # hands out both, raises not
    assert sink.error is not None
    with pytest.raises(CallbackError, match=r"Recorder.on_event raised ValueError: boom \(step 4\)"):
        log.metric(step=4)


def test_a_callback_raising_on_a_logger_that_cannot_open_fails_the_run_and_still_finishes(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    recorder = _raises_on("on_event", "logger_failed")
    cfg = FitConfig(run_dir=str(tmp_path / "run"), max_steps=4, scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8))
    sim = SimulatedWorkers(dataset_size=8000, capacity=2)
    machine = Machine(Context(cfg, "sim", RunLog(str(tmp_path / "run")), sim))
    sinks = RunSinks(LoggingConfig(csv=str(tmp_path / "file" / "steps.csv")), [recorder], machine)
    sinks.start()  # the CallbackError does not escape: it fails the machine
    end = machine.run()
    assert sinks.end() is end and type(end.error) is CallbackError
    assert end.error.args[0] == "callback Recorder.on_event raised ValueError: boom"
    assert sim.workers == {}  # no worker was started
    sinks.close()
    assert recorder.calls[-1][0] == "on_finish" and recorder.calls[-1][1]["state"] == "failed"


def test_close_closes_the_loggers_even_when_the_records_left_cannot_be_delivered(tmp_path):
    class Logger:
        name = "fake"
        closed: list[str] = []

        def close(self, state):
            self.closed.append(state)

    cfg = FitConfig(run_dir=str(tmp_path), max_steps=4, scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8))
    machine = Machine(Context(cfg, "sim", RunLog(str(tmp_path)),
                              SimulatedWorkers(dataset_size=8000, capacity=2)))
    sinks = RunSinks(LoggingConfig(), [Recorder()], machine)
    sinks.start()
    machine.run()
    sinks.end()
    fake = Logger()
    sinks.loggers.add([fake])

    def broken():
        raise ValueError("a sink broke")

    sinks.log.deliver = broken
    sinks.close()  # never raises
    assert fake.closed == ["finished"]
    assert sinks.log._sinks == []


def test_a_final_checkpoint_whose_on_checkpoint_hook_raised_is_not_a_failed_checkpoint(tmp_path):
    """`save_before_failing`: the hook's CallbackError (on this write's event or an earlier
    one's) is not a CheckpointFailed event; the same member writes again, which saves the step
    if it was not saved yet, and no other member is asked."""
    from types import SimpleNamespace

    from elastic.control.group import save_before_failing

    writes = []

    def maybe_write(worker_id, step, world, final):
        writes.append(worker_id)
        if len(writes) > 1:  # hooks are off after the first error: the write goes through
            return
        raise CallbackError("callback Recorder.on_checkpoint raised ValueError: boom", rank=-1,
                            step=step, traceback="Traceback ...")

    log = RunLog(str(tmp_path))
    ctx = SimpleNamespace(checkpoints=SimpleNamespace(enabled=True, maybe_write=maybe_write),
                          members=[SimpleNamespace(worker_id=3), SimpleNamespace(worker_id=4)],
                          step=7, log=log)
    save_before_failing(ctx)
    assert writes == [3, 3]  # written again on the same member in case it was not yet
    assert [e["event"] for e in log.events] == []


def test_a_hook_that_raises_stop_run_stops_the_run_at_the_next_boundary(tmp_path):
    # Before, the only way was `elastic.stop` from another thread; an exception failed the run.
    from elastic import StopRun

    class StopAtFive(Callback):
        def on_step(self, record):
            if record["step"] == 5:
                raise StopRun("enough")

    recorder = Recorder()
    end, ctx = _run(tmp_path, [StopAtFive(), recorder], steps=100)
    # Step 5's record comes after its chunk (4-7); the one handed out ahead ends after its
    # first step.
    assert isinstance(end, Finished) and ctx.stopped_early and ctx.step == 9
    [stop] = [e for e in ctx.log.events if e["event"] == "stop_requested"]
    assert stop["reason"] == "StopAtFive.on_step: enough"
    assert _hook(recorder.calls, "on_finish")[0][0]["state"] == "stopped"


def test_early_stopping_ends_a_run_whose_monitored_metric_stopped_improving(tmp_path):
    from elastic import EarlyStopping
    from elastic.config import EvaluationConfig

    scores = {4: 0.5, 8: 0.4, 12: 0.45, 16: 0.38, 20: 0.39, 24: 0.385, 28: 0.3}
    sim = SimulatedWorkers(dataset_size=8000, capacity=2,
                           metrics=lambda step: {"loss": scores.get(step, 0.0)})
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=100, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=2),
                    batch=BatchConfig(global_batch_size=8, autotune=False),
                    evaluation=EvaluationConfig(every_steps=4, at_end=False))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim, has_eval_step=True)
    machine = Machine(ctx)
    recorder = Recorder()
    sinks = RunSinks(LoggingConfig(), [EarlyStopping("loss", patience=2), recorder], machine)
    sinks.start()
    machine.run()
    end = sinks.end()
    sinks.close()
    # 0.38 at step 16 is the best; 20 and 24 do not improve on it: stopped after step 24.
    assert isinstance(end, Finished) and ctx.stopped_early and ctx.step == 24
    assert [s for s, _ in _hook(recorder.calls, "on_evaluate")] == [4, 8, 12, 16, 20, 24]
    [stop] = [e for e in ctx.log.events if e["event"] == "stop_requested"]
    assert stop["reason"] == ("EarlyStopping.on_evaluate: loss has not improved for 2 "
                              "evaluations (best 0.38 at step 16)")


def test_early_stopping_counts_patience_over_the_evaluations_of_the_run_that_holds_the_weights():
    from elastic import EarlyStopping, StopRun

    stopper = EarlyStopping("acc", patience=2, mode="max", min_delta=0.01)
    stopper.on_evaluate(10, {"acc": 0.5})
    stopper.on_evaluate(20, {"acc": 0.505})  # within min_delta: no improvement (1)
    # Restored from the checkpoint of step 10: step 20 is evaluated again, not counted twice.
    stopper.on_evaluate(20, {"acc": 0.505})
    stopper.on_evaluate(30, {"acc": 0.6})  # improves: the count starts over
    stopper.on_evaluate(40, {"acc": float("nan")})  # NaN never improves (1)
    with pytest.raises(StopRun, match=r"acc has not improved for 2 evaluations \(best 0\.6 at "
                                      r"step 30\)"):
        stopper.on_evaluate(50, {"acc": 0.59})
    with pytest.raises(KeyError, match="EarlyStopping monitors 'acc', but the evaluation "
                                       "returned loss"):
        EarlyStopping("acc").on_evaluate(1, {"loss": 1.0})
    for bad in ({"mode": "best"}, {"patience": 0}, {"patience": 1.5}, {"min_delta": -1.0}):
        with pytest.raises(ValueError, match=f"EarlyStopping {next(iter(bad))}"):
            EarlyStopping("acc", **bad)


def test_a_stop_run_raised_as_the_run_ends_anyway_requests_nothing(tmp_path):
    from elastic import StopRun

    class StopLate(Callback):
        def on_step(self, record):
            if record["step"] == 8:  # in the last chunk (8-9), written once 9 committed
                raise StopRun("too late")

        def on_finish(self, summary):
            raise StopRun("after the end")

    end, ctx = _run(tmp_path, [StopLate()], steps=10)
    assert isinstance(end, Finished) and not ctx.stopped_early and ctx.step == 10
    assert not [e for e in ctx.log.events if e["event"] == "stop_requested"]
