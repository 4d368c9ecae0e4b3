"""Warm Ray worker processes for the tests' clusters: zygotes that have imported torch once
and fork a child per Ray worker, so a worker starts in a fraction of a second of CPU instead of
the 2-2.5 s its imports cost on a two-core machine.

The raylet starts `tests/zygote_worker.py` in place of Ray's `default_worker.py`; that small
client hands its arguments, environment, working directory and standard streams to a zygote,
which forks; the child runs Ray's `default_worker.py` as `python default_worker.py ...` would:
the same argv, environment, cwd and script folder on `sys.path`, default signal handlers, fresh
NumPy entropy, and the interpreter's own exit (atexit handlers, non-daemon threads joined).
The client waits for the child and ends the way it did (its exit code, or the signal that
killed it); if the client dies, the child is killed; if a zygote dies, its children die too.

What a child cannot redo, because Python or a library read it once before the fork:
- The interpreter's start-up settings (`PYTHONPATH`, `PYTHONHASHSEED` and the other `PYTHON*`
  variables) and the interpreter itself: a worker whose environment or executable differs from
  the zygote's is started the ordinary way (so `ray job submit --working-dir`, which reaches
  workers through `PYTHONPATH`, works as without zygotes).
- What torch and torch._dynamo read from the environment as they are imported
  (`TORCH_COMPILE_*`, `TORCHDYNAMO_*`, `TORCHINDUCTOR_*`): a child keeps the server's values,
  which no test sets.
- The string hash seed: children of one zygote share it, where ordinary workers each draw
  their own. Two zygotes, each with its own seed, take turns (a counter beside their sockets), so
  the ranks of a run do not all share one: code whose collective order follows a set's iteration
  order still meets ranks that disagree.
- Thread pools: OpenMP and MKL read `OMP_NUM_THREADS` when torch loads them. The zygotes load
  them with the environment's settings, else `THREADS` (`OMP_NUM_THREADS=1`), what Ray sets,
  when a task starts and only where the environment has none, for every task and actor below
  two CPUs, which is every one these tests start. A worker whose environment
  asks for other settings at its start is started the ordinary way; one that asked Ray for two
  or more CPUs would train with one thread instead (no test does; tests/integration/
  test_zygote.py checks a worker's threads).
Only torch (and what it imports), torch._dynamo (which a worker's first optimizer imports: half
of a short test run's start) and pydantic are loaded before the fork; Ray and elastic are
imported by the child, after its environment is in place.

What runs through here: the workers of the test session's cluster (`tests/ray_cluster.py`)
and of the heads of `tests/head.py` (the README's commands, `ray job submit`). The clusters a
test's subprocess starts by itself (the node loss and join scenario of tests/fault/test_nodes.py,
test_resume's local cluster) start their workers the ordinary way, so that path stays
covered; the chaos scenario of test_nodes starts its own zygotes. `ELASTIC_TEST_ZYGOTE=0` turns this off.

Protocol (one Unix stream connection per worker): the client sends a 4-byte length, a JSON
request {argv, env, cwd, executable} and its fds 0, 1, 2 (SCM_RIGHTS); the server answers the
child's pid as a line, then, when the child has ended, its wait status as a line; or 0 for
"start it yourself".
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
# The servers' sockets for zygote_worker.py (os.pathsep between them); "0": no zygote.
SWITCH = "ELASTIC_TEST_ZYGOTE"
COUNT = 2  # zygotes per cluster, each with its own string hash seed
_MAX_REQUEST = 1 << 24  # bytes of one request (argv, environment, cwd)


# Read by OpenMP and MKL when torch loads them, in the server: a worker whose environment has
# other values of these is not forked (its client starts it the ordinary way).
THREADS = {"OMP_NUM_THREADS": "1"}
_THREAD_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_")


def _threads(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_THREAD_PREFIXES)}


def _forkable(request: dict) -> bool:
    """Whether a child of this server starts as `request`'s worker would by itself: the same
    interpreter and start-up variables, thread settings as the server's or none yet."""
    wanted = _threads(request["env"])
    return (request.get("executable") == sys.executable and request.get("flags") == []
            and _startup(request["env"]) == _startup(dict(os.environ))
            and (not wanted or wanted == _threads(dict(os.environ))))


