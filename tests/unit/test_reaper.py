"""The reaper of a local cluster (`elastic.reaper`), without Ray: when the pipe from its
driver closes, it ends the cluster's own processes and their descendants, and nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _until(predicate, what: str, tries: int = 400):
    import threading

    pause = threading.Event()
    for _ in range(tries):
        value = predicate()
        if value:
            return value
        pause.wait(0.025)  # polling a condition, bounded
    raise TimeoutError(what)


def test_the_reaper_ends_the_clusters_tree_when_its_driver_ends_and_nothing_else():
    # A "cluster" process with two children of its own, and an unrelated process.
    cluster = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"])
    try:
        start = reaper._stat(cluster.pid)[1]
        members = _until(lambda: len(t := reaper.tree({cluster.pid: start})) == 3 and t,
                         "the cluster's children")
        process = reaper.start([cluster.pid])
        assert process is not None and process.poll() is None
        process.stdin.close()  # what the driver's end does to the pipe
        assert process.wait(timeout=30) == 0
        cluster.wait(timeout=10)
        assert all(reaper._stat(pid) is None for pid in members)  # all three, children too
        assert other.poll() is None  # not the cluster's: untouched
    finally:
        for proc in (cluster, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_process_that_reuses_a_cluster_pid_later_is_not_touched():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        pid, start = bystander.pid, reaper._stat(bystander.pid)[1]
        # Known under another start time: a process that had this id before and ended.
        reaper.reap({pid: start + 1}, {pid: start + 1})
        assert bystander.poll() is None
        reaper.reap({pid: start}, {})
        assert bystander.wait(timeout=10) is not None
    finally:
        if bystander.poll() is None:
            bystander.kill()
            bystander.wait()
