"""Loggers, read back with the real libraries: CSV with `csv`, TensorBoard's event files with
its EventAccumulator, MLflow's file store with MlflowClient. A resumed run, or one restored
from a checkpoint, continues the same curves: every step once, with the newest value (MLflow,
which cannot delete, keeps the first)."""

from __future__ import annotations

import csv
import os
import sys
import threading

import pytest

from elastic.config import LoggingConfig, MLflowConfig
from elastic.errors import ConfigError
from elastic.events import Evaluate
from elastic.loggers import RUN_TAG, Logger, LoggerSink, MLflowLogger, open_loggers, train_values
from elastic.runlog import RunLog

KINDS = ["csv", "tensorboard", "mlflow"]


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    # MLflow 3 refuses its file store unless told (the logger opts in itself; this reader too).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _config(tmp_path, kind: str) -> LoggingConfig:
    return {"csv": LoggingConfig(csv=str(tmp_path / "out" / "steps.csv")),
            "tensorboard": LoggingConfig(tensorboard=str(tmp_path / "tb")),
            "mlflow": LoggingConfig(mlflow=MLflowConfig(tracking_uri=str(tmp_path / "mlruns")))}[kind]


def _line(step: int, loss: float) -> dict:
    """A metrics line as `Batching` writes it (the fields loggers read, and some they do not)."""
    return {"step": step, "epoch": step // 5, "loss": loss, "lr": 0.5, "world_size": 2,
            "global_batch_size": 16, "samples_per_s": 100.0 + step, "time": 1000.0 + step,
            "shares": [8, 8], "metrics": {"acc": loss / 1000}}


def _run(tmp_path, config: LoggingConfig, steps, evals: dict[int, float], offset: float,
         run: str) -> list[dict]:
    """Feeds one run's steps (loss = step + offset) and evaluations (after `step` steps) to
    fresh loggers, as the controller does; returns the run's events."""
    log = RunLog(str(tmp_path / run))
    sink = LoggerSink(open_loggers(config, "resumed-run", log), log)
    log.add_sinks(sink)
    for step in steps:
        log.metric(**_line(step, step + offset))
        if step + 1 in evals:
            log.emit(Evaluate(step=step + 1, epoch=0, metrics={"acc": evals[step + 1]}))
    sink.close("finished")
    return log.events


# --- reading the output back ---------------------------------------------------------------------


