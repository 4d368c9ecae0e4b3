"""The run index and the fast control channel, without Ray."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import pytest

from elastic import control
from elastic.control.requests import Drain, Kill, Scale, Status, Stop
from elastic.errors import ConfigError, ControllerError
from elastic.registry import RunRegistry

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")


class _Run:
    """A stand-in for the controller's `answer`."""

    def __init__(self) -> None:
        self.target = 2
        self.stopped = False

    def handle(self, request: object) -> object:
        match request:
            case Status():
                return {"state": "running", "target": self.target}
            case Scale(num_workers=n):
                if n > 4:
                    raise ConfigError("cannot scale to more than 4")
                self.target = n
                return None
            case Stop():
                self.stopped = True
                return None
        raise RuntimeError("a bug")


@dataclass(frozen=True)
class _Shutdown:
    """A request kind the channel does not know."""

    verb: ClassVar[str] = "shutdown"


@pytest.fixture
def server():
    run = _Run()
    srv = control.ControlServer(run.handle)
    yield srv, run
    srv.close()


def test_calls_reach_the_handler_and_return_its_result(server):
    srv, run = server
    assert control.call(srv.address, Status()) == {"state": "running", "target": 2}
    assert control.call(srv.address, Scale(3)) is None
    assert run.target == 3
    control.call(srv.address, Stop())
    assert run.stopped


def test_an_elastic_error_crosses_with_its_type_and_message(server):
    srv, _ = server
    with pytest.raises(ConfigError, match="more than 4"):
        control.call(srv.address, Scale(9))


def test_a_bug_in_the_handler_and_an_unknown_method_are_controller_errors(server):
    srv, _ = server
    with pytest.raises(ControllerError, match="a bug"):
        control.call(srv.address, Kill(0))
    with pytest.raises(ControllerError, match="unknown control method"):
        control.call(srv.address, _Shutdown())  # type: ignore[arg-type]


def test_a_closed_channel_is_unavailable(server):
    srv, _ = server
    address = srv.address
    srv.close()
    with pytest.raises(control.ControlUnavailable):
        control.call(address, Status())


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as another user")
def test_another_user_gets_no_answer(server, tmp_path):
    srv, run = server
    # As uid 65534 (nobody): connect, ask to scale, read whatever comes back.
    probe = textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\\0{srv.address}")
        try:  # the server may have hung up before the request is even written
            s.sendall(b'{{"method": "scale", "args": [4]}}\\n')
            print(repr(s.recv(1000)))
        except (BrokenPipeError, ConnectionResetError):
            print(repr(b""))
    """)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "b''"
    assert run.target == 2


def test_records_are_private_replaced_whole_and_listed_newest_first(tmp_path):
    registry = RunRegistry(str(tmp_path / "home"))
    registry.write({"name": "old", "state": "finished", "started_at": 1.0})
    registry.write({"name": "new", "state": "running", "started_at": 2.0})
    registry.write({"name": "old", "state": "failed", "started_at": 1.0})
    assert [(r["name"], r["state"]) for r in registry.all()] == [("new", "running"), ("old", "failed")]
    assert registry.read("missing") is None
    assert stat.S_IMODE(os.stat(registry.directory).st_mode) == 0o700
    for name in os.listdir(registry.directory):
        assert name in ("old.json", "new.json")  # no temporary file left behind
        assert stat.S_IMODE(os.stat(os.path.join(registry.directory, name)).st_mode) == 0o600


def test_a_controller_slow_to_answer_is_busy_not_gone(tmp_path, monkeypatch):
    # Its listener took the call, its answer did not come in time: before, that read as
    # "nobody there", and `status` showed the live run as lost (a resume's or a new run's
    # check of the name then let it through).
    import functools
    import threading

    from elastic import api
    from elastic.registry import this_host

    release = threading.Event()

    def slow(request):
        release.wait()
        return {"state": "running"}

    srv = control.ControlServer(slow)
    try:
        with pytest.raises(control.ControlBusy, match=r"no answer in 0\.2 s"):
            control.call(srv.address, Status(), timeout=0.2)
        monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
        monkeypatch.setattr(control, "call", functools.partial(control.call, timeout=0.2))
        record = {"name": "slow", "state": "running", "step": 7, "control": srv.address,
                  "host": this_host(), "run_dir": str(tmp_path / "run")}
        RunRegistry().write(record)
        assert api._refresh(record)["state"] == "running"
    finally:
        release.set()
        srv.close()
    with pytest.raises(control.ControlUnavailable) as gone:  # and one that is gone, is
        control.call(srv.address, Status(), timeout=0.2)
    assert not isinstance(gone.value, control.ControlBusy)
    assert api._refresh(record)["state"] == "lost"


def test_a_kill_a_busy_controller_took_is_not_asked_again_through_ray(tmp_path, monkeypatch):
    # Other requests fall back to Ray when the channel does not answer; a kill asked again
    # would kill a second worker (another one, after a resize).
    import functools
    import threading

    from elastic import api
    from elastic.actors import client
    from elastic.errors import ControllerBusyError
    from elastic.registry import this_host

    release, asked = threading.Event(), []

    def slow(request):
        asked.append(request)
        release.wait()

    monkeypatch.setattr(client, "call", lambda name, request: asked.append(("ray", request)))
    monkeypatch.setattr(control, "call", functools.partial(control.call, timeout=0.2))
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    srv = control.ControlServer(slow)
    try:
        RunRegistry().write({"name": "busy", "state": "running", "step": 7,
                             "control": srv.address, "host": this_host(),
                             "run_dir": str(tmp_path / "run")})
        with pytest.raises(ControllerBusyError, match=r"took the kill of rank 1 .* see "
                                                      r"`elastic status busy`"):
            api.kill("busy", 1)
        assert asked == [Kill(1)]
        with pytest.raises(ControllerBusyError, match="took the drain of rank 0"):
            api.drain("busy", rank=0)
        api.stop("busy")  # a stop asked twice stops once: it goes on through Ray
        assert asked == [Kill(1), Drain(0), Stop(), ("ray", Stop())]
        # Its status is the record it last published (Ray would wait on it too).
        assert api.status("busy")["step"] == 7 and asked[-1] == Status()
    finally:
        release.set()
        srv.close()
