"""Loggers: a run's committed steps and evaluations in a CSV file, TensorBoard or MLflow.

`LoggingConfig` names them; the controller builds them (`open_loggers`) and feeds them from
the run's log (`LoggerSink`). Each committed step's metrics line is logged at its `step` (the
step of metrics.jsonl): `loss`, `lr`, `samples_per_s`, `world_size`, `global_batch_size`,
`grad_norm` and `scale` when present, and each user metric as `train/<name>`. An evaluation is
logged as `eval/<name>` at its `step` (the committed steps it saw).

Resumed and restored runs. A run resumed from the checkpoint of step c (a new `fit` on the
same checkpoint path, a restarted detached controller, or a restore from a checkpoint during a
run) logs steps c, c+1, ... again. When the first step a logger gets, or a step at or below
the last one it logged, is s, whatever was logged before at training steps >= s and at
evaluations after s is dropped (the evaluation at s saw the checkpoint's state and is not
redone); a first evaluation at c drops both from c on. So every step is in the log once, with
the value of the newest run:

- CSV rewrites its file without those rows (of this run: each row carries the run's name,
  so runs may share a file);
- TensorBoard opens its writers with `purge_step` (runs `train` and `eval` under the log
  directory, so that each has its own purge point): give each run its own log directory, as
  another run's points there would be hidden by the purge;
- MLflow cannot delete a value: it continues the MLflow run tagged with the run's name (or
  `MLflowConfig.run_name`), reads that run's metric history, and never logs a step twice, so
  a replayed step keeps the value logged first. The replay recomputes the same step from the
  same state, so the two agree up to floating-point summation order (bitwise with
  `batch.exact`). A run that starts at step 0 continues nothing: it gets an MLflow run of its
  own, even under a name an earlier run used.

Threads. Each logger writes on its own thread, fed through a queue of at most
`LoggingConfig.queue_points` points, so a destination that answers slowly or not at all (an
MLflow server that is down retries each request for minutes) never holds up training. Points
that find the queue full are dropped (a `logger_behind` event when that starts; a
`logger_dropped` event with the count as the run ends); metrics.jsonl has them all. A truncation
is never dropped and removes the waiting points it replaces. The run's end waits up to
`LoggingConfig.flush_timeout` for each logger to write what it has waiting.

Failures. A logger that raises is closed and is off for the rest of the run, which goes on:
the run writes a `logger_failed` event (at the next point, on the run's thread) and the
controller's log a warning with the traceback. A logger whose package is missing fails the run
before it starts (ConfigError).

No Ray here.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from elastic.config import LoggingConfig, MLflowConfig
from elastic.errors import ConfigError
from elastic.events import Evaluate, LoggerBehind, LoggerDropped, LoggerFailed, parse
from elastic.private import write_private

if TYPE_CHECKING:
    from elastic.runlog import RunLog

logger = logging.getLogger(__name__)

__all__ = ["CSVLogger", "Logger", "LoggerSink", "MLflowLogger", "TensorBoardLogger", "open_loggers"]

Series = Literal["train", "eval"]

TRAIN_FIELDS = ("loss", "lr", "samples_per_s", "world_size", "global_batch_size", "grad_norm", "scale")
"""Fields of a metrics line that are logged under their own name."""

MLFLOW_RECORD = "mlflow_run.json"
"""The file in the run dir naming the MLflow run the run logs to (a restarted controller's
logger goes on with it)."""

RUN_TAG = "elastic.run"
"""The MLflow tag holding the run's name, by which a resumed run finds its MLflow run."""

_INSTALL = "pip install 'elastic[loggers]'"


class Logger:
    """One destination of the run's points.

    The sink calls `truncate` before the first point and whenever a step comes again, then
    `log` for each point, and `close` at the end.
    """

    name: ClassVar[str]

    def truncate(self, train_from: int, eval_from: int) -> None:
        """Drops what was logged at training steps >= `train_from` and evaluations at steps
        >= `eval_from` (or, where nothing can be dropped, logs none of those steps again)."""
        raise NotImplementedError

    def log(self, series: Series, step: int, values: dict[str, float], walltime: float,
            epoch: int | None) -> None:
        """Logs `values` (name -> number) of `series` at `step`."""
        raise NotImplementedError

    def close(self, state: str) -> None:
        """Writes what is buffered and releases the files; `state` is how the run ended
        ('finished', 'stopped' or 'failed')."""
        raise NotImplementedError


