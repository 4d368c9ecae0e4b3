"""Heterogeneity-aware shares: measure each worker's throughput, give the fast ones more.

A step lasts as long as its slowest rank's compute plus the allreduce. With shares
proportional to measured throughput every rank's compute takes about as long, so a worker
twice as slow gets about half the samples. Shares change only when the predicted compute time
drops by a threshold (noise on a shared machine must not make the plan flap), and never change
the math.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic.adapt.plan import apportion


class ThroughputTracker:
    """Exponentially weighted samples per second of compute (data, forward, backward), per
    worker id."""

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
        self.alpha = alpha
        self._rates: dict[int, float] = {}
        self._counts: dict[int, int] = {}

    def observe(self, worker_id: int, samples: int, seconds: float) -> None:
        if samples <= 0 or seconds <= 0:
            return
        rate = samples / seconds
        old = self._rates.get(worker_id)
        self._rates[worker_id] = rate if old is None else self.alpha * rate + (1 - self.alpha) * old
        self._counts[worker_id] = self._counts.get(worker_id, 0) + 1

    def rate(self, worker_id: int) -> float | None:
        return self._rates.get(worker_id)

    def count(self, worker_id: int) -> int:
        return self._counts.get(worker_id, 0)

    def forget(self, worker_id: int) -> None:
        self._rates.pop(worker_id, None)
        self._counts.pop(worker_id, None)


def predicted_compute_s(shares: Sequence[int], rates: Sequence[float]) -> float:
    """The compute time of a step: that of its slowest rank."""
    return max((s / r for s, r in zip(shares, rates, strict=True)), default=0.0)


@dataclass(frozen=True)
class RebalanceDecision:
    """New shares from measured rates, with the predicted compute time before and after."""

    shares_before: tuple[int, ...]
    shares_after: tuple[int, ...]
    samples_per_s: tuple[float, ...]
    predicted_before_s: float
    predicted_after_s: float


def rebalance(global_batch_size: int, shares: Sequence[int], rates: Sequence[float],
              threshold: float, step_time_s: float = 0.0) -> RebalanceDecision | None:
    """Shares proportional to `rates` if that cuts the predicted compute time by at least
    `threshold` of the step time (`step_time_s`, at least the predicted compute time: a step
    dominated by communication gains little from new shares); otherwise None."""
    if len(shares) != len(rates):
        raise ValueError(f"{len(shares)} shares but {len(rates)} rates")
    if any(r <= 0 for r in rates):
        raise ValueError(f"rates must be positive, got {list(rates)}")
    proposed = apportion(global_batch_size, rates)
    before = predicted_compute_s(shares, rates)
    after = predicted_compute_s(proposed, rates)
    if tuple(proposed) == tuple(shares) or before - after < threshold * max(before, step_time_s):
        return None
    return RebalanceDecision(shares_before=tuple(shares), shares_after=proposed,
                             samples_per_s=tuple(rates), predicted_before_s=before,
                             predicted_after_s=after)
