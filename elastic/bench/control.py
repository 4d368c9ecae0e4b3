"""`elastic bench control`: how long the control commands take, as a user types them.

Each of `elastic status`, `list`, `scale`, `kill` and `stop` is run `calls` times as a
separate process (the `elastic` command, Python start-up and imports included) against a
live run on the local cluster; `status` and `list` also from Python, in the process that runs
the cluster. Besides the answer, it measures what a user waits for after `elastic scale`: the
time to the first completed step at the new size (down at the next boundary; up once a new
worker has started and joined).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import connect, fit, runs, scale, status, stop
from elastic.bench import classification_loss, sgd
from elastic.config import BatchConfig, FitConfig, ScalingConfig
from elastic.errors import RunNotFoundError
from elastic.job import TrainJob
from elastic.runlog import read_jsonl

COMMANDS = ("status", "list", "scale", "kill", "stop")


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


@dataclass(frozen=True)
class CommandTiming:
    command: str
    calls: int
    cli_median_s: float
    cli_max_s: float
    python_median_s: float | None


@dataclass
class ControlBenchResult:
    calls: int
    commands: list[CommandTiming]
    scale_down_to_step_s: list[float]
    scale_up_to_step_s: list[float]
    run_dir: str

    def to_json(self) -> dict:
        return {"calls": self.calls, "commands": [asdict(c) for c in self.commands],
                "scale_down_to_step_s": self.scale_down_to_step_s,
                "scale_up_to_step_s": self.scale_up_to_step_s, "run_dir": self.run_dir}


def _config(name: str, run_dir: str, workers: int) -> FitConfig:
    return FitConfig(name=name, scaling=ScalingConfig(num_workers=workers, min_workers=1, max_workers=3),
                     batch=BatchConfig(global_batch_size=64, max_micro_batch=64, autotune=False),
                     max_steps=100_000_000, run_dir=run_dir, steps_per_chunk=4)


class _Run:
    """A long run of the bench job, trained by `fit` on a thread of this process."""

    def __init__(self, directory: str, workers: int, timeout_s: float) -> None:
        self.name = f"bench-control-{uuid.uuid4().hex[:6]}"
        self.run_dir = os.path.join(directory, self.name)
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.ended = threading.Event()
        config = _config(self.name, self.run_dir, workers)
        job = TrainJob(model=_model, optimizer=sgd, loss=classification_loss, dataset=_dataset)
        self.thread = threading.Thread(target=self._fit, args=(job, config), daemon=True)
        self.thread.start()

    def _fit(self, job: TrainJob, config: FitConfig) -> None:
        try:
            fit(job, config)
        except BaseException as e:
            self.error = e
        finally:
            self.ended.set()

    def wait(self, predicate: Callable[[dict], bool]) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self.ended.is_set():
            try:
                current = status(self.name)
            except RunNotFoundError:
                current = None
            if current is not None and current["state"] == "running" and predicate(current):
                return current
            self.ended.wait(0.01)
        raise TimeoutError(f"run {self.name} did not reach the expected state within "
                           f"{self.timeout_s}s" + (f": {self.error}" if self.error else ""))

    def first_step_at(self, world_size: int, after: float) -> float:
        """End time of the first step at `world_size` that started after `after`."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self.ended.is_set():
            for m in read_jsonl(os.path.join(self.run_dir, "metrics.jsonl")):
                if m["world_size"] == world_size and m["time"] - m["step_time_s"] > after:
                    return m["time"]
            self.ended.wait(0.02)
        raise TimeoutError(f"no step at {world_size} workers in run {self.name}")

    def finish(self) -> None:
        with contextlib.suppress(RunNotFoundError):
            stop(self.name)
        self.thread.join(self.timeout_s)


def run_control_bench(calls: int = 20, timeout_s: float = 300.0,
                      run_dir: str | None = None) -> ControlBenchResult:
    """Times `calls` calls of each control command (see the module docstring).

    Raises:
        ValueError: fewer than 1 call.
        TimeoutError: a run did not reach the state a command needs within `timeout_s`.
    """
    if calls < 1:
        raise ValueError("--calls must be at least 1")
    directory = run_dir or tempfile.mkdtemp(prefix="elastic-bench-control-")
    # The runs train on threads; a local cluster must be started from this (the main)
    # thread: Ray's processes die with the thread that started them (PR_SET_PDEATHSIG).
    connect(_config("bench-control", directory, 2))
    cli_times: dict[str, list[float]] = {c: [] for c in COMMANDS}
    py_times: dict[str, list[float]] = {c: [] for c in COMMANDS}
    down: list[float] = []
    up: list[float] = []
    run = _Run(directory, workers=2, timeout_s=timeout_s)
    try:
        # Pinned at 2 (a run grows into free capacity up to max_workers until a user scales it).
        run.wait(lambda s: s["step"] > 0)
        scale(run.name, 2)
        run.wait(lambda s: s["world_size"] == 2 and s["starting_workers"] == 0)
        for _ in range(calls):
            cli_times["status"].append(_cli("status", run.name))
            cli_times["list"].append(_cli("list"))
            py_times["status"].append(_timed(lambda: status(run.name)))
            py_times["list"].append(_timed(runs))
        for i in range(calls):
            # Up to 3 and back to 2, alternately; each time until the first step at that size.
            target, before = (3, 2) if i % 2 == 0 else (2, 3)
            run.wait(lambda s, b=before: s["world_size"] == b and s["starting_workers"] == 0)
            asked = time.time()
            cli_times["scale"].append(_cli("scale", run.name, str(target)))
            (up if target > before else down).append(run.first_step_at(target, asked) - asked)
        if calls % 2:  # an odd count ended at 3: back to 2 for the kills (not timed)
            scale(run.name, 2)
        for i in range(calls):
            # Rank 1 of 2 each time, once its replacement of the previous kill has joined.
            run.wait(lambda s, i=i: s["failures"] == i and s["world_size"] == 2
                     and s["starting_workers"] == 0)
            cli_times["kill"].append(_cli("kill", run.name, "--rank", "1"))
    finally:
        run.finish()
    if run.error is not None:
        raise run.error
    # stop ends a run: one run per call.
    for _ in range(calls):
        run = _Run(directory, workers=1, timeout_s=timeout_s)
        try:
            run.wait(lambda s: s["step"] > 0)
            cli_times["stop"].append(_cli("stop", run.name))
        finally:
            run.finish()
    commands = [CommandTiming(c, len(cli_times[c]), statistics.median(cli_times[c]), max(cli_times[c]),
                              statistics.median(py_times[c]) if py_times[c] else None)
                for c in COMMANDS]
    return ControlBenchResult(calls=calls, commands=commands, scale_down_to_step_s=down,
                              scale_up_to_step_s=up, run_dir=directory)


def _elastic_command() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "elastic")
    return [beside] if os.path.exists(beside) else [shutil.which("elastic") or "elastic"]


def _cli(*args: str) -> float:
    """Seconds one `elastic ARGS` process takes, start to exit.

    Raises:
        RuntimeError: the command failed.
    """
    start = time.perf_counter()
    done = subprocess.run([*_elastic_command(), *args], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"`elastic {' '.join(args)}` failed: {done.stdout[-500:]}{done.stderr[-500:]}")
    return took


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start