def _read(tmp_path, kind: str) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] as the library reads them, in step order."""
    return {"csv": _read_csv, "tensorboard": _read_tensorboard, "mlflow": _read_mlflow}[kind](tmp_path)


def _read_csv(tmp_path) -> dict[str, list[tuple[int, float]]]:
    points: dict[str, list[tuple[int, float]]] = {}
    with open(tmp_path / "out" / "steps.csv", newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("run", "step", "epoch", "time") and value != "":
                    points.setdefault(name, []).append((int(row["step"]), float(value)))
    return {k: sorted(v) for k, v in points.items()}


def _read_tensorboard(tmp_path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    points = {}
    for series in ("train", "eval"):
        if not (tmp_path / "tb" / series).is_dir():  # a run without evaluations has no `eval`
            continue
        accumulator = EventAccumulator(str(tmp_path / "tb" / series), size_guidance={SCALARS: 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            points[tag] = sorted((e.step, e.value) for e in accumulator.Scalars(tag))
    return points


def _mlflow_run(tmp_path, name: str = "resumed-run"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(str(tmp_path / "mlruns"))
    experiment = client.get_experiment_by_name("elastic")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].data.tags[RUN_TAG] == name
    return client, runs[0]


def _read_mlflow(tmp_path) -> dict[str, list[tuple[int, float]]]:
    client, run = _mlflow_run(tmp_path)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


def _values(points, tag) -> list[float]:
    return [v for _, v in points[tag]]


def _steps(points, tag) -> list[int]:
    return [s for s, _ in points[tag]]


# --- resumes and restores ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_run_continues_the_curves_with_every_step_once(tmp_path, kind):
    config = _config(tmp_path, kind)
    _run(tmp_path, config, range(10), {5: 0.5, 10: 0.6}, offset=0.0, run="a")
    # Resumed from the checkpoint of step 6: steps 6..9 and the evaluation at 10 come again.
    _run(tmp_path, config, range(6, 13), {10: 0.7, 13: 0.8}, offset=100.0, run="b")
    points = _read(tmp_path, kind)
    replayed_from = 10 if kind == "mlflow" else 6  # MLflow keeps a step's first value
    expected = [s + (100.0 if s >= replayed_from else 0.0) for s in range(13)]
    for tag in ("loss", "lr", "world_size", "global_batch_size", "samples_per_s", "train/acc"):
        assert _steps(points, tag) == list(range(13)), tag
    assert _values(points, "loss") == pytest.approx(expected)
    assert _values(points, "train/acc") == pytest.approx([v / 1000 for v in expected])
    assert _values(points, "samples_per_s") == pytest.approx([100.0 + s for s in range(13)])
    assert _steps(points, "eval/acc") == [5, 10, 13]
    assert _values(points, "eval/acc") == pytest.approx([0.5, 0.6 if kind == "mlflow" else 0.7, 0.8])


@pytest.mark.parametrize("kind", KINDS)
def test_the_evaluation_at_the_resume_step_is_kept(tmp_path, kind):
    config = _config(tmp_path, kind)
    # The run evaluated after 6 steps, wrote the checkpoint of step 6, logged two more steps.
    _run(tmp_path, config, range(8), {6: 0.25}, offset=0.0, run="a")
    _run(tmp_path, config, range(6, 10), {}, offset=100.0, run="b")
    points = _read(tmp_path, kind)
    assert points["eval/acc"] == [(6, pytest.approx(0.25))]
    assert _steps(points, "loss") == list(range(10))


@pytest.mark.parametrize("kind", KINDS)
def test_a_restore_within_a_run_drops_the_steps_after_the_checkpoint(tmp_path, kind):
    config = _config(tmp_path, kind)
    log = RunLog(str(tmp_path / "run"))
    sink = LoggerSink(open_loggers(config, "resumed-run", log), log)
    log.add_sinks(sink)
    # Every worker lost after step 9: restored from the checkpoint of step 5, which comes again.
    points = [(s, float(s)) for s in range(10)] + [(s, s + 1100.0) for s in range(5, 13)]
    for step, loss in points:
        log.metric(**_line(step, loss))
    sink.close("finished")
    points = _read(tmp_path, kind)
    assert _steps(points, "loss") == list(range(13))
    kept = 10 if kind == "mlflow" else 5  # below it the first value, from it the replayed one
    assert _values(points, "loss")[kept:] == pytest.approx([s + 1100.0 for s in range(kept, 13)])
    assert not [e for e in log.events if e["event"] == "logger_failed"]


def test_mlflow_continues_the_run_named_in_its_config_and_ends_it_with_the_runs_state(tmp_path):
    mlflow = MLflowConfig(tracking_uri=str(tmp_path / "mlruns"), run_name="shared")
    first = MLflowLogger(mlflow, "elastic-run-1")
    first.truncate(0, 0)
    first.log("train", 0, {"loss": 1.0}, 1000.0, 0)
    first.close("failed")
    second = MLflowLogger(mlflow, "elastic-run-2")
    assert second.run_id == first.run_id
    second.close("stopped")
    _, run = _mlflow_run(tmp_path, "shared")
    assert (run.info.run_name, run.info.status) == ("shared", "KILLED")


def test_another_run_on_the_same_csv_file_keeps_the_first_runs_rows(tmp_path):
    # Before, the second run's first step truncated the file: the first run's rows were gone.
    config = _config(tmp_path, "csv")
    for name, offset in (("first", 0.0), ("second", 100.0)):
        log = RunLog(str(tmp_path / name))
        sink = LoggerSink(open_loggers(config, name, log), log)
        log.add_sinks(sink)
        for step in range(3):
            log.metric(**_line(step, step + offset))
        sink.close("finished")
    with open(tmp_path / "out" / "steps.csv", newline="") as f:
        rows = [(r["run"], int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
    assert rows == [("first", 0, 0.0), ("first", 1, 1.0), ("first", 2, 2.0),
                    ("second", 0, 100.0), ("second", 1, 101.0), ("second", 2, 102.0)]


def test_a_new_run_under_an_earlier_runs_name_gets_its_own_mlflow_run(tmp_path):
    # Before, it continued the earlier MLflow run, which kept its values: every point of the
    # new run was dropped as "logged already".
    config = _config(tmp_path, "mlflow")
    _run(tmp_path, config, range(4), {}, offset=0.0, run="a")
    _run(tmp_path, config, range(4), {}, offset=100.0, run="b")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(str(tmp_path / "mlruns"))
    runs = client.search_runs([client.get_experiment_by_name("elastic").experiment_id],
                              order_by=["attributes.start_time ASC"])
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "loss")] for r in runs]
    assert [sorted(values) for values in losses] == [[0.0, 1.0, 2.0, 3.0],
                                                     [100.0, 101.0, 102.0, 103.0]]
    # A controller Ray restarted before the first checkpoint starts over at step 0 within the
    # same run (run dir): it goes on with the MLflow run recorded there.
    for run_dir in ("b", "c"):  # "c": restarted before its logger ever reached the server
        log = RunLog(str(tmp_path / run_dir))
        sink = LoggerSink(open_loggers(config, "resumed-run", log, restarted=True), log)
        log.add_sinks(sink)
        log.metric(**_line(0, 200.0))
        sink.close("finished")
    runs = client.search_runs([runs[0].info.experiment_id], order_by=["attributes.start_time ASC"])
    losses = [[m.value for m in client.get_metric_history(r.info.run_id, "loss")] for r in runs]
    # "b" kept its MLflow run (whose step 0 stays); "c" got one of its own, not the older one's
    assert [sorted(values) for values in losses] == [[0.0, 1.0, 2.0, 3.0],
                                                     [100.0, 101.0, 102.0, 103.0], [200.0]]


# --- what is logged ------------------------------------------------------------------------------


def test_a_metrics_line_gives_its_numbers_and_user_metrics_under_train():
    record = {**_line(3, 0.25), "grad_norm": 1.5, "scale": None,
              "metrics": {"acc": 0.75, "tokens": 12, "label": "x", "done": True}}
    assert train_values(record) == {
        "loss": 0.25, "lr": 0.5, "samples_per_s": 103.0, "world_size": 2,
        "global_batch_size": 16, "grad_norm": 1.5, "train/acc": 0.75, "train/tokens": 12}


# --- failures ------------------------------------------------------------------------------------


class BrokenLogger(Logger):
    """Raises on its fourth point, as a full disk or a lost tracking server would."""

    name = "broken"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed: list[str] = []

    def truncate(self, train_from: int, eval_from: int) -> None:
        pass

    def log(self, series, step, values, walltime, epoch) -> None:
        self.steps.append(step)
        if step == 3:
            raise OSError("disk full")

    def close(self, state: str) -> None:
        self.closed.append(state)


def test_a_failing_logger_is_switched_off_with_an_event_and_the_others_go_on(tmp_path):
    log = RunLog(str(tmp_path / "run"))
    broken = BrokenLogger()
    sink = LoggerSink([broken, *open_loggers(_config(tmp_path, "csv"), "r", log)], log)
    log.add_sinks(sink)
    for step in range(6):
        log.metric(**_line(step, float(step)))
    sink.close("finished")
    failures = [e for e in log.events if e["event"] == "logger_failed"]
    assert [(e["logger"], e["step"], e["error"]) for e in failures] == [("broken", 3, "OSError: disk full")]
    assert broken.steps == [0, 1, 2, 3] and broken.closed == ["failed"]
    assert _steps(_read_csv(tmp_path), "loss") == list(range(6))


def test_a_logger_that_cannot_open_is_reported_and_left_out(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    log = RunLog(str(tmp_path / "run"))
    loggers = open_loggers(LoggingConfig(csv=str(tmp_path / "file" / "steps.csv"),
                                         tensorboard=str(tmp_path / "tb")), "r", log)
    assert [each.name for each in loggers] == ["tensorboard"]
    [failure] = [e for e in log.events if e["event"] == "logger_failed"]
    assert (failure["logger"], "step" in failure) == ("csv", False)
    assert failure["error"].startswith(("FileExistsError", "NotADirectoryError"))


def test_a_missing_logger_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    config = LoggingConfig(mlflow=MLflowConfig(tracking_uri=str(tmp_path / "mlruns")))
    with pytest.raises(ConfigError, match=r"logging.mlflow needs the mlflow package.*"
                                          r"pip install 'elastic\[loggers\]'"):
        open_loggers(config, "r", RunLog(str(tmp_path / "run")))


# --- loggers that fall behind ----------------------------------------------------------------------


class StuckLogger(Logger):
    """A destination that does not answer until `answer` is set (a tracking server that is
    down: each request waits); records the calls it got through."""

    name = "stuck"

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.asked = threading.Event()  # a call is waiting for the answer
        self.calls: list[tuple] = []

    def truncate(self, train_from: int, eval_from: int) -> None:
        self.asked.set()
        self.answer.wait()
        self.calls.append(("truncate", train_from, eval_from))

    def log(self, series, step, values, walltime, epoch) -> None:
        self.asked.set()
        self.answer.wait()
        self.calls.append((series, step, values["loss"] if series == "train" else None))

    def close(self, state: str) -> None:
        self.calls.append(("close", state))


def _stuck(tmp_path, **sink) -> tuple[RunLog, StuckLogger, LoggerSink]:
    """A run's log feeding a `StuckLogger` through a `LoggerSink` made with `sink`."""
    log, stuck = RunLog(str(tmp_path / "run")), StuckLogger()
    feed = LoggerSink([stuck], log, **sink)
    log.add_sinks(feed)
    return log, stuck, feed


