"""The reaper of a local Ray cluster: when the process that started it ends, however it ends
(SIGKILL, an SSH session that drops), no process of that cluster is left running.

`ray.init()` starts a local cluster's processes (the GCS, the raylet, the dashboard and
their children: Ray's workers) under the driver. After a SIGKILL of the driver some outlive
it. `start` launches this file as a process of its own session, with the process ids of the
cluster's own processes. It reads a pipe from the driver, whose read returns only when the
driver has ended and the kernel closed its end. Meanwhile, every `_LOOK_S`, it notes the
processes below those (workers start and end as the run goes). At the end it ends them all:
SIGTERM, then SIGKILL after a grace to the same processes (a process is told apart from a
later one with the same id by its start time), and to any child found since.

Only the cluster's own processes and their descendants are touched, never a process that
merely names the session's folder. Standard library only, run as a file (`python -I`), so
that no working directory or package can break it. Linux only (it reads /proc).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import IO

_GRACE_S = 3.0  # from SIGTERM to SIGKILL
_LOOK_S = 2.0  # how often the processes below the cluster's are noted


def start(pids: list[int]) -> subprocess.Popen[bytes] | None:
    """Launches the reaper of the cluster whose own processes are `pids`; keep the returned
    process (its pipe must stay open as long as this process lives). None where there is no
    /proc."""
    if not os.path.isdir("/proc") or not pids:
        return None
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), *map(str, pids)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent, start time) of process `pid`; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def tree(roots: dict[int, int]) -> dict[int, int]:
    """The live processes among `roots` (pid -> start time) and all their descendants, each
    with its start time."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            table[int(entry)] = info
    found = {pid: start for pid, start in roots.items()
             if pid in table and table[pid][1] == start}
    grew = True
    while grew:
        children = {pid: start for pid, (parent, start) in table.items()
                    if parent in found and pid not in found}
        found.update(children)
        grew = bool(children)
    return found


def reap(known: dict[int, int], roots: dict[int, int]) -> None:
    """Ends the processes in `known` that still are what they were (pid -> start time), and
    whatever descends from `roots` now: SIGTERM, then SIGKILL to those left after a grace."""
    targets = {**known, **tree(roots)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = {p: s for p, s in targets.items() if (info := _stat(p)) and info[1] == s}
        for pid in alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + _GRACE_S
        while alive and time.monotonic() < deadline:
            alive = {p: s for p, s in alive.items() if (info := _stat(p)) and info[1] == s}
            time.sleep(0.05)  # polling the processes' end: there is nothing to wait on
        if not alive:
            return
        targets = alive


def watch(pipe: IO[bytes], pids: list[int]) -> None:
    """Waits for the end of `pipe`, noting the cluster's process tree meanwhile; then reaps."""
    roots = {pid: info[1] for pid in pids if (info := _stat(pid)) is not None}
    known = tree(roots)
    while True:
        readable, _, _ = select.select([pipe], [], [], _LOOK_S)
        if readable and not os.read(pipe.fileno(), 4096):
            break  # the driver ended: the kernel closed its end
        known.update(tree(roots))
        known = {p: s for p, s in known.items() if (info := _stat(p)) and info[1] == s}
    reap(known, roots)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver
    watch(sys.stdin.buffer, [int(a) for a in sys.argv[1:]])
