"""`elastic bench preemption`: planned departures and hot spares, timed on real workers.

For each spare count asked for, one run of `workers` workers and that many spares; the
operator repeats `trials` times, each time once the run is back at full size (and its spares
are ready):

1. SIGTERM to a random worker's process (what a scheduler sends with a grace period): timed
   from the signal to the worker gone (`PlannedDeparture`) and to the first step committed
   without it; the steps redone (0 is the promise).
2. SIGKILL of a random worker (`elastic kill`): timed from the kill to the first step
   committed at full size again - by a spare in the recovery itself, or by a cold replacement
   that joins later.

Before the first fault, once the run is at full size with its spares ready, the run's steady
steps are timed, and with a spare, the spare's process is sampled for CPU and memory while it
waits: the cost of keeping a spare.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from elastic.api import connect, kill, status
from elastic.bench import classification_loss, fit_with_operator, sgd, wait_status
from elastic.bench.recovery import _dataset, _model
from elastic.config import BatchConfig, FitConfig, ScalingConfig
from elastic.events import PlannedDeparture, parse
from elastic.job import TrainJob

_STEADY_STEPS = 40  # steps timed before the first fault (after the first generation's first)
_IDLE_S = 2.0  # how long an idle spare's process is sampled


@dataclass(frozen=True)
class Summary:
    median_s: float
    max_s: float

    @staticmethod
    def of(values: list[float]) -> Summary | None:
        return Summary(statistics.median(values), max(values)) if values else None


@dataclass
class SpareCost:
    """What a waiting spare costs: its process's CPU (fraction of one core) and resident
    memory while it waits."""

    cpu_fraction: float
    rss_mb: float


@dataclass
class PreemptionRun:
    """One run's figures (`spares` spares)."""

    spares: int
    sigterm_to_gone_s: list[float] = field(default_factory=list)
    sigterm_to_next_step_s: list[float] = field(default_factory=list)
    steps_redone: list[int] = field(default_factory=list)
    kill_to_full_size_s: list[float] = field(default_factory=list)
    steady_step_s: float = 0.0
    spare_cost: SpareCost | None = None
    run_dir: str = ""

    def to_json(self) -> dict:
        record = asdict(self)
        for key in ("sigterm_to_gone_s", "sigterm_to_next_step_s", "kill_to_full_size_s"):
            summary = Summary.of(getattr(self, key))
            record[key.removesuffix("_s") + "_summary"] = asdict(summary) if summary else None
        return record


@dataclass
class PreemptionBenchResult:
    workers: int
    trials: int
    runs: list[PreemptionRun]

    def to_json(self) -> dict:
        return {"workers": self.workers, "trials": self.trials,
                "runs": [r.to_json() for r in self.runs]}


def run_preemption_bench(workers: int, spares: list[int], trials: int, seed: int = 0,
                         timeout_s: float = 600.0) -> PreemptionBenchResult:
    """One run per entry of `spares` (see the module's docstring).

    Raises:
        ValueError: fewer than 2 workers, no trials, or a negative spare count.
        TimeoutError: a run did not get back to full size within `timeout_s`.
    """
    if workers < 2:
        raise ValueError("--workers must be at least 2 (a departure needs someone to stay)")
    if trials < 1:
        raise ValueError("--trials must be at least 1")
    if not spares or min(spares) < 0:
        raise ValueError("--spares: one or more counts, each 0 or more")
    # One local cluster for every run, with room for the most spares asked for.
    connect(FitConfig(scaling=ScalingConfig(num_workers=workers, spares=max(spares)),
                      batch=BatchConfig(global_batch_size=workers), max_steps=1))
    runs = [_one_run(workers, count, trials, random.Random(seed), timeout_s) for count in spares]
    return PreemptionBenchResult(workers=workers, trials=trials, runs=runs)


def _one_run(workers: int, spares: int, trials: int, rng: random.Random,
             timeout_s: float) -> PreemptionRun:
    directory = tempfile.mkdtemp(prefix="elastic-bench-preemption-")
    name = f"bench-preemption-{uuid.uuid4().hex[:6]}"
    config = FitConfig(
        name=name, scaling=ScalingConfig(num_workers=workers, min_workers=1, spares=spares),
        batch=BatchConfig(global_batch_size=256), max_steps=10_000_000, run_dir=directory,
        steps_per_chunk=8)
    job = TrainJob(model=_model, optimizer=functools.partial(sgd, lr=0.05),
                   loss=classification_loss, dataset=_dataset)
    out = PreemptionRun(spares=spares, run_dir=directory)
    # Times (and generations) of the signals sent; where the steady steps start.
    marks: dict[str, list] = {"sigterm": [], "kill": [], "steady": []}

    def full(s: dict) -> bool:
        return (s["state"] == "running" and s["world_size"] == workers
                and s["joining_workers"] == 0 and s.get("spare_workers", 0) == spares)

    def operate(finished: threading.Event) -> None:
        def wait(predicate: Callable[[dict], bool]) -> dict:
            return wait_status(name, finished, timeout_s, predicate)

        first = wait(lambda s: full(s) and s["step"] > 0)
        marks["steady"].append((first["step"], first["generation"]))
        wait(lambda s: s["step"] > first["step"] + _STEADY_STEPS)
        if spares:
            spare = status(name)["spares"][0]
            out.spare_cost = _sample(spare["pid"], _IDLE_S)
        for trial in range(trials):
            current = wait(lambda s, t=trial: full(s) and s["preemptions"] == t and s["step"] > 0)
            pid = current["workers"][rng.randrange(workers)]["pid"]
            marks["sigterm"].append(time.time())
            os.kill(pid, signal.SIGTERM)
            current = wait(lambda s, t=trial: full(s) and s["preemptions"] == t + 1
                           and s["failures"] == t)
            marks["kill"].append((time.time(), current["generation"]))
            kill(name, rng.randrange(workers))
            wait(lambda s, t=trial, at=current["step"]: full(s) and s["failures"] == t + 1
                 and s["step"] > at + 2)

    result = fit_with_operator(job, config, operate)
    events = [parse(e) for e in result.events]
    metrics = result.metrics
    # Once the run and its spares are up (a spare still starting takes a core from the steps).
    start, generation = marks["steady"][0] if marks["steady"] else (0, 0)
    steady = [m["step_time_s"] for m in metrics if m["generation"] == generation
              and start < m["step"] <= start + _STEADY_STEPS]
    out.steady_step_s = statistics.median(steady) if steady else 0.0
    departures = [e for e in events if isinstance(e, PlannedDeparture)]
    for sent, departure in zip(marks["sigterm"], departures, strict=False):
        assert departure.time is not None
        out.sigterm_to_gone_s.append(departure.time - sent)
        out.steps_redone.append(departure.steps_redone)
        after = [m for m in metrics if m["step"] == departure.step]
        if after:
            out.sigterm_to_next_step_s.append(after[0]["time"] - sent)
    for sent, generation in marks["kill"]:
        # The first step at full size in a generation formed after the kill: the recovery's
        # own with a spare, else the one the cold replacement joins.
        back = [m for m in metrics if m["time"] > sent and m["world_size"] == workers
                and m["generation"] > generation]
        if back:
            out.kill_to_full_size_s.append(back[0]["time"] - sent)
    return out


def _sample(pid: int, seconds: float) -> SpareCost:
    """CPU (fraction of one core) and resident memory of process `pid` over `seconds`."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    start, t0 = cpu(), time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronisation
    used, elapsed = cpu() - start, time.monotonic() - t0
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return SpareCost(cpu_fraction=used / elapsed, rss_mb=rss_kb / 1024)