def test_a_logger_that_does_not_answer_never_holds_up_the_run_and_drops_what_does_not_fit(tmp_path):
    # Before, each point was logged on the run's thread: a down MLflow server held up every
    # chunk boundary for minutes per request.
    log, stuck, sink = _stuck(tmp_path, queue_points=5)
    try:
        for step in range(10):  # returns although the logger answers nothing
            log.metric(**_line(step, float(step)))
        # Every worker lost: restored to step 2; the points waiting from it on are replaced.
        for step in range(2, 5):
            log.metric(**_line(step, step + 100.0))
        behind = [e for e in log.events if e["event"] == "logger_behind"]
        assert [(e["logger"], e["step"], e["queued"]) for e in behind] == [("stuck", 5, 5)]
    finally:
        stuck.answer.set()
    sink.close("finished")
    assert stuck.calls == [("truncate", 0, 1), ("train", 0, 0.0), ("train", 1, 1.0),
                           ("truncate", 2, 3), ("train", 2, 102.0), ("train", 3, 103.0),
                           ("train", 4, 104.0), ("close", "finished")]
    [dropped] = [e for e in log.events if e["event"] == "logger_dropped"]
    assert (dropped["points"], dropped["first_step"], dropped["last_step"]) == (5, 5, 9)
    assert not [e for e in log.events if e["event"] == "logger_failed"]


