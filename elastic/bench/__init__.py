"""Benchmarks behind `elastic bench ...`: each returns a result the CLI prints and saves."""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pathlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

if TYPE_CHECKING:
    from elastic.config import FitConfig
    from elastic.job import TrainJob
    from elastic.result import FitResult


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The benchmarks' loss: cross-entropy of `model(inputs)` against integer labels."""
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def sgd(params, lr: float = 0.01, momentum: float = 0.0) -> torch.optim.Optimizer:
    """The benchmarks' optimizer (bind `lr`/`momentum` with functools.partial)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def leave_ddp(out: str, rank: int) -> None:
    """The end of a DDP baseline rank (`run_ddp`): both ranks leave together (a rank tearing
    its connections down while another still works made gloo abort that one), and say that
    their work is over before they tear down."""
    dist.barrier()
    pathlib.Path(f"{out}.done{rank}").touch()
    dist.destroy_process_group()


def run_ddp(worker: Callable[..., None], args: tuple[Any, ...], workers: int, out: str,
            grace_s: float = 60.0) -> None:
    """Runs `worker(rank, *args)` in `workers` spawned processes, each ending with
    `leave_ddp(out, rank)`. Gloo can still abort a rank (SIGABRT) while the ranks tear their
    connections down after the barrier (seen in CI): once every rank's work is over, the
    results in `out` stand. A rank that ends before its work is over fails the benchmark
    (`mp.ProcessException`, with the rank's traceback if it raised) and the others are killed.

    Each process is waited on by itself, not with torch's `join`, which terminates the others
    the moment one exits non-zero (before they could say that their work is over). Once one
    has ended, the others get `grace_s` to end too."""
    context = mp.start_processes(worker, args=args, nprocs=workers, join=False, start_method="spawn")
    running = dict(enumerate(context.processes))
    try:
        while running:
            ready = multiprocessing.connection.wait(
                [p.sentinel for p in running.values()], None if len(running) == workers else grace_s)
            if not ready:
                break  # stuck leaving: their work may be over all the same (checked below)
            for rank, process in list(running.items()):
                if process.sentinel in ready:
                    process.join()
                    del running[rank]
                    if process.exitcode != 0 and not os.path.exists(f"{out}.done{rank}"):
                        _failed(context, rank)
    finally:
        for process in running.values():
            process.kill()
            process.join()
    for rank in range(workers):
        if not os.path.exists(f"{out}.done{rank}"):
            _failed(context, rank)


def _failed(context: Any, rank: int) -> None:
    """Raises what ended DDP baseline rank `rank` before its work was over."""
    process = context.processes[rank]
    error_file = context.error_files[rank]
    if error_file and os.path.exists(error_file) and os.path.getsize(error_file):
        with open(error_file, "rb") as fh:
            trace = pickle.load(fh)
        raise mp.ProcessRaisedException(f"DDP baseline rank {rank} raised:\n{trace}", rank, process.pid)
    raise mp.ProcessExitedException(
        f"DDP baseline rank {rank} ended (exit code {process.exitcode}) before its work was over",
        error_index=rank, error_pid=process.pid, exit_code=process.exitcode or 0)


def fit_with_operator(job: TrainJob, config: FitConfig,
                      operate: Callable[[threading.Event], None]) -> FitResult:
    """`elastic.fit(job, config)` with `operate(finished)` beside it on a thread (the bench's
    operator: kills, SIGTERMs, scale requests); the run is stopped once `operate` returns, and
    an error of `operate` is raised after the run ended. `finished` is set when the run has
    ended (an operator waiting on the run gives up then)."""
    from elastic.api import fit, stop
    from elastic.errors import RunNotFoundError

    assert config.name is not None, "the operator finds the run by its name"
    errors: list[BaseException] = []
    finished = threading.Event()

    def operator() -> None:
        try:
            operate(finished)
        except BaseException as e:
            errors.append(e)
        finally:
            with contextlib.suppress(RunNotFoundError):
                stop(config.name)

    thread = threading.Thread(target=operator, daemon=True)
    thread.start()
    try:
        result = fit(job, config)
    finally:
        finished.set()
        thread.join()
    if errors:
        raise errors[0]
    return result


def wait_status(name: str, finished: threading.Event, timeout_s: float,
                predicate: Callable[[dict], bool]) -> dict:
    """Polls run `name`'s status until `predicate` holds; returns that status.

    Raises:
        TimeoutError: not within `timeout_s`, or the run ended first (`finished`).
    """
    from elastic.api import status
    from elastic.errors import RunNotFoundError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not finished.is_set():
        try:
            current = status(name)
        except RunNotFoundError:
            current = None
        if current is not None and predicate(current):
            return current
        finished.wait(0.01)
    raise TimeoutError(f"run {name} did not reach the expected state within {timeout_s}s")
