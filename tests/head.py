"""A Ray head of a test's own (`ray start --head`): free ports, a temporary directory, token
authentication on. Only the processes it started are stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

BIN = pathlib.Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def wait_until(predicate, limit: float):
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


@contextlib.contextmanager
def own_head(dashboard: bool = True, num_cpus: int = 4, extra_env: dict[str, str] | None = None
             ) -> Iterator[dict]:
    # A short path: Ray puts unix sockets under it.
    temp = tempfile.mkdtemp(prefix="eh", dir="/tmp")
    gcs, dashboard_port, agent_http, agent_grpc, metrics, runtime_env, client = free_ports(7)
    # A token of its own, given to the head and every client through the environment: the head
    # writes a missing ~/.ray/auth_token only while it starts, so a client started at once (or
    # on a fresh machine) would find none.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        # Ray's `ray start`, with workers forked from a zygote that has imported torch.
        [sys.executable, str(pathlib.Path(__file__).with_name("ray_head.py")), "start", "--head",
         "--block", f"--port={gcs}",
         f"--dashboard-port={dashboard_port}", f"--include-dashboard={str(dashboard).lower()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--ray-client-server-port={client}",
         f"--num-cpus={num_cpus}", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    info = {"gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard_port}", "env": env}
    try:
        yield info
    finally:
        # Only what this fixture started: the head process and everything under its temp dir.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        kill_processes_mentioning(temp)
        shutil.rmtree(temp, ignore_errors=True)


def kill_processes_mentioning(text: str) -> None:
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