def test_the_end_waits_for_a_stuck_logger_only_up_to_the_flush_timeout(tmp_path):
    log, stuck, sink = _stuck(tmp_path, flush_timeout_s=0.05)
    try:
        for step in range(3):
            log.metric(**_line(step, float(step)))
        assert stuck.asked.wait(30)
        sink.close("finished")  # returns although the logger never answers
        [failure] = [e for e in log.events if e["event"] == "logger_failed"]
        assert failure["error"] == ("TimeoutError: not done after logging.flush_timeout "
                                    "(0.05 s): still truncating, 3 more points waiting; what it "
                                    "had not sent is not logged")
    finally:
        stuck.answer.set()


def test_a_logger_stuck_in_its_last_point_at_the_end_is_reported(tmp_path):
    # Before, nothing was waiting in its queue, so the end took it for done and said nothing.
    log, stuck, sink = _stuck(tmp_path, flush_timeout_s=0.05)
    stuck.truncate = lambda train_from, eval_from: None  # answers, then the point hangs
    try:
        log.metric(**_line(0, 0.0))
        assert stuck.asked.wait(30)
        sink.close("finished")
        [failure] = [e for e in log.events if e["event"] == "logger_failed"]
        assert "still logging the point of step 0, 0 more points waiting" in failure["error"]
    finally:
        stuck.answer.set()


