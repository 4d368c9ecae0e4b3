"""End to end: a head of our own (`ray start --head`, free ports, temporary directory, token
authentication on), a job submitted with `ray job submit`, scaled and killed through the CLI
from other processes, stopped, and SUCCEEDED; another stopped with `ray job stop` (SIGTERM), which
stops its run as `elastic stop` does. Only the processes started here are stopped."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from elastic import control
from elastic.control.requests import Status
from elastic.registry import RunRegistry, is_terminal
from tests.head import own_head, wait_until

pytestmark = pytest.mark.fault

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


@pytest.fixture
def head():
    # `ray job stop` waits this long after its SIGTERM before a SIGKILL (3 s by default): the
    # README's advice for steps that may take longer, here for a loaded test machine.
    with own_head(extra_env={"RAY_JOB_STOP_WAIT_TIME_S": "120"}) as info:
        yield info


def _submit(head: dict, name: str, env: dict) -> str:
    """Submits examples/submit_job.py as run `name` (2 to 3 workers, endless); its job id."""
    submitted = _run([str(BIN / "ray"), "job", "submit", "--address", head["dashboard"], "--no-wait",
                      "--working-dir", "examples", "--", "python", "submit_job.py", "--name", name,
                      "--workers", "2", "--max-workers", "3", "--epochs", "100000"], env)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    return re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)


def _run(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_a_submitted_job_is_scaled_killed_stopped_and_succeeds_and_ray_job_stop_stops_a_run(head):
    env = head["env"]
    ray_cmd = str(BIN / "ray")
    elastic_env = {**env, "RAY_ADDRESS": head["gcs"]}
    wait_until(lambda: _run([ray_cmd, "job", "list", "--address", head["dashboard"]], env,
                             timeout=60).returncode == 0, limit=120)
    job_id = _submit(head, "sj", env)

    def status(name: str = "sj") -> dict | None:
        """`elastic status NAME --json`, as a user types it."""
        try:
            result = _run([str(BIN / "elastic"), "status", name, "--json"], elastic_env,
                          timeout=60)
        except subprocess.TimeoutExpired:  # Ray's client did not reach the GCS (seen once,
            return None                    # its connect timing out): asked again
        return json.loads(result.stdout) if result.returncode == 0 else None

    def polled(name: str = "sj") -> dict | None:
        """What `status` answers, from the run's control channel in this process: a poll costs
        milliseconds where a process (Python and its imports) costs a second of the two cores
        the run trains on. Each wait below ends with one `status` as typed."""
        record = RunRegistry().read(name)
        assert record is None or not is_terminal(record), record  # it ended: fail at once
        if record is None or not record.get("control"):
            return None  # its controller has not registered yet
        try:
            return control.call(record["control"], Status())
        except control.ControlUnavailable:
            return None

    def reached(check, name: str = "sj") -> dict:
        wait_until(lambda: (s := polled(name)) and check(s), limit=180)
        return wait_until(lambda: (s := status(name)) and check(s) and s, limit=60)

    # Not in Ray's temporary copy of the working directory: the record outlives the job.
    run_dir = pathlib.Path(reached(lambda s: s["state"] == "running")["run_dir"])
    assert run_dir == pathlib.Path(env["ELASTIC_HOME"]) / "run-dirs" / "sj"
    assert _run([str(BIN / "elastic"), "scale", "sj", "3"], elastic_env).returncode == 0
    reached(lambda s: s["world_size"] == 3 and s["state"] == "running")
    assert _run([str(BIN / "elastic"), "kill", "sj", "--rank", "0"], elastic_env).returncode == 0
    reached(lambda s: s["failures"] == 1 and s["state"] == "running")
    # A notice reaches a submitted run as any other: the rank leaves at a step boundary.
    assert _run([str(BIN / "elastic"), "drain", "sj", "--rank", "1"], elastic_env).returncode == 0
    reached(lambda s: s["preemptions"] == 1 and s["state"] == "running")
    logs = _run([str(BIN / "elastic"), "logs", "sj"], elastic_env)
    assert "on purpose" in logs.stdout and "resized" in logs.stdout
    assert "0 steps redone" in logs.stdout  # the planned departure's line
    assert _run([str(BIN / "elastic"), "stop", "sj"], elastic_env).returncode == 0

    def finished(job: str) -> str | None:
        result = _run([ray_cmd, "job", "status", "--address", head["dashboard"], job], env)
        # `ray job status` ends with "Job '<id>' succeeded" (or "failed", "was stopped").
        found = re.search(r"Job '[^']+' (?:was )?(succeeded|failed|stopped)", result.stdout + result.stderr)
        return found.group(1) if found else None

    assert wait_until(lambda: finished(job_id), limit=180) == "succeeded"
    output = _run([ray_cmd, "job", "logs", "--address", head["dashboard"], job_id], env).stdout
    assert "stopped after" in output  # `elastic stop` ended it
    assert (run_dir / "events.jsonl").is_file() and (run_dir / "metrics.jsonl").is_file()

    # `ray job stop` (SIGTERM to the driver): the run stops after the step in flight, as
    # `elastic stop` does, and leaves its weights in the run dir.
    stopped_id = _submit(head, "sj-stop", env)
    reached(lambda s: s["state"] == "running" and s["step"] > 0, "sj-stop")
    assert _run([ray_cmd, "job", "stop", "--address", head["dashboard"], stopped_id], env,
                timeout=180).returncode == 0
    assert wait_until(lambda: finished(stopped_id), limit=180) == "stopped"
    record = status("sj-stop")
    assert record["state"] == "stopped" and record["workers"] == []
    stop_dir = pathlib.Path(record["run_dir"])
    assert (stop_dir / "final_model.pt").is_file()
    output = _run([ray_cmd, "job", "logs", "--address", head["dashboard"], stopped_id], env).stdout
    assert re.search(r"run sj-stop stopped at step \d+ \(interrupted by SIGTERM\)", output), output[-2000:]
