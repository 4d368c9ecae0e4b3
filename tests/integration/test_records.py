"""Finished runs stay visible: every run leaves a record in the index that `elastic status`
and `elastic list` read by name, with no run directory and no Ray cluster needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import elastic
from cli.main import app
from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.errors import RunNotFoundError, UserCodeError
from elastic.events import StateChanged
from tests.events import kinds
from tests.jobs import failing_job, regression_job

pytestmark = pytest.mark.integration
cli = CliRunner()


def _config(tmp_path, name: str, **kwargs) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=16),
                     max_steps=4, name=name, run_dir=str(tmp_path / name), **kwargs)


def test_a_finished_and_a_failed_run_answer_status_and_list_after_they_end(ray_cluster, tmp_path):
    result = elastic.fit(regression_job(), _config(tmp_path, "rec-finished"))
    with pytest.raises(UserCodeError):
        elastic.fit(failing_job(), _config(tmp_path, "rec-failed"))

    finished = elastic.status("rec-finished")
    assert (finished["state"], finished["step"], finished["total_steps"]) == ("finished", 4, 4)
    assert finished["last_loss"] == result.metrics[-1]["loss"]
    assert finished["run_dir"] == result.run_dir
    assert finished["ended_at"] >= finished["started_at"]
    assert finished["error_type"] is None and finished["workers"] == []

    failed = elastic.status("rec-failed")
    assert failed["state"] == "failed"
    assert failed["error_type"] == "UserCodeError"
    assert "user bug in the loss" in failed["error_message"]

    names = [r["name"] for r in elastic.runs()]
    assert names.index("rec-failed") < names.index("rec-finished")  # newest first
    assert not {"rec-failed", "rec-finished"} & {r["name"] for r in elastic.runs(live_only=True)}

    shown = cli.invoke(app, ["status", "rec-finished"])
    assert shown.exit_code == 0, shown.output
    assert "finished, step 4/4" in shown.output
    shown = cli.invoke(app, ["status", "rec-failed"])
    assert "failed" in shown.output and "UserCodeError" in shown.output
    listed = cli.invoke(app, ["list"])
    assert "rec-finished" in listed.output and "rec-failed" in listed.output
    assert "rec-finished" not in cli.invoke(app, ["list", "--live"]).output
    # Nothing to control in an ended run: a clear error, not a hang or a Ray lookup.
    with pytest.raises(RunNotFoundError, match="not running"):
        elastic.scale("rec-finished", 2)
    assert kinds(elastic.events("rec-finished"))[-1] is StateChanged


def test_the_record_is_read_without_ray(ray_cluster, tmp_path):
    elastic.fit(regression_job(), _config(tmp_path, "rec-noray"))
    # A fresh process that cannot reach any cluster (and never imports ray) still answers.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    probe = ("import json, sys, elastic; print(json.dumps(elastic.status('rec-noray'))); "
             "print('ray' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record, modules = done.stdout.strip().splitlines()
    assert json.loads(record)["state"] == "finished"
    assert modules == "False False"
