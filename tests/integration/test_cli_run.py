"""The CLI's run/status wiring against a live local cluster."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.integration
runner = CliRunner()


def test_run_trains_a_file_target_and_prints_a_summary(ray_cluster, tmp_path):
    result = runner.invoke(app, [
        "run", "examples/spirals.py:job", "--workers", "2", "--global-batch", "64",
        "--max-steps", "6", "--run-dir", str(tmp_path / "run"), "--name", "cli-run",
    ])
    assert result.exit_code == 0, result.output
    assert "steps" in result.output
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(6))


def test_status_of_an_unknown_run_exits_2(ray_cluster):
    result = runner.invoke(app, ["status", "no-such-run"])
    assert result.exit_code == 2
    assert "no-such-run" in result.output
