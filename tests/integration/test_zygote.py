"""The session cluster's workers come from tests/zygote.py; what a worker sees must be what a
worker that Ray started the ordinary way sees (the other tests rely on it)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest

from tests import zygote

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not zygote.enabled(), reason="ELASTIC_TEST_ZYGOTE=0")
def test_a_session_worker_is_forked_from_the_zygote_and_looks_like_a_plain_one(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=1)
    class Probe:
        def view(self):  # the class travels by value: no names of this module inside
            import os
            import sys

            import torch

            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = f.read().decode()
            return {"argv0": sys.argv[0], "path": sys.path, "threads": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(), "parent": parent,
                    "zygote_env": os.environ.get("ELASTIC_TEST_ZYGOTE")}

        def die(self):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    probe = Probe.remote()
    view = ray.get(probe.view.remote())
    assert "zygote.py" in view["parent"] and view["zygote_env"]
    # As `python default_worker.py ...` would: argv, the script's folder on the path (Ray puts
    # the driver's folders before it) and not the zygote's, torch's threads from the
    # OMP_NUM_THREADS Ray gives a one-CPU worker.
    assert view["argv0"].endswith(os.path.join("workers", "default_worker.py"))
    assert os.path.dirname(view["argv0"]) in view["path"]
    assert os.path.dirname(zygote.__file__) not in view["path"]
    assert view["threads"] == int(view["omp"]) == int(os.environ.get("OMP_NUM_THREADS", "1"))
    # A worker killed by a signal is a dead actor to Ray, as a plain one is.
    probe.die.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(probe.view.remote())
    try:  # the worker's process has ended (or already been reaped)
        fd = os.pidfd_open(view["pid"])
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], 30)[0]
    finally:
        os.close(fd)


# --- the zygotes themselves, without Ray: a probe script in place of default_worker.py ---------

_PROBE = '''
import atexit, json, os, signal, sys, time
what = sys.argv[1]
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "hash": hash("elastic"),
                  "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "mark": os.environ.get("PROBE_MARK"), "torch": "torch" in sys.modules}),
      flush=True)
if what == "atexit":
    atexit.register(lambda: open(sys.argv[2], "w").write("ran"))
elif what == "exit3":
    sys.exit(3)
elif what == "message":
    sys.exit("the worker says why")
elif what == "wait":
    sys.stdin.read()  # until killed
'''


@pytest.fixture(scope="module")
def zygotes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zygotes")
    servers, paths = zygote.start(str(folder))
    probe = folder / "probe.py"
    probe.write_text(_PROBE)
    yield paths, str(probe)
    for server in servers:
        server.kill()
        server.wait()


def _client(zygotes, tmp_path, *args, **env):
    paths, probe = zygotes
    full = {**os.environ, zygote.SWITCH: paths, "ELASTIC_TEST_DEFAULT_WORKER": probe,
            "PROBE_MARK": "m", **env}
    return subprocess.Popen([sys.executable, os.path.join(os.path.dirname(zygote.__file__),
                                                           "zygote_worker.py"), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(tmp_path), env=full)


def _view(proc) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_child_runs_the_script_as_python_would_and_ends_as_it_does(zygotes, tmp_path):
    marker = tmp_path / "atexit"
    proc = _client(zygotes, tmp_path, "atexit", str(marker))
    view = _view(proc)
    assert proc.wait(60) == 0
    assert view["ppid"] != proc.pid and view["torch"]  # forked from a zygote, torch loaded
    assert view["argv"] == [zygotes[1], "atexit", str(marker)]
    assert view["cwd"] == str(tmp_path) and view["mark"] == "m"
    assert view["path0"] == os.path.dirname(zygotes[1])
    assert marker.read_text() == "ran"  # the interpreter's own exit: atexit handlers ran
    proc = _client(zygotes, tmp_path, "exit3")
    _view(proc)
    assert proc.wait(60) == 3
    proc = _client(zygotes, tmp_path, "message")
    _view(proc)
    assert proc.wait(60) == 1 and "the worker says why" in proc.stderr.read()


def test_consecutive_children_come_from_zygotes_with_different_hash_seeds(zygotes, tmp_path):
    views = []
    for _ in range(2):
        proc = _client(zygotes, tmp_path, "exit")
        views.append(_view(proc))
        assert proc.wait(60) == 0
    assert views[0]["ppid"] != views[1]["ppid"]
    assert views[0]["hash"] != views[1]["hash"]


def test_a_killed_child_kills_its_client_and_a_killed_client_its_child(zygotes, tmp_path):
    proc = _client(zygotes, tmp_path, "wait")
    view = _view(proc)
    os.kill(view["pid"], signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL  # as Ray sees a worker it started die
    proc = _client(zygotes, tmp_path, "wait")
    view = _view(proc)
    child = os.pidfd_open(view["pid"])
    try:
        proc.kill()
        proc.wait(60)
        assert select.select([child], [], [], 60)[0]  # the zygote killed the child
    finally:
        os.close(child)


def test_another_interpreter_setting_is_started_the_ordinary_way(zygotes, tmp_path):
    proc = _client(zygotes, tmp_path, "exit", PYTHONPATH=str(tmp_path))
    view = _view(proc)
    assert proc.wait(60) == 0
    assert view["pid"] == proc.pid and not view["torch"]  # the client became the worker
    assert view["path0"] == os.path.dirname(zygotes[1])
