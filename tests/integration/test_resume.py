"""A run whose driver is killed with SIGKILL is resumed by name (issue 42): `elastic resume
NAME` finds its target, configuration and checkpoints, says what it resumed from, and ends
on the weights of an uninterrupted run. A local cluster that such a driver started ends with
it."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import elastic
from elastic.events import Resumed, read_events
from tests.events import of_kind
from tests.head import wait_until
from tests.jobs import N_SAMPLES, reference_weights

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
LIMIT_S = 120
STEPS = 60


def _status(name: str) -> dict | None:
    try:
        return elastic.status(name)
    except elastic.errors.RunNotFoundError:
        return None


@pytest.mark.timeout(400)
def test_a_driver_killed_with_sigkill_is_resumed_by_name_and_ends_on_the_reference(
        ray_cluster, tmp_path):
    name = "resume-run"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    checkpoints = tmp_path / "ckpt"
    with open(tmp_path / "first.txt", "w") as sink:
        proc = subprocess.Popen(
            [str(BIN / "elastic"), "run", "tests.jobs:regression_job", "--name", name,
             "--workers", "2", "--global-batch", "16", "--max-steps", "10000000",
             "--run-dir", str(tmp_path / "run"), "--checkpoint", str(checkpoints),
             "--checkpoint-every", "4", "--keep-last", "2"],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Training, with a checkpoint behind it: then the driver dies at once.
        wait_until(lambda: (s := _status(name)) and s["state"] == "running" and s["step"] >= 12
                   and any(e.get("event") == "checkpoint_written" for e in elastic.events(name)),
                   LIMIT_S)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Its controller died with it (Ray ends the actors a driver owns): the run reads as lost.
    lost = wait_until(lambda: (s := _status(name)) and s["state"] == "lost" and s, LIMIT_S)
    # Resumed to train STEPS steps past where it was lost (a run's weights up to a step do not
    # depend on its max_steps).
    end = lost["step"] + STEPS
    done = subprocess.run([str(BIN / "elastic"), "resume", name, "--max-steps", str(end)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    [resumed] = of_kind(read_events(tmp_path / "run"), Resumed)
    assert resumed.from_run == name and resumed.world_size_then == 2
    assert resumed.world_size_now == 2 and resumed.changes == []
    assert f"resumed from step {resumed.step} of run {name}" in output
    # The lost run's metrics in its run dir say how far it got: the steps past the checkpoint
    # are redone, and the line says how many.
    assert resumed.reached is not None and resumed.reached >= resumed.step
    assert resumed.work_lost_steps == resumed.reached - resumed.step
    assert (f"{resumed.work_lost_steps} steps redone (it had reached step {resumed.reached})"
            in output)
    assert resumed.step <= lost["step"]
    status = elastic.status(name)
    assert status["state"] == "finished" and status["step"] == end
    assert status["resumed_from"]["step"] == resumed.step
    # The final checkpoint holds the weights of an uninterrupted run of the same configuration.
    final = elastic.load_checkpoint(str(checkpoints))
    assert final is not None and final.step == end
    assert final.manifest["dataset_size"] == N_SAMPLES  # a resume over other data says so
    torch.testing.assert_close(final.parts["model"], reference_weights(0, 16, end),
                               rtol=1e-9, atol=1e-10)


@pytest.mark.timeout(300)
def test_a_local_cluster_ends_with_its_driver_killed_with_sigkill(tmp_path):
    # A Ray temp folder of its own: the run finds no cluster and starts a local one, as on a
    # fresh machine (a short path: Ray puts unix sockets under it).
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    # RAY_ADDRESS=local: a fresh local cluster even beside this session's own.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": "local"}
    name = "reaped-run"
    with open(tmp_path / "out.txt", "w") as sink:
        proc = subprocess.Popen(
            [str(BIN / "elastic"), "run", "tests.jobs:regression_job", "--name", name,
             "--workers", "2", "--global-batch", "16", "--max-steps", "10000000",
             "--run-dir", str(tmp_path / "run")],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: (s := _status(name)) and s["state"] == "running" and s["step"] > 0,
                   LIMIT_S)
        cluster = _cluster(ray_tmp)
        assert len(cluster) >= 4  # the GCS, the raylet, the controller, two workers, ...
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=LIMIT_S)
        # Every process of the cluster ends: none is left running.
        wait_until(lambda: not {p for p in cluster if _running(p)}, LIMIT_S)
        assert not _cluster(ray_tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _cluster(ray_tmp: str) -> set[int]:
    """The processes of the cluster under `ray_tmp`: those that name it (the GCS, the raylet,
    ...) and all below them (Ray's workers rename themselves)."""
    from elastic import reaper

    roots = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                named = ray_tmp.encode() in f.read()
        except OSError:
            continue
        if entry.isdigit() and named and (info := reaper._stat(int(entry))) is not None:
            roots[int(entry)] = info[1]
    return set(reaper.tree(roots))


def _running(pid: int) -> bool:
    """Alive and not a zombie (one that ended and waits for its parent to read its status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
