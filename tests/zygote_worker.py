"""What the raylets of the tests' clusters start in place of Ray's `default_worker.py`: hands
the worker's start to a zygote (tests/zygote.py) and ends as the forked worker ends. Without a
zygote, or where the zygote declines (another interpreter or start-up settings), it becomes
`python default_worker.py ...` itself. Imports nothing heavy: it is started once per worker."""

import json
import os
import signal
import socket
import struct
import sys

DEFAULT_WORKER = os.environ.get("ELASTIC_TEST_DEFAULT_WORKER", "")


def _turn(first: str) -> int:
    """The zygotes take turns: a counter beside their sockets, one more per worker started."""
    import fcntl

    fd = os.open(os.path.join(os.path.dirname(first), "turn"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        turn = int(os.read(fd, 32) or b"0")
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(turn + 1).encode().ljust(32))
        return turn
    except (OSError, ValueError):
        return os.getpid()
    finally:
        os.close(fd)


def main() -> None:
    argv = [DEFAULT_WORKER, *sys.argv[1:]]
    flags = sys.orig_argv[1 : len(sys.orig_argv) - len(sys.argv)]  # -s, -S as Ray passed them
    plain = [sys.executable, *flags, *argv]
    paths = os.environ.get("ELASTIC_TEST_ZYGOTE", "").split(os.pathsep)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(paths[_turn(paths[0]) % len(paths)])
    except OSError:
        os.execv(sys.executable, plain)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                       "executable": sys.executable, "flags": flags}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
    conn.sendall(body)
    stream = conn.makefile("rb")
    pid = int(stream.readline() or 0)
    if pid == 0:  # declined: the zygote's interpreter or settings are not this worker's
        conn.close()
        os.execv(sys.executable, plain)

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = stream.readline()
    status = int(line) if line.strip() else -1
    if status < 0:  # the zygote went away: its child dies with it (PR_SET_PDEATHSIG)
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot have a handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
