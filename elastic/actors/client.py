"""Starting a run's controller and reaching it by name from any process on the cluster."""

from __future__ import annotations

import os
import uuid
from typing import Any

import ray

from elastic.actors.controller import NAMESPACE, Outcome, RemoteController, controller_name
from elastic.config import FitConfig
from elastic.errors import RunNotFoundError
from elastic.job import TrainJob


def ensure_ray() -> None:
    """Connects to the current Ray cluster, or starts a local one when none is connected."""
    if not ray.is_initialized():
        ray.init(namespace=NAMESPACE, log_to_driver=os.environ.get("ELASTIC_WORKER_LOGS") == "1")


def new_run_name() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def run_controller(job: TrainJob, config: FitConfig, name: str, run_dir: str) -> Outcome:
    """Starts the controller actor of a run and waits for its outcome."""
    ensure_ray()
    try:
        ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ValueError(f"a run named {name!r} is already running; choose another name")
    controller = RemoteController.options(
        name=controller_name(name), namespace=NAMESPACE, num_cpus=0, max_concurrency=16,
        lifetime=None,
    ).remote(job, config, name, run_dir)
    try:
        return ray.get(controller.run.remote())
    finally:
        ray.kill(controller, no_restart=True)


def find(name: str) -> Any:
    """The controller of run `name`.

    Raises:
        RunNotFoundError: no such run on the connected cluster.
    """
    ensure_ray()
    try:
        return ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError as e:
        raise RunNotFoundError(f"no run named {name!r} on this Ray cluster") from e


def call(name: str, method: str, *args: Any) -> Any:
    """Calls a control method of run `name`'s controller and returns its result."""
    controller = find(name)
    try:
        return ray.get(getattr(controller, method).remote(*args))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
