"""`elastic bench recovery`: SIGKILL a random worker at a random moment of its step, many times
in one run, and report every stage of each recovery (detect, abort, rebuild, restore, first
step after).

Recovery never waits for a replacement (the survivors go on at once); replacements start in
the background and join at a later boundary, which is reported separately as `join` events.
"""

from __future__ import annotations

import functools
import random
import statistics
import tempfile
import threading
import uuid
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import events, kill, scale
from elastic.bench import classification_loss, fit_with_operator, sgd, wait_status
from elastic.config import BatchConfig, FailureConfig, FitConfig, ScalingConfig, ShardingConfig
from elastic.events import Recovered, WorkerJoined, parse, to_record
from elastic.job import TrainJob

STAGES = ("detect_s", "abort_s", "rebuild_s", "restore_s", "first_step_s", "total_s")


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2))



_optimizer = functools.partial(sgd, lr=0.05)
_momentum = functools.partial(sgd, lr=0.05, momentum=0.9)


@dataclass(frozen=True)
class StageSummary:
    stage: str
    median_s: float
    max_s: float


@dataclass
class RecoveryBenchResult:
    workers: int
    trials: int
    replace: bool
    recoveries: list[Recovered]
    stages: list[StageSummary]
    joins: int
    work_lost_steps: list[int]
    run_dir: str
    sharding_stage: int = 0
    seed: int = 0

    def to_json(self) -> dict:
        return {"workers": self.workers, "trials": self.trials, "replace": self.replace,
                "sharding_stage": self.sharding_stage, "seed": self.seed,
                "recoveries": [to_record(r) for r in self.recoveries],
                "stages": [asdict(s) for s in self.stages], "joins": self.joins,
                "work_lost_steps": self.work_lost_steps, "run_dir": self.run_dir}


def run_recovery_bench(workers: int, trials: int, seed: int = 0,
                       run_dir: str | None = None, timeout_s: float = 600.0,
                       replace: bool = True, sharding_stage: int = 0) -> RecoveryBenchResult:
    """One run of `workers` workers; `trials` times, once the world is back to `workers`
    (the replacement of the previous kill has joined), a random worker is SIGKILLed at
    whatever phase of the step it is in. With `sharding_stage` 1, the optimizer (SGD with
    momentum then, so that there is state to shard) keeps its state on 2 owners per
    parameter, and each recovery moves the lost worker's parts.

    Raises:
        ValueError: fewer than 2 workers or no trials.
        TimeoutError: the run did not get back to full size within `timeout_s`.
    """
    if workers < 2:
        raise ValueError("--workers must be at least 2 (a kill needs a survivor)")
    if trials < 1:
        raise ValueError("--trials must be at least 1")
    rng = random.Random(seed)
    directory = run_dir or tempfile.mkdtemp(prefix="elastic-bench-recovery-")
    name = f"bench-recovery-{uuid.uuid4().hex[:6]}"
    config = FitConfig(
        name=name, scaling=ScalingConfig(num_workers=workers, min_workers=1),
        failure=FailureConfig(replace_lost_workers=replace),
        batch=BatchConfig(global_batch_size=256), max_steps=10_000_000, run_dir=directory,
        steps_per_chunk=8, sharding=ShardingConfig(stage=sharding_stage),
    )
    optimizer = _momentum if sharding_stage else _optimizer
    job = TrainJob(model=_model, optimizer=optimizer, loss=classification_loss, dataset=_dataset)
    result = fit_with_operator(job, config, lambda finished: _kill_trials(
        name, workers, trials, rng, replace, finished, timeout_s))
    typed = [parse(e) for e in result.events]
    recoveries = [e for e in typed if isinstance(e, Recovered)]
    return RecoveryBenchResult(
        workers=workers, trials=trials, replace=replace, recoveries=recoveries,
        stages=_stages(recoveries), joins=sum(isinstance(e, WorkerJoined) for e in typed),
        work_lost_steps=[r.work_lost_steps for r in recoveries], run_dir=directory,
        sharding_stage=sharding_stage, seed=seed,
    )


def _kill_trials(name: str, workers: int, trials: int, rng: random.Random, replace: bool,
                 finished: threading.Event, timeout_s: float) -> None:
    """The operator of the bench: `trials` kills, each once the run is back to `workers`;
    returns once the last recovery is recorded."""
    for trial in range(trials):
        current = wait_status(name, finished, timeout_s, lambda s, t=trial: (
            s["state"] == "running" and s["world_size"] == workers
            and s["failures"] == t and s["step"] > 0))
        kill(name, rng.randrange(current["world_size"]))
        if not replace:
            # No replacement starts while the survivors recover; once they have, the
            # operator scales back up for the next trial.
            wait_status(name, finished, timeout_s, lambda s, t=trial: (
                s["failures"] == t + 1 and s["state"] == "running"
                and s["world_size"] == workers - 1 and s["starting_workers"] == 0))
            scale(name, workers)
    wait_status(name, finished, timeout_s, lambda s: s["failures"] == trials
                 and s["state"] == "running" and s["generation"] > 0)
    # The last recovery is recorded at its first completed step.
    wait_status(name, finished, timeout_s, lambda s: sum(
        isinstance(parse(e), Recovered) for e in events(name)) == trials)


def _stages(recoveries: list[Recovered]) -> list[StageSummary]:
    """Median and maximum of each stage over the recoveries that timed it."""
    stages = []
    for stage in STAGES:
        values = [getattr(r, stage) for r in recoveries if getattr(r, stage) is not None]
        if values:
            stages.append(StageSummary(stage, statistics.median(values), max(values)))
    return stages