def train_values(record: dict[str, Any]) -> dict[str, float]:
    """The values of a metrics line that loggers log (see the module docstring); numbers
    only (None, text and lists are left out)."""
    values = {k: record[k] for k in TRAIN_FIELDS if _is_number(record.get(k))}
    for name, value in (record.get("metrics") or {}).items():
        if _is_number(value):
            values[f"train/{name}"] = value
    return values


def eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """An evaluation's numeric results, named `eval/<name>`."""
    return {f"eval/{k}": v for k, v in metrics.items() if _is_number(v)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- CSV -----------------------------------------------------------------------------------------


class CSVLogger(Logger):
    """One row per committed step and one per evaluation (its `eval/` columns filled), with
    the columns `run` (the run's name), `step`, `epoch`, `time` and the values; a new value
    name rewrites the file with one more column. Several runs may share a file, at once too:
    a run drops only its own rows (and rows without a run, from before the column existed),
    every read, rewrite and row is made under a lock on `.<file name>.lock` beside it, and a
    run whose file another run rewrote takes up the new file and its columns (before, its
    rows went to the replaced file, and were lost).

    Args:
        path: the CSV file (created with its folder; an existing one is continued).
        run_name: the run whose rows these are.
    """

    name = "csv"
    BASE = ["run", "step", "epoch", "time"]

    def __init__(self, path: str, run_name: str = "") -> None:
        self.path = path
        self.run_name = run_name
        folder, base = os.path.split(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        self._lock_path = os.path.join(folder, f".{base}.lock")
        self.columns = list(self.BASE)  # the file's own are taken up at the first row
        self._file: Any = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the file's lock (other runs on the same file wait)."""
        import fcntl

        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _follow(self) -> None:
        """The file as it is now, under the lock: if another run replaced it since this run's
        last row, its columns (with this run's), and the new file opened for appending."""
        if self._file is not None:
            try:
                same = os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return
            self._file.close()
            self._file = None
        header = self._header()
        if header is None:  # no file (yet, or removed): one with this run's columns
            self._rewrite([])
            return
        normal = header if "run" in header else ["run", *header]  # a file from before `run`
        ours = [c for c in self.columns if c not in normal]
        self.columns = normal + ours
        if ours or "run" not in header:
            self._rewrite(self._read())
        else:
            self._file = open(self.path, "a", newline="")  # kept open between rows

    def _header(self) -> list[str] | None:
        try:
            with open(self.path, newline="") as f:
                return list(csv.DictReader(f).fieldnames or self.BASE)
        except FileNotFoundError:
            return None

    def _read(self) -> list[dict[str, str]]:
        try:
            with open(self.path, newline="") as f:
                return list(csv.DictReader(f))
        except FileNotFoundError:
            return []

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Writes `rows` under the current columns, atomically (a temp file of this writer's
        own, then rename), and opens the new file for appending; under the lock."""
        if self._file is not None:
            self._file.close()
            self._file = None
        temp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(temp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temp, self.path)
        self._file = open(self.path, "a", newline="")  # kept open between rows

    def truncate(self, train_from: int, eval_from: int) -> None:
        def keep(row: dict[str, str]) -> bool:
            if row.get("run") not in (None, "", self.run_name):
                return True  # another run's
            is_eval = any(v for k, v in row.items() if k.startswith("eval/"))
            return int(row["step"]) < (eval_from if is_eval else train_from)

        with self._locked():
            self._follow()
            self._rewrite([row for row in self._read() if keep(row)])

    def log(self, series: Series, step: int, values: dict[str, float], walltime: float,
            epoch: int | None) -> None:
        row = {"run": self.run_name, "step": step, "epoch": "" if epoch is None else epoch,
               "time": walltime, **values}
        with self._locked():
            self._follow()
            new = [k for k in row if k not in self.columns]
            if new:
                self.columns += new
                self._rewrite(self._read())
            csv.DictWriter(self._file, self.columns).writerow(row)
            self._file.flush()

    def close(self, state: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- TensorBoard ---------------------------------------------------------------------------------


class TensorBoardLogger(Logger):
    """Scalars in TensorBoard event files: the training series in `<log_dir>/train`, the
    evaluations in `<log_dir>/eval` (two TensorBoard runs, each purged on its own).

    Args:
        log_dir: the log directory (`tensorboard --logdir` it).
    """

    name = "tensorboard"
    FLUSH_SECONDS = 5  # how stale a live TensorBoard may be

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer_class = SummaryWriter
        self._writers: dict[Series, Any] = {}
        self._purge: dict[Series, int | None] = {"train": None, "eval": None}

    def _writer(self, series: Series) -> Any:
        writer = self._writers.get(series)
        if writer is None:
            writer = self._writers[series] = self._writer_class(
                os.path.join(self.log_dir, series), purge_step=self._purge[series],
                flush_secs=self.FLUSH_SECONDS)
        return writer

    def truncate(self, train_from: int, eval_from: int) -> None:
        self._close_writers()
        self._purge = {"train": train_from, "eval": eval_from}
        for series in ("train", "eval"):  # purged now: the run may never log that series
            if os.path.isdir(os.path.join(self.log_dir, series)):
                self._writer(series)

    def log(self, series: Series, step: int, values: dict[str, float], walltime: float,
            epoch: int | None) -> None:
        writer = self._writer(series)
        for tag, value in values.items():
            writer.add_scalar(tag, value, step, walltime=walltime)

    def close(self, state: str) -> None:
        self._close_writers()

    def _close_writers(self) -> None:
        writers, self._writers = self._writers, {}
        for writer in writers.values():
            writer.close()


# --- MLflow --------------------------------------------------------------------------------------


class MLflowLogger(Logger):
    """Metrics of one MLflow run, continued by every run of the same name (see the module
    docstring: a step is never logged twice). Points are sent in batches, at most one request
    a second and at the end; the MLflow run ends FINISHED, KILLED (stopped) or FAILED.

    Args:
        config: tracking URI, experiment and run name.
        run_name: the elastic run's name (the MLflow run's name unless `config.run_name`).
        restarted: opened by a controller Ray restarted: the MLflow run its predecessor
            recorded goes on, even where the run starts over from step 0 (no checkpoint yet).
        record: the file that records the MLflow run's id (in the run dir), or None.
    """

    name = "mlflow"
    SEND_SECONDS = 1.0
    BATCH = 1000  # MLflow's limit of metrics per log_batch request
    STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, config: MLflowConfig, run_name: str, restarted: bool = False,
                 record: str | None = None) -> None:
        if _is_path(config.tracking_uri):
            # MLflow 3 refuses its file store unless told; a directory here is the user's choice.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=config.tracking_uri)
        self.config = config
        self.run_name = config.run_name or run_name
        self.restarted = restarted  # a restarted controller's: the run goes on, from any step
        self.record = record  # the file in the run dir that names the MLflow run (`_connect`)
        self._run_id: str | None = None  # the server is first asked on the logger's thread
        self._logged: dict[str, set[int]] = {}  # key -> steps at or after the truncation point
        self._pending: list[Any] = []
        self._sent = time.monotonic()

    @property
    def run_id(self) -> str:
        """The MLflow run's id: the newest run tagged with this run's name, continued, else a
        new one (asks the tracking server the first time)."""
        return self._connect(continued=True)

    def _connect(self, continued: bool) -> str:
        """The MLflow run: with `continued`, the newest tagged with this run's name if any;
        else (a run from its first step: nothing to continue) a new one. A controller Ray
        restarted goes on with the MLflow run its predecessor recorded in the run dir
        (`record`), if it got as far: else it starts one of its own (not an older run's of
        the same name)."""
        if self._run_id is None:
            client, name, experiment = self.client, self.run_name, self.config.experiment
            found_experiment = client.get_experiment_by_name(experiment)
            experiment_id = (found_experiment.experiment_id if found_experiment is not None
                             else client.create_experiment(experiment))
            if self.restarted and self.record is not None:
                recorded = _recorded_run(self.record)
                found = [client.get_run(recorded)] if recorded else []
            else:
                found = continued and client.search_runs(
                    [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{name}'",
                    order_by=["attributes.start_time DESC"], max_results=1)
            if found:
                run_id = found[0].info.run_id
                client.update_run(run_id, status="RUNNING")
            else:
                run_id = client.create_run(experiment_id, run_name=name,
                                           tags={RUN_TAG: name}).info.run_id
            if self.record is not None:
                write_private(self.record, json.dumps({"run_id": run_id}).encode())
            self._run_id = run_id
        return self._run_id

    def truncate(self, train_from: int, eval_from: int) -> None:
        # A run that starts at its first step continues nothing: an MLflow run of the same
        # name (an earlier run's) would keep its values and drop every one of this run's.
        self._connect(continued=train_from > 0)
        self._send()
        self._logged = {}
        for key in self.client.get_run(self.run_id).data.metrics:
            start = eval_from if key.startswith("eval/") else train_from
            self._logged[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)
                                 if m.step >= start}

    def log(self, series: Series, step: int, values: dict[str, float], walltime: float,
            epoch: int | None) -> None:
        stamp = int(walltime * 1000)
        for key, value in values.items():
            if step not in self._logged.get(key, ()):
                self._pending.append(self._metric(key, value, stamp, step))
        if len(self._pending) >= self.BATCH or time.monotonic() - self._sent >= self.SEND_SECONDS:
            self._send()

    def _send(self) -> None:
        while self._pending:
            self.client.log_batch(self.run_id, metrics=self._pending[:self.BATCH])
            del self._pending[:self.BATCH]
        self._sent = time.monotonic()

    def close(self, state: str) -> None:
        if self._run_id is None and not self._pending:  # never reached the server: no run to end
            return
        self._send()
        self.client.set_terminated(self.run_id, self.STATUS.get(state, "FAILED"))


def _recorded_run(path: str) -> str | None:
    """The MLflow run id `MLflowLogger` recorded in `path`, or None (none, or unreadable)."""
    try:
        with open(path) as f:
            run_id = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def _is_path(uri: str) -> bool:
    """Whether an MLflow tracking URI names a local folder (its file store)."""
    return uri.startswith("file:") or (":" not in uri and uri != "databricks")


# --- building and feeding them -------------------------------------------------------------------


def open_loggers(config: LoggingConfig, run_name: str, log: RunLog,
                 restarted: bool = False) -> list[Logger]:
    """The loggers `config` names (`restarted`: by a controller Ray restarted, which goes on
    with the run's MLflow run even from step 0). One that cannot be opened is reported as
    failed (a `logger_failed` event) and left out.

    Raises:
        ConfigError: a logger's package is not installed.
    """
    csv_path, log_dir, mlflow = config.csv, config.tensorboard, config.mlflow
    makers: list[tuple[str, str | None, Callable[[], Logger]]] = []
    if csv_path is not None:
        makers.append(("csv", None, lambda: CSVLogger(csv_path, run_name)))
    if log_dir is not None:
        makers.append(("tensorboard", "tensorboard", lambda: TensorBoardLogger(log_dir)))
    if mlflow is not None:
        record = os.path.join(log.run_dir, MLFLOW_RECORD)
        makers.append(("mlflow", "mlflow",
                       lambda: MLflowLogger(mlflow, run_name, restarted, record)))
    loggers: list[Logger] = []
    for name, package, make in makers:
        if package is not None:
            _require(package, name)
        try:
            loggers.append(make())
        except Exception as e:
            try:
                report_failure(log, name, e, None)
            except BaseException:  # a callback raised on the report: the run will not start
                for opened in loggers:
                    with contextlib.suppress(Exception):
                        opened.close("failed")
                raise
    return loggers


def _require(package: str, setting: str) -> None:
    try:
        __import__(package)
    except ImportError as e:
        raise ConfigError(f"logging.{setting} needs the {package} package, which is not "
                          f"installed where the controller runs: {_INSTALL}") from e


def report_failure(log: RunLog, name: str, error: BaseException, step: int | None) -> None:
    """Records that logger `name` failed: a warning with the traceback, a `logger_failed`
    event."""
    logger.warning("logger %s failed%s; it is off for the rest of the run", name,
                   "" if step is None else f" at step {step}", exc_info=error)
    lines = str(error).strip().splitlines()
    log.emit(LoggerFailed(logger=name, error=f"{type(error).__name__}: {lines[0] if lines else ''}",
                          step=step))


@dataclass
class _Op:
    """One call waiting for a logger's thread: a point of `series` at `step`, or (`series`
    None) a truncation from training step `step` and evaluation step `eval_from`."""

    call: Callable[[Logger], None]
    series: Series | None
    step: int
    eval_from: int = 0


class _Feed:
    """One logger and the thread that calls it, in order, with what the run thread queues.

    The run thread queues (`put`) and reads what happened (`failure`, `dropped`); the logger
    is only ever called on this thread. After the logger raised, or once it is closed, the
    thread ends and queued calls are discarded.
    """

    def __init__(self, each: Logger, capacity: int) -> None:
        self.logger = each
        self.name = each.name
        self.capacity = capacity
        self._ops: deque[_Op] = deque()
        self._points = 0  # points among `_ops`
        self._wake = threading.Condition()
        self._closing: str | None = None  # how the run ended, once `close` was asked
        self.failure: tuple[BaseException, int | None] | None = None  # (error, step) it raised
        self.reported = False  # its failure was reported (on the run thread)
        self.dropped: list[int] = []  # count, lowest and highest step of the points dropped
        self.behind = False  # dropping points since the queue was last empty
        self._busy: _Op | None = None  # the call the thread is in (None: closing, or idle)
        self._thread = threading.Thread(target=self._work, name=f"elastic-logger-{self.name}",
                                         daemon=True)
        self._thread.start()

    def put(self, op: _Op) -> bool:
        """Queues `op`; False when it is a point that found the queue full (dropped)."""
        with self._wake:
            if self.failure is not None or self._closing is not None:
                return True  # off: nothing more is called
            if op.series is None:  # a truncation replaces the points it drops
                self._truncate_queued(op)
            elif self._points >= self.capacity:
                count, first, last = self.dropped or [0, op.step, op.step]
                self.dropped = [count + 1, min(first, op.step), max(last, op.step)]
                return False
            else:
                self._points += 1
            self._ops.append(op)
            self._wake.notify()
        return True

    def _truncate_queued(self, op: _Op) -> None:
        kept = [each for each in self._ops if each.series is None
                or each.step < (op.step if each.series == "train" else op.eval_from)]
        self._points -= len(self._ops) - len(kept)
        self._ops = deque(kept)

    def close(self, state: str, deadline: float) -> str | None:
        """Asks the thread to write what is queued and close the logger; waits for it until
        `deadline` (time.monotonic()). Returns None once it has ended, else what it had not
        done by then."""
        with self._wake:
            if self._closing is None:
                self._closing = state
                self._wake.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._wake:
            if not self._thread.is_alive():
                return None
            busy = self._busy
            doing = ("closing" if busy is None else "logging the point of step "
                     f"{busy.step}" if busy.series is not None else "truncating")
            return f"still {doing}, {self._points} more points waiting"

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._ops and self._closing is None:
                    self._wake.wait()
                if not self._ops:
                    break
                op = self._busy = self._ops.popleft()
                if op.series is not None:
                    self._points -= 1
                if not self._ops:
                    self.behind = False
            try:
                op.call(self.logger)
            except BaseException as e:  # anything: the run thread reports it, the run goes on
                with self._wake:
                    self.failure = (e, op.step)
                    self._ops.clear()
                    self._points = 0
                with contextlib.suppress(BaseException):
                    self.logger.close("failed")
                return
            with self._wake:
                self._busy = None
        try:
            self.logger.close(self._closing or "failed")
        except BaseException as e:
            self.failure = (e, None)


class LoggerSink:
    """Feeds loggers from the run's log (an `elastic.runlog.Sink`): decides where each
    logger truncates (see the module docstring), hands each call to the logger's own thread
    and reports, on the run's thread, a logger that raised (switched off) or fell behind.

    Args:
        loggers: the loggers (`open_loggers`; more with `add`).
        log: the run's log, for `logger_*` events.
        queue_points: points each logger may have waiting (`LoggingConfig.queue_points`).
        flush_timeout_s: how long `close` waits for each logger (`LoggingConfig.flush_timeout`).
    """

    def __init__(self, loggers: Iterable[Logger], log: RunLog, queue_points: int = 10_000,
                 flush_timeout_s: float = 60.0) -> None:
        self.log = log
        self.queue_points = queue_points
        self.flush_timeout_s = flush_timeout_s
        self.feeds: list[_Feed] = []
        self._started = False
        self._last: dict[Series, int] = {"train": -1, "eval": -1}  # last step logged
        self.add(loggers)

    @property
    def loggers(self) -> list[Logger]:
        """The loggers still on."""
        return [feed.logger for feed in self.feeds]

    def add(self, loggers: Iterable[Logger]) -> None:
        """Feeds `loggers` too, each from its own thread."""
        self.feeds += [_Feed(each, self.queue_points) for each in loggers]

    def on_metric(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if not self._started or step <= self._last["train"]:
            self._truncate(step, step + 1)
        self._point("train", step, train_values(record), record)

    def on_event(self, record: dict[str, Any]) -> None:
        event = parse(record)
        if not isinstance(event, Evaluate):
            return
        if not self._started or event.step <= self._last["eval"]:
            self._truncate(event.step, event.step)
        self._point("eval", event.step, eval_values(event.metrics), record)

    def close(self, state: str) -> None:
        """Has every logger write what it has waiting and close (`state`: how the run
        ended), waiting up to `flush_timeout_s` for each; reports the failures and the points
        dropped."""
        feeds, self.feeds = self.feeds, []
        for feed in feeds:
            left = feed.close(state, time.monotonic() + self.flush_timeout_s)
            if left is not None:
                feed.failure = (TimeoutError(
                    f"not done after logging.flush_timeout ({self.flush_timeout_s:g} s): {left}; "
                    "what it had not sent is not logged"), None)
            self._report(feed)
            if feed.dropped:
                count, first, last = feed.dropped
                self.log.emit(LoggerDropped(logger=feed.name, points=count, first_step=first,
                                            last_step=last))

    def _truncate(self, train_from: int, eval_from: int) -> None:
        self._started = True
        self._last = {"train": min(self._last["train"], train_from - 1),
                      "eval": min(self._last["eval"], eval_from - 1)}
        self._each(_Op(lambda each: each.truncate(train_from, eval_from), None, train_from,
                       eval_from))

    def _point(self, series: Series, step: int, values: dict[str, float],
               record: dict[str, Any]) -> None:
        self._last[series] = step
        walltime = record.get("time") or time.time()
        epoch = record.get("epoch")
        self._each(_Op(lambda each: each.log(series, step, values, walltime, epoch), series, step))

    def _each(self, op: _Op) -> None:
        for feed in list(self.feeds):
            if self._report(feed):
                self.feeds.remove(feed)
                continue
            if not feed.put(op) and not feed.behind:
                feed.behind = True
                self.log.emit(LoggerBehind(logger=feed.name, step=op.step,
                                           queued=feed.capacity))

    def _report(self, feed: _Feed) -> bool:
        """Reports `feed`'s failure once (True if it failed)."""
        failure = feed.failure
        if failure is None:
            return False
        if not feed.reported:
            feed.reported = True
            report_failure(self.log, feed.name, failure[0], failure[1])
        return True
