"""The public Python API: `fit` and run control by name. The CLI is a thin layer over this."""

from __future__ import annotations

import os
from typing import Any

from elastic.actors import client
from elastic.checkpoint import LoadedCheckpoint
from elastic.checkpoint import load_checkpoint as _load_checkpoint
from elastic.config import FitConfig
from elastic.job import TrainJob
from elastic.result import FitResult


def fit(job: TrainJob, config: FitConfig) -> FitResult:
    """Trains `job` data-parallel on Ray workers, through failures and resizes.

    Uses the connected Ray cluster, or starts a local one.

    Raises:
        UserCodeError: user code kept raising past `failure.max_user_retries`.
        InsufficientWorkersError: fewer than `scaling.min_workers` workers for too long.
        StartupTimeoutError: the workers did not start in time.
        ConfigError: the job cannot be built (a factory raised or returned the wrong type).
        WorkerOutOfMemoryError: a worker ran out of memory even at micro-batch 1.
    """
    if not isinstance(job, TrainJob):
        raise TypeError(f"fit needs an elastic.TrainJob, got {type(job).__name__}")
    name = config.name or client.new_run_name()
    run_dir = os.path.abspath(config.run_dir or os.path.join("runs", name))
    outcome = client.run_controller(job, config, name, run_dir)
    if outcome.error is not None:
        raise outcome.error
    assert outcome.model_state is not None
    return FitResult(
        name=name, run_dir=run_dir, model_state=outcome.model_state, steps=outcome.steps,
        samples=outcome.samples, events=outcome.events, metrics=outcome.metrics,
        evaluation=outcome.evaluation, stopped=outcome.stopped,
    )


def start(job: TrainJob, config: FitConfig) -> str:
    """Starts a detached run and returns its name at once. The run survives the exit of this
    process; control it by name, read its record in its run dir (events.jsonl,
    metrics.jsonl, and `final_model.pt` when it finishes).

    Raises:
        ConfigError: no Ray cluster is running, or the name is taken.
    """
    if not isinstance(job, TrainJob):
        raise TypeError(f"start needs an elastic.TrainJob, got {type(job).__name__}")
    name = config.name or client.new_run_name()
    run_dir = os.path.abspath(config.run_dir or os.path.join("runs", name))
    client.start_detached(job, config.model_copy(update={"name": name}), name, run_dir)
    return name


def runs() -> list[str]:
    """Names of the live runs on the connected cluster (none if no cluster is running)."""
    return client.list_runs()


def events(name: str) -> list[dict[str, Any]]:
    """The events of live run `name` so far.

    Raises:
        RunNotFoundError: no such run.
    """
    return client.call(name, "events")


def status(name: str) -> dict[str, Any]:
    """A snapshot of run `name`: state, step, world size, workers.

    Raises:
        RunNotFoundError: no such run.
    """
    return client.call(name, "status")


def scale(name: str, num_workers: int) -> None:
    """Grows or shrinks run `name` at its next step boundary, within [min, max] workers.

    Raises:
        RunNotFoundError: no such run.
        ConfigError: outside the run's bounds.
    """
    client.call(name, "scale", num_workers)


def kill(name: str, rank: int) -> None:
    """Kills the worker at `rank` of run `name` (a drill: the run recovers).

    Raises:
        RunNotFoundError: no such run.
        ConfigError: no such rank.
    """
    client.call(name, "kill", rank)


def stop(name: str) -> None:
    """Stops run `name` gracefully at its next step boundary.

    Raises:
        RunNotFoundError: no such run.
    """
    client.call(name, "stop")


def load_checkpoint(path: str, step: int | None = None) -> LoadedCheckpoint | None:
    """The newest checkpoint under `path` whose manifest and checksums verify (or exactly
    `step`); None if there is none. `parts["model"]` is the model's state dict.

    Raises:
        CheckpointCorruptError: `step` was given and that checkpoint does not verify, or
            holds a pickle that would run code (it is refused, never executed).
    """
    return _load_checkpoint(path, step)
