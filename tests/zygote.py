"""Warm Ray worker processes for the test session's cluster: a zygote that has imported torch
once and forks a child per Ray worker, so a worker starts in a fraction of a second of CPU
instead of the 2-2.5 s its imports cost on a two-core machine.

The session cluster's raylet starts `tests/zygote_worker.py` in place of Ray's
`default_worker.py` (conftest's `ray_cluster`); that small client hands its arguments,
environment, working directory and standard streams to this server, which forks, and the child
runs Ray's `default_worker.py` as `python default_worker.py ...` would: same argv, environment,
cwd, script folder on `sys.path`, default signal handlers, fresh NumPy entropy.

One difference is inherent: OpenMP and MKL read their thread settings (`OMP_NUM_THREADS`...)
once, when torch loads them, which here is before the fork. The server loads them with
`THREADS`: `OMP_NUM_THREADS=1`, what Ray sets (when a task starts, after the fork) for every
task and actor below two CPUs, which is every one these tests start. A worker whose
environment asks for other settings at its start is started the ordinary way; one that would
later ask Ray for two or more CPUs would train with one thread instead (no test does:
tests/integration/test_zygote.py checks a worker's threads). Only torch (and what it
imports, pydantic) are loaded before the fork; Ray and elastic are imported by the child, after
its environment is in place. The client waits
for the child and ends the way it ended (its exit code, or the signal that killed it); if the
client dies, the child is killed.

What runs through here: the workers of the test session's cluster (`tests/ray_cluster.py`)
and of the heads of `tests/head.py` (the README's commands, `ray job submit`). The clusters a
test's subprocess starts by itself (`elastic run` without a head, `elastic demo`, the
multi-node `Cluster`s, the loaders' and benchmarks' own processes) start their workers the
ordinary way, so the plain path stays covered. `ELASTIC_TEST_ZYGOTE=0` turns this off.

Protocol (one Unix stream connection per worker): the client sends a 4-byte length, a JSON
request {argv, env, cwd} and its fds 0, 1, 2 (SCM_RIGHTS); the server answers the child's pid
as a line, then, when the child has ended, its wait status as a line; or 0 for "start it
yourself".
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
SWITCH = "ELASTIC_TEST_ZYGOTE"  # the server's socket for zygote_worker.py; "0": no zygote


# Read by OpenMP and MKL when torch loads them, in the server: a worker whose environment has
# other values of these is not forked (its client starts it the ordinary way).
THREADS = {"OMP_NUM_THREADS": "1"}
_THREAD_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")


def _threads(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_THREAD_PREFIXES)}


def enabled() -> bool:
    return os.environ.get(SWITCH) != "0"


def start(folder: str) -> tuple[subprocess.Popen, str]:
    """Starts a server with its socket in `folder`; returns once it has imported torch. It
    ends with the process that started it."""
    path = os.path.join(folder, "zygote.socket")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_THREAD_PREFIXES)}
    server = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py"), path],
                              stdout=subprocess.PIPE, text=True, env={**env, **THREADS})
    if server.stdout.readline().strip() != "ready":
        server.kill()
        raise RuntimeError("the test zygote did not start (see its output above)")
    return server, path


@contextlib.contextmanager
def workers_from(path: str) -> Iterator[None]:
    """A Ray node started inside this block (`ray.init`, `ray start`) starts its Python workers
    through `zygote_worker.py` and the server at `path`: Ray's `worker_path` node parameter,
    which neither `ray.init` nor `ray start` exposes, defaults to that script meanwhile. The
    raylet inherits the environment that points the script at the server and at Ray's own
    `default_worker.py`; the environment is restored when the block ends."""
    from ray._private import parameter

    default_worker = os.path.join(os.path.dirname(parameter.__file__), "workers",
                                  "default_worker.py")
    original = parameter.RayParams.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.worker_path is None:
            self.worker_path = os.path.join(HERE, "zygote_worker.py")

    saved = {k: os.environ.get(k) for k in (SWITCH, "ELASTIC_TEST_DEFAULT_WORKER")}
    os.environ[SWITCH] = path
    os.environ["ELASTIC_TEST_DEFAULT_WORKER"] = default_worker
    parameter.RayParams.__init__ = init
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return json.loads(body), list(fds)


def _become_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into `python <argv...>` and run it; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        script, *args = request["argv"]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    try:  # die with the test process that started this one
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import pydantic  # noqa: F401 - imported before the fork, as torch
    import torch  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    print("ready", flush=True)
    # One thread only: a fork from a process with other threads could copy a held lock.
    children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client connection, pidfd)
    while True:
        for key, _ in sel.select():
            kind, data = key.data
            if kind == "listen":
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                wanted = _threads(request["env"])
                if wanted and wanted != _threads(dict(os.environ)):
                    for fd in fds:  # other thread settings: the client starts it itself
                        os.close(fd)
                    try:
                        conn.sendall(b"0\n")
                    except OSError:
                        pass
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for other, pidfd in children.values():
                        other.close()
                        os.close(pidfd)
                    conn.close()
                    _become_worker(request, fds)
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pid] = (conn, pidfd)
                sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
                sel.register(conn, selectors.EVENT_READ, ("client", pid))
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:
                    os.kill(pid, signal.SIGKILL)
            elif kind == "exit":
                pid = data
                conn, pidfd = children.pop(pid)
                _, status = os.waitpid(pid, 0)
                sel.unregister(pidfd)
                os.close(pidfd)
                if conn.fileno() in sel.get_map():
                    sel.unregister(conn)
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conn.close()
            else:  # the client spoke or went away: it only ever goes away
                pid = data
                if pid in children:
                    try:
                        if not children[pid][0].recv(1, socket.MSG_DONTWAIT):
                            os.kill(pid, signal.SIGKILL)
                            sel.unregister(children[pid][0])
                    except BlockingIOError:
                        pass
                    except OSError:
                        os.kill(pid, signal.SIGKILL)
                        sel.unregister(children[pid][0])


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: not on a worker's path
    serve(sys.argv[1])