def _startup(env: dict[str, str]) -> dict[str, str]:
    """The variables the interpreter reads as it starts (`PYTHONBREAKPOINT` is read when
    `breakpoint()` is called; Ray sets it)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONBREAKPOINT"}


def enabled() -> bool:
    return os.environ.get(SWITCH) != "0"


def start(folder: str) -> tuple[list[subprocess.Popen], str]:
    """Starts `COUNT` servers with their sockets in `folder`; returns them and the value of
    `SWITCH` once each has imported torch. They end with the process that started them."""
    env = {**THREADS, **os.environ}  # thread settings of the environment, if it has any
    servers, paths = [], []
    try:
        for i in range(COUNT):
            paths.append(os.path.join(folder, f"zygote{i}.socket"))
            servers.append(subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py"),
                                             paths[-1]], stdout=subprocess.PIPE, text=True,
                                            env=env))
        for server in servers:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("a test zygote did not start (see its output above)")
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers, os.pathsep.join(paths)


@contextlib.contextmanager
def workers_from(paths: str) -> Iterator[None]:
    """A Ray node started inside this block (`ray.init`, `ray start`) starts its Python workers
    through `zygote_worker.py` and the servers at `paths` (what `start` returns): Ray's
    `worker_path` node parameter, which neither `ray.init` nor `ray start` exposes, defaults to
    that script meanwhile. The raylet inherits the environment that points the script at the
    servers and at Ray's own `default_worker.py`; the environment is restored when the block
    ends."""
    from ray._private import parameter

    default_worker = os.path.join(os.path.dirname(parameter.__file__), "workers",
                                  "default_worker.py")
    original = parameter.RayParams.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.worker_path is None:
            self.worker_path = os.path.join(HERE, "zygote_worker.py")

    saved = {k: os.environ.get(k) for k in (SWITCH, "ELASTIC_TEST_DEFAULT_WORKER")}
    os.environ[SWITCH] = paths
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
    """The request and the client's fds 0, 1, 2 (close-on-exec here; closed on any error)."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3, socket.MSG_CMSG_CLOEXEC)
    try:
        if len(head) < 4 or len(fds) != 3:
            raise EOFError
        (size,) = struct.unpack("!I", head)
        if size > _MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes")
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise EOFError
            body += chunk
        return json.loads(body), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _become_worker(request: dict, fds: list[int], zygote: int) -> None:
    """In the forked child: becomes `python <argv...>` and runs it. Never returns: the
    worker's end (its `SystemExit`, an exception, or the end of the script) ends this
    interpreter as it would end `python default_worker.py`."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    if os.getppid() != zygote:
        os._exit(1)  # it died already
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets them at start
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
    raise SystemExit(0)


def serve(path: str) -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test process
    # Imported before the fork: torch; what a worker's first optimizer imports
    # (`torch.optim.Optimizer.__init__` imports torch._dynamo: 1.1-1.4 s of CPU per worker,
    # half of a short test run's start; it starts no thread); pydantic.
    import pydantic  # noqa: F401
    import torch._dynamo  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", None))
    print("ready", flush=True)
    # One thread only: a fork from a process with other threads could copy a held lock.
    children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (client connection, pidfd)
    zygote = os.getpid()
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
                if not _forkable(request):
                    for fd in fds:  # the client starts it itself
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
                    _become_worker(request, fds, zygote)
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
            elif data in children:  # its client never speaks: readable means it went away
                sel.unregister(children[data][0])  # (not if this batch reaped it already)
                os.kill(data, signal.SIGKILL)  # reaped at its "exit" event


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: not on a worker's path
    serve(sys.argv[1])
