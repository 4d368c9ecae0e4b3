"""The controller of a detached run dies: Ray restarts it, it resumes from the newest
checkpoint, and the run completes with the reference weights."""

import threading

import pytest
import ray
import torch

import elastic
from elastic import BatchConfig, CheckpointConfig, FitConfig, ScalingConfig
from elastic.actors.controller import NAMESPACE, controller_name
from elastic.events import (
    CheckpointWritten,
    ControllerRestarted,
    DetachedExit,
    Failed,
    Finish,
    Resumed,
    Start,
    read_events,
)
from tests.events import kinds, of_kind
from tests.jobs import reference_weights, regression_job

pytestmark = pytest.mark.fault


def _wait_until(predicate, limit=120.0):
    done = threading.Event()
    timer = threading.Timer(limit, done.set)
    timer.start()
    try:
        while not done.is_set():
            if predicate():
                return
            done.wait(0.05)
    finally:
        timer.cancel()
    raise TimeoutError("condition not reached")


def _events(run_dir):
    # The file, not the folder: polled before the run has made either (no file: no events).
    return read_events(run_dir / "events.jsonl")


def test_a_killed_controller_restarts_and_resumes_from_the_checkpoint(ray_cluster, tmp_path):
    name, run_dir = "controller-dies", tmp_path / "run"
    config = FitConfig(
        name=name, run_dir=str(run_dir), max_steps=600, steps_per_chunk=2,
        scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=16),
        checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=4),
    )
    elastic.start(regression_job(), config)
    _wait_until(lambda: any(isinstance(e, CheckpointWritten) for e in _events(run_dir)))
    before = elastic.status(name)
    assert before["state"] == "running"
    ray.kill(ray.get_actor(controller_name(name), namespace=NAMESPACE), no_restart=False)
    _wait_until(lambda: any(isinstance(e, DetachedExit) for e in _events(run_dir)), limit=240)

    events = _events(run_dir)
    order = kinds(events)
    assert order.count(ControllerRestarted) == 1
    restart = order.index(ControllerRestarted)
    resumed = of_kind(events[restart:], Resumed)
    assert len(resumed) == 1 and 0 < resumed[0].step <= 600
    finish = next(e for e in events if isinstance(e, Finish))
    assert finish.step == 600 and not finish.stopped
    assert order[-1] is DetachedExit
    model = torch.load(run_dir / "final_model.pt", weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, 600), rtol=1e-9, atol=1e-10)


def test_a_restarted_controller_without_checkpoints_fails_instead_of_starting_over(ray_cluster,
                                                                                   tmp_path):
    name, run_dir = "controller-dies-no-ckpt", tmp_path / "run"
    config = FitConfig(name=name, run_dir=str(run_dir), max_steps=100_000, steps_per_chunk=2,
                       scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=16))
    elastic.start(regression_job(), config)
    _wait_until(lambda: elastic.status(name)["step"] > 4)
    ray.kill(ray.get_actor(controller_name(name), namespace=NAMESPACE), no_restart=False)
    _wait_until(lambda: any(isinstance(e, DetachedExit) for e in _events(run_dir)), limit=240)
    events = _events(run_dir)
    failed = of_kind(events, Failed)
    assert len(failed) == 1 and "no checkpoints to resume from" in failed[0].error
    assert kinds(events).count(Start) == 1  # it did not start over
