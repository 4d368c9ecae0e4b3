"""A detached run outlives the process that started it."""

import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import elastic
from elastic.events import (
    DetachedExit,
    FinalModelWritten,
    Finish,
    Resized,
    ScaleRequested,
    StopRequested,
    WorkerFailure,
    read_events,
)
from tests.events import kinds
from tests.jobs import reference_weights

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]

DRIVER = """
import sys
import ray
import elastic
from tests.jobs import regression_job

ray.init(address=sys.argv[1], namespace="elastic", log_to_driver=False)
config = elastic.FitConfig(
    scaling=elastic.ScalingConfig(num_workers=2), batch=elastic.BatchConfig(global_batch_size=16),
    max_steps=12, name=sys.argv[2], run_dir=sys.argv[3],
)
print(elastic.start(regression_job(), config))
"""


def _wait_until(predicate, limit=120.0):
    done = threading.Event()
    timer = threading.Timer(limit, done.set)
    timer.start()
    try:
        while not done.is_set():
            if predicate():
                return
            done.wait(0.1)
    finally:
        timer.cancel()
    raise TimeoutError("condition not reached")


def test_a_detached_run_finishes_after_its_driver_exits(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    run_dir = tmp_path / "run"
    name = "detached-run"
    driver = subprocess.run([sys.executable, "-c", DRIVER, address, name, str(run_dir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert driver.returncode == 0, driver.stderr[-2000:]
    assert driver.stdout.strip().splitlines()[-1] == name
    # The driver is gone; the run goes on and leaves its record when it ends.
    _wait_until(lambda: elastic.status(name)["state"] in ("finished", "stopped"))
    order = kinds(read_events(run_dir))
    assert Finish in order
    assert order[-1] is DetachedExit
    model = torch.load(run_dir / "final_model.pt", weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, 12), rtol=1e-9, atol=1e-10)


def _status_when(name, predicate):
    box = {}

    def check():
        try:
            status = elastic.status(name)
        except elastic.errors.RunNotFoundError:
            return False
        box["status"] = status
        return predicate(status)

    _wait_until(check)
    return box["status"]


def test_the_detached_lifecycle_through_the_cli(ray_cluster, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    cli = CliRunner()
    address = ray_cluster.get_runtime_context().gcs_address
    run_dir = tmp_path / "run"
    name = "lifecycle-run"
    driver = DRIVER.replace("max_steps=12", "max_steps=10_000_000").replace(
        "ScalingConfig(num_workers=2)", "ScalingConfig(num_workers=2, min_workers=1, max_workers=3)")
    started = subprocess.run([sys.executable, "-c", driver, address, name, str(run_dir)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert started.returncode == 0, started.stderr[-2000:]
    assert name in cli.invoke(app, ["list"]).output
    _status_when(name, lambda s: s["state"] == "running" and s["world_size"] == 2)

    assert cli.invoke(app, ["scale", name, "3"]).exit_code == 0
    _status_when(name, lambda s: s["world_size"] == 3 and s["state"] == "running")
    assert cli.invoke(app, ["scale", name, "2"]).exit_code == 0
    before = _status_when(name, lambda s: s["world_size"] == 2 and s["state"] == "running")
    assert cli.invoke(app, ["kill", name, "--rank", "1"]).exit_code == 0
    _status_when(name, lambda s: s["failures"] == 1 and s["world_size"] == 2
                 and s["generation"] > before["generation"] + 1 and s["state"] == "running")
    logs = cli.invoke(app, ["logs", name])
    assert "killed rank 1 on purpose" in logs.output
    assert cli.invoke(app, ["status", name, "--json"]).exit_code == 0
    assert cli.invoke(app, ["stop", name]).exit_code == 0
    _wait_until(lambda: elastic.status(name)["state"] in ("finished", "stopped"))

    events = read_events(run_dir)
    order = kinds(events)
    for cls in (ScaleRequested, Resized, WorkerFailure, StopRequested, Finish, FinalModelWritten,
                DetachedExit):
        assert cls in order, cls.kind
    finish = next(e for e in events if isinstance(e, Finish))
    assert finish.stopped is True
    model = torch.load(run_dir / "final_model.pt", weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, finish.step), rtol=1e-9, atol=1e-10)


def test_a_detached_run_is_refused_on_another_processs_local_cluster(ray_cluster, tmp_path):
    # A cluster another `elastic run` (or a script's `fit`) started for itself ends with that
    # process, and every run on it: before, `elastic start` found it (Ray's search of this
    # machine's processes) and started a detached run there, which died with that process.
    from ray.experimental import internal_kv

    from elastic.actors import client

    internal_kv._internal_kv_put(client.THROWAWAY_KEY, b"4242", namespace=client.NAMESPACE)
    try:
        assert client.throwaway_owner() == 4242
        config = elastic.FitConfig(scaling=elastic.ScalingConfig(num_workers=1),
                                   batch=elastic.BatchConfig(global_batch_size=8), max_steps=2,
                                   name="on-a-throwaway", run_dir=str(tmp_path / "run"))
        from tests.jobs import regression_job

        with pytest.raises(elastic.errors.ConfigError,
                           match=r"the local cluster of process 4242 .* ends with it"):
            elastic.start(regression_job(), config)
        assert "on-a-throwaway" not in client.live_run_names()
        # This process's own mark is not another's.
        internal_kv._internal_kv_put(client.THROWAWAY_KEY, str(os.getpid()).encode(),
                                     namespace=client.NAMESPACE)
        assert client.throwaway_owner() is None
    finally:
        internal_kv._internal_kv_del(client.THROWAWAY_KEY, namespace=client.NAMESPACE)
