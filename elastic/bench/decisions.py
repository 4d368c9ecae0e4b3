"""`elastic bench decisions`: what the controller's own work costs per step as the world grows.

The whole control loop (states, decisions, failure policy, batching, metrics and events) runs
against simulated members (`elastic.control.simulation`), through a run with failures,
replacements joining and a resize. The time spent inside the simulation is subtracted, so what
is reported is the controller's decision time per step, at each world size.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from elastic.config import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.control.context import Context
from elastic.control.simulation import SimulatedWorkers
from elastic.control.states import Finished, Machine
from elastic.runlog import RunLog

PER_RANK = 4


@dataclass(frozen=True)
class DecisionBenchRow:
    members: int
    steps: int
    chunks: int
    failures: int
    generations: int
    decision_ms_per_step: float
    decision_ms_per_chunk: float
    simulation_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Timed:
    """The simulation with the time spent in each of its calls accumulated."""

    def __init__(self, inner: SimulatedWorkers) -> None:
        self.inner = inner
        self.spent = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return value(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed


def run_once(members: int, steps: int, chunk: int = 4) -> DecisionBenchRow:
    """One simulated run of `steps` steps at `members` members: two losses, their
    replacements joining, a shrink by a quarter and a grow back.

    Raises:
        ValueError: fewer than 4 members or 16 steps.
    """
    if members < 4 or steps < 16:
        raise ValueError("the decision bench needs at least 4 members and 16 steps")
    third = steps // 3
    kills = (ChaosEvent(step=third // 2, rank=members // 2, action="kill"),
             ChaosEvent(step=2 * third + 1, rank=0, action="kill"))
    ctx: Context | None = None

    def requests(step: int) -> None:
        assert ctx is not None
        with ctx.requests.lock:
            if third <= step < 2 * third:
                ctx.requests.target, ctx.requests.scaled_by_user = members - members // 4, True
            elif step >= 2 * third:
                ctx.requests.target = members

    with tempfile.TemporaryDirectory(prefix="elastic-bench-decisions-") as run_dir:
        sim = _Timed(SimulatedWorkers(dataset_size=members * PER_RANK * (steps + 1),
                                      capacity=members, start_delay_s=0.01,
                                      before_chunk=requests))
        config = FitConfig(run_dir=run_dir, max_steps=steps, steps_per_chunk=chunk, chaos=kills,
                           scaling=ScalingConfig(num_workers=members,
                                                 min_workers=max(1, members // 2),
                                                 max_workers=members),
                           batch=BatchConfig(global_batch_size=members * PER_RANK))
        ctx = Context(config, "bench", RunLog(run_dir), sim)  # type: ignore[arg-type]
        start = time.perf_counter()
        end = Machine(ctx).run()
        total = time.perf_counter() - start
        ctx.log.close()
    if not isinstance(end, Finished):
        raise RuntimeError(f"the simulated run did not finish: {getattr(end, 'error', end)}")
    decision = total - sim.spent
    chunks = sim.inner.chunks
    return DecisionBenchRow(
        members=members, steps=ctx.step, chunks=chunks, failures=ctx.policy.workers_lost,
        generations=ctx.generation + 1, decision_ms_per_step=1e3 * decision / ctx.step,
        decision_ms_per_chunk=1e3 * decision / chunks, simulation_s=sim.spent)


def run_decision_bench(members: Sequence[int] = (4, 64, 256, 1024), steps: int = 64,
                       progress: Callable[[int], None] | None = None) -> list[DecisionBenchRow]:
    """`run_once` at each world size in `members` (`progress` is told each size first)."""
    rows = []
    for n in members:
        if progress is not None:
            progress(n)
        rows.append(run_once(n, steps))
    return rows
