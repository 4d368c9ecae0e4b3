"""`elastic bench adapt`: one run with one worker slowed down; the step time on the even split
(before the first rebalance) against the step time after rebalancing, measured in the same run.

The slow worker sleeps in proportion to its samples (chaos action 'slow'), so on this machine
it stands for a slower GPU or a busier host. The global batch and the result do not change.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import fit
from elastic.bench import classification_loss, sgd
from elastic.config import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.events import Rebalanced, parse, to_record
from elastic.job import TrainJob


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 3, 16, 16, generator=g)
    return TensorDataset(x, (x.mean((1, 2, 3)) > 0).long())


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 2),
    )



_optimizer = functools.partial(sgd, lr=0.05)


@dataclass
class AdaptBenchResult:
    workers: int
    slow_rank: int
    slow_factor: float
    global_batch_size: int
    even_steps: int
    rebalanced_steps: int
    even_median_s: float
    rebalanced_median_s: float
    ratio: float
    shares_even: list[int]
    shares_rebalanced: list[int]
    rebalances: list[Rebalanced]
    run_dir: str

    def to_json(self) -> dict:
        return {**asdict(self), "rebalances": [to_record(e) for e in self.rebalances]}


def split_by_shares(metrics: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """The step times of a run's steps on the even split (step 0 left out: it warms up) and
    from its first step on other shares on. By the shares each step ran with, not by the
    `rebalanced` event's step: a chunk handed out ahead of the re-split ran on the even
    split, though its steps come after that event's."""
    split = metrics[0]["shares"]
    first = next((m["step"] for m in metrics if m["shares"] != split), None)
    even = [m["step_time_s"] for m in metrics if 0 < m["step"] and (first is None or m["step"] < first)]
    after = [m["step_time_s"] for m in metrics if first is not None and m["step"] >= first]
    return even, after


def run_adapt_bench(workers: int = 4, slow_factor: float = 2.0, steps: int = 64,
                    global_batch_size: int = 256, even_steps: int = 16,
                    run_dir: str | None = None) -> AdaptBenchResult:
    """Runs `steps` steps with the last rank slowed by `slow_factor` from the first step.

    The first `even_steps` steps run on the even split (one chunk: the rebalancer needs
    measurements first); the first step of the run is left out of the even median (warm-up).

    Raises:
        ValueError: fewer than 2 workers, or too few steps to measure both parts.
    """
    if workers < 2:
        raise ValueError("--workers must be at least 2 (one slow rank and the others)")
    if steps < even_steps + 4:
        raise ValueError(f"--steps must be at least {even_steps + 4}")
    directory = run_dir or tempfile.mkdtemp(prefix="elastic-bench-adapt-")
    slow_rank = workers - 1
    config = FitConfig(
        scaling=ScalingConfig(num_workers=workers),
        batch=BatchConfig(global_batch_size=global_batch_size, autotune=False, rebalance=True),
        max_steps=steps, run_dir=directory, steps_per_chunk=even_steps,
        chaos=(ChaosEvent(step=0, rank=slow_rank, action="slow", factor=slow_factor, steps=None),),
    )
    job = TrainJob(model=_model, optimizer=_optimizer, loss=classification_loss, dataset=_dataset)
    result = fit(job, config)
    rebalances = [e for e in map(parse, result.events) if isinstance(e, Rebalanced)]
    if not rebalances:
        raise RuntimeError("the run never rebalanced; the slow-down was not measurable")
    even, after = split_by_shares(result.metrics)
    if not after:
        # Re-splits happen at chunk boundaries (every `even_steps` steps); on a loaded machine
        # the first chunk's measurements may not clear the threshold.
        raise RuntimeError(f"the first re-split came at step {rebalances[0].step}, and no step "
                           f"ran on the new shares. Raise --steps (at least {3 * even_steps})")
    even_median, after_median = statistics.median(even), statistics.median(after)
    return AdaptBenchResult(
        workers=workers, slow_rank=slow_rank, slow_factor=slow_factor,
        global_batch_size=global_batch_size, even_steps=len(even), rebalanced_steps=len(after),
        even_median_s=even_median, rebalanced_median_s=after_median,
        ratio=after_median / even_median, shares_even=result.metrics[0]["shares"],
        shares_rebalanced=result.metrics[-1]["shares"], rebalances=rebalances, run_dir=directory,
    )
