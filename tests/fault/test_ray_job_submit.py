"""End to end: a head of our own (`ray start --head`, free ports, temporary directory, token
authentication on), a job submitted with `ray job submit`, scaled and killed through the CLI
from other processes, stopped, and SUCCEEDED. Only the processes started here are stopped."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

pytestmark = pytest.mark.fault

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_until(predicate, limit: float):
    done = threading.Event()
    timer = threading.Timer(limit, done.set)
    timer.start()
    try:
        while not done.is_set():
            value = predicate()
            if value:
                return value
            done.wait(0.5)
    finally:
        timer.cancel()
    raise TimeoutError("condition not reached")


@pytest.fixture
def head():
    # A short path: Ray puts unix sockets under it.
    temp = tempfile.mkdtemp(prefix="eh", dir="/tmp")
    gcs, dashboard, agent_http, agent_grpc, metrics, runtime_env, client = _free_ports(7)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}",
         f"--dashboard-port={dashboard}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--ray-client-server-port={client}",
         "--num-cpus=4", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    info = {"gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}", "env": env}
    try:
        yield info
    finally:
        # Only what this fixture started: the head process and everything under its temp dir.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        _kill_processes_mentioning(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _kill_processes_mentioning(text: str) -> None:
    """SIGKILLs the processes whose command line contains `text` (Linux /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _run(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_a_submitted_job_is_scaled_killed_stopped_and_succeeds(head):
    env = head["env"]
    ray_cmd = str(BIN / "ray")
    elastic_env = {**env, "RAY_ADDRESS": head["gcs"]}
    _wait_until(lambda: _run([ray_cmd, "job", "list", "--address", head["dashboard"]], env,
                             timeout=60).returncode == 0, limit=120)
    submitted = _run([ray_cmd, "job", "submit", "--address", head["dashboard"], "--no-wait",
                      "--working-dir", "examples", "--", "python", "submit_job.py", "--name", "sj",
                      "--workers", "2", "--max-workers", "3", "--epochs", "100000"], env)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)

    def status() -> dict | None:
        result = _run([str(BIN / "elastic"), "status", "sj", "--json"], elastic_env)
        return json.loads(result.stdout) if result.returncode == 0 else None

    _wait_until(lambda: (s := status()) and s["state"] == "running", limit=180)
    assert _run([str(BIN / "elastic"), "scale", "sj", "3"], elastic_env).returncode == 0
    _wait_until(lambda: (s := status()) and s["world_size"] == 3 and s["state"] == "running",
                limit=180)
    assert _run([str(BIN / "elastic"), "kill", "sj", "--rank", "0"], elastic_env).returncode == 0
    _wait_until(lambda: (s := status()) and s["failures"] == 1 and s["state"] == "running",
                limit=180)
    logs = _run([str(BIN / "elastic"), "logs", "sj"], elastic_env)
    assert "on purpose" in logs.stdout and "resized" in logs.stdout
    assert _run([str(BIN / "elastic"), "stop", "sj"], elastic_env).returncode == 0

    def finished() -> str | None:
        result = _run([ray_cmd, "job", "status", "--address", head["dashboard"], job_id], env)
        # `ray job status` ends with "Job '<id>' succeeded" (or failed, stopped).
        found = re.search(r"Job '[^']+' (succeeded|failed|stopped)", result.stdout + result.stderr)
        return found.group(1) if found else None

    assert _wait_until(finished, limit=180) == "succeeded"
    output = _run([ray_cmd, "job", "logs", "--address", head["dashboard"], job_id], env).stdout
    assert "finished" in output