def test_an_mlflow_server_that_does_not_answer_holds_up_neither_the_start_nor_the_steps(
        tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    answer = threading.Event()
    asked: list[str] = []

    def waits(self, *args, **kwargs):
        asked.append("get_experiment_by_name")
        answer.wait()
        raise ConnectionError("connection refused")

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", waits)
    log = RunLog(str(tmp_path / "run"))
    config = LoggingConfig(mlflow=MLflowConfig(tracking_uri="http://127.0.0.1:9"))
    sink = LoggerSink(open_loggers(config, "r", log), log)
    log.add_sinks(sink)
    try:
        for step in range(3):
            log.metric(**_line(step, float(step)))
    finally:
        answer.set()
    sink.close("finished")
    assert asked == ["get_experiment_by_name"]
    [failure] = [e for e in log.events if e["event"] == "logger_failed"]
    assert (failure["logger"], failure["step"], failure["error"]) == (
        "mlflow", 0, "ConnectionError: connection refused")


def test_two_runs_logging_to_one_csv_file_at_once_keep_every_row_under_its_column(tmp_path):
    # Each run keeps the file open between rows; another run's new column rewrites it (a
    # new file under the name). Before, the first run's later rows went to the replaced
    # file and were lost, and rows were written under a header they did not match.
    from elastic.loggers import CSVLogger

    path = str(tmp_path / "shared.csv")
    a, b = CSVLogger(path, "a"), CSVLogger(path, "b")
    a.truncate(0, 0)
    b.truncate(0, 0)
    a.log("train", 0, {"loss": 1.0}, 10.0, 0)
    b.log("train", 0, {"loss": 2.0}, 11.0, 0)
    b.log("train", 1, {"loss": 2.5, "train/acc": 0.5}, 12.0, 0)  # b rewrites: a new column
    a.log("train", 1, {"loss": 1.5}, 13.0, 0)
    a.log("eval", 1, {"eval/score": 0.9}, 14.0, 0)  # a rewrites too
    b.log("train", 2, {"loss": 3.0, "train/acc": 0.75}, 15.0, 0)
    a.close("finished")
    b.close("finished")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["step"], r["loss"], r["train/acc"], r["eval/score"]) for r in rows] == [
        ("a", "0", "1.0", "", ""), ("b", "0", "2.0", "", ""), ("b", "1", "2.5", "0.5", ""),
        ("a", "1", "1.5", "", ""), ("a", "1", "", "", "0.9"), ("b", "2", "3.0", "0.75", "")]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_csv_file_from_before_the_run_column_gets_it_once(tmp_path):
    from elastic.loggers import CSVLogger

    path = tmp_path / "old.csv"
    path.write_text("step,epoch,time,loss\n0,0,1.0,0.5\n")
    logger = CSVLogger(str(path), "r1")
    logger.truncate(5, 5)
    logger.log("train", 5, {"loss": 0.4}, 2.0, 0)
    logger.close("finished")
    with open(path, newline="") as f:
        assert f.readline().strip() == "run,step,epoch,time,loss"
        f.seek(0)
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["step"], r["loss"]) for r in rows] == [("", "0", "0.5"), ("r1", "5", "0.4")]
