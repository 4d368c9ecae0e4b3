"""The reaper of a local Ray cluster: when the process that started it ends, however it ends
(SIGKILL, an SSH session that drops), no process of that cluster is left running.

`ray.init()` starts a local cluster's processes (the GCS, the raylet, the dashboard, their
workers) as the driver's children. They are meant to end with it, but after a SIGKILL some
outlive it. `start` launches this module as a process of its own session that reads a pipe
from the driver; the read returns only when the driver has ended and the kernel closed its
end. It then ends every process of the cluster: those whose command line names the cluster's
session folder, and their descendants (Ray's workers rename themselves `ray::...`).

No Ray here; Linux only (it reads /proc). `python -m elastic.reaper SESSION_DIR`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

_GRACE_S = 3.0  # from SIGTERM to SIGKILL


def start(session_dir: str) -> subprocess.Popen[bytes] | None:
    """Launches the reaper of the cluster in `session_dir`; keep the returned process (its
    pipe must stay open for as long as this process lives). None where there is no /proc."""
    if not os.path.isdir("/proc"):
        return None
    return subprocess.Popen([sys.executable, "-m", "elastic.reaper", session_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def cluster_processes(session_dir: str, exclude: int | None = None) -> set[int]:
    """The processes of the cluster in `session_dir`: those whose command line names it, and
    every descendant of theirs."""
    parents: dict[int, int] = {}
    roots = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                parents[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if session_dir in cmdline:
            roots.add(pid)
    found = set(roots)
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return found


def reap(session_dir: str) -> None:
    """Ends the cluster's processes: SIGTERM, then SIGKILL to those left after a grace."""
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = cluster_processes(session_dir, exclude=me)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
            time.sleep(0.05)  # polling the processes' end, nothing else to wait on
        if not pids:
            return


def main(session_dir: str, pipe: IO[bytes]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver
    pipe.read()  # returns at the driver's end, when the kernel closes its end of the pipe
    reap(session_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.stdin.buffer)
