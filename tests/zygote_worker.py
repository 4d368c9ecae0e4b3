"""What the session cluster's raylet starts in place of Ray's `default_worker.py`: hands the
worker's start to the zygote (tests/zygote.py) and ends as the forked worker ends. Without the
zygote, it becomes `python default_worker.py ...` itself. Imports nothing heavy: it is started
once per Ray worker."""

import json
import os
import signal
import socket
import struct
import sys

DEFAULT_WORKER = os.environ.get("ELASTIC_TEST_DEFAULT_WORKER", "")


def main() -> None:
    argv = [DEFAULT_WORKER, *sys.argv[1:]]
    path = os.environ.get("ELASTIC_TEST_ZYGOTE", "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        os.execv(sys.executable, [sys.executable, *argv])
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
    conn.sendall(body)
    stream = conn.makefile("rb")
    pid = int(stream.readline() or 0)
    if pid == 0:  # thread settings other than the zygote's
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = stream.readline()
    status = int(line) if line.strip() else -1
    if status < 0:  # the zygote went away: the child was killed with it
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
