"""Loggers and callbacks on real runs: a run with all three loggers and a callback goes through
a worker kill and fails in its callback after its last checkpoint; a second run resumes from
that checkpoint with more steps. Every step is then in each logger once, and each run's
callback saw exactly its committed steps."""

from __future__ import annotations

import csv
import dataclasses
import json
import os

import pytest

import elastic
from elastic import BatchConfig, Callback, ChaosEvent, CheckpointConfig, FitConfig, ScalingConfig
from elastic.config import LoggingConfig, MLflowConfig
from elastic.errors import CallbackError
from elastic.events import Evaluate, Resumed, WorkerFailure, read_events
from elastic.loggers import RUN_TAG
from tests.events import of_kind
from tests.jobs import regression_job

pytestmark = pytest.mark.integration


class HookFile(Callback):
    """Appends every hook call to a JSON-lines file (callbacks run in the controller process);
    raises in `on_step` of step `fail_at`."""

    def __init__(self, path: str, fail_at: int | None = None) -> None:
        self.path = path
        self.fail_at = fail_at

    def _write(self, **call) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(call) + "\n")

    def on_step(self, record):
        self._write(hook="on_step", step=record["step"])
        if record["step"] == self.fail_at:
            raise RuntimeError("the callback gives up")

    def on_evaluate(self, step, metrics):
        self._write(hook="on_evaluate", step=step)

    def on_finish(self, summary):
        self._write(hook="on_finish", state=summary["state"], step=summary["step"])


def _calls(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def _steps(calls) -> list[int]:
    return [c["step"] for c in calls if c["hook"] == "on_step"]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_three_loggers_and_a_callback_follow_a_killed_failed_and_resumed_run(ray_cluster, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reader here
    logging = LoggingConfig(csv=str(tmp_path / "steps.csv"), tensorboard=str(tmp_path / "tb"),
                            mlflow=MLflowConfig(tracking_uri=str(tmp_path / "mlruns")))
    base = {"scaling": ScalingConfig(num_workers=2, min_workers=1, max_workers=2),
            "batch": BatchConfig(global_batch_size=16), "name": "logged-run", "logging": logging,
            "checkpoint": CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=3,
                                           async_write=False)}

    # The first run: worker 1 killed at step 2; the callback raises at step 7, after the
    # checkpoint of step 6, so that steps 6 and 7 come again in the second run.
    job = dataclasses.replace(regression_job(), callbacks=(HookFile(str(tmp_path / "a.jsonl"), 7),))
    with pytest.raises(CallbackError, match=r"callback HookFile.on_step raised RuntimeError: the "
                                            r"callback gives up \(step 7\)"):
        elastic.fit(job, FitConfig(**base, run_dir=str(tmp_path / "a"), max_steps=9,
                                   chaos=(ChaosEvent(step=2, rank=1, action="kill"),)))
    first = _metrics(tmp_path / "a")
    assert [m["step"] for m in first] == list(range(8))
    assert [e.planned for e in of_kind(read_events(tmp_path / "a"), WorkerFailure)] == [True]
    calls = _calls(tmp_path / "a.jsonl")
    assert _steps(calls) == list(range(8))
    assert calls[-1] == {"hook": "on_finish", "state": "failed", "step": 6}  # its chunk's start

    job = dataclasses.replace(regression_job(), callbacks=(HookFile(str(tmp_path / "b.jsonl")),))
    second = elastic.fit(job, FitConfig(**base, run_dir=str(tmp_path / "b"), max_steps=12))
    assert [e.step for e in of_kind(second.events, Resumed)] == [6]
    assert [m["step"] for m in second.metrics] == list(range(6, 12))
    calls = _calls(tmp_path / "b.jsonl")
    assert _steps(calls) == list(range(6, 12))
    assert calls[-1] == {"hook": "on_finish", "state": "finished", "step": 12}

    newest = {m["step"]: m["loss"] for m in first + second.metrics}  # the second run's from 6
    kept = {**newest, **{m["step"]: m["loss"] for m in first}}  # MLflow keeps the first value
    evaluations = sorted({e.step for e in of_kind(read_events(tmp_path / "a"), Evaluate)
                          if e.step <= 6} | {e.step for e in of_kind(second.events, Evaluate)})
    assert evaluations[0] == 6  # the evaluation of the resume step is the first run's, kept
    for read in (_read_csv, _read_tensorboard, _read_mlflow):
        loss, evaluated = read(tmp_path)
        assert [s for s, _ in loss] == list(range(12)), read.__name__
        expected = kept if read is _read_mlflow else newest
        assert [v for _, v in loss] == pytest.approx([expected[s] for s in range(12)], rel=1e-6)
        assert evaluated == evaluations, read.__name__


def _read_csv(tmp_path) -> tuple[list[tuple[int, float]], list[int]]:
    """(step, loss) of every training row and the steps of every evaluation row."""
    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    loss = sorted((int(r["step"]), float(r["loss"])) for r in rows if r["loss"])
    return loss, sorted(int(r["step"]) for r in rows if r["eval/mse"])


def _read_tensorboard(tmp_path) -> tuple[list[tuple[int, float]], list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    runs = {}
    for series in ("train", "eval"):
        runs[series] = EventAccumulator(str(tmp_path / "tb" / series), size_guidance={SCALARS: 0})
        runs[series].Reload()
    loss = sorted((e.step, e.value) for e in runs["train"].Scalars("loss"))
    return loss, sorted(e.step for e in runs["eval"].Scalars("eval/mse"))


def _read_mlflow(tmp_path) -> tuple[list[tuple[int, float]], list[int]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(str(tmp_path / "mlruns"))
    [run] = client.search_runs([client.get_experiment_by_name("elastic").experiment_id])
    assert (run.data.tags[RUN_TAG], run.info.status) == ("logged-run", "FINISHED")
    history = {key: client.get_metric_history(run.info.run_id, key) for key in ("loss", "eval/mse")}
    return (sorted((m.step, m.value) for m in history["loss"]),
            sorted(m.step for m in history["eval/mse"]))
