"""Heterogeneity-aware shares: measure each worker's throughput, give the fast ones more.

A step lasts as long as its slowest rank's compute plus the allreduce. With shares
proportional to measured throughput every rank's compute takes about as long, so a worker
twice as slow gets about half the samples. Shares change only when the predicted compute time
drops by a threshold (noise on a shared machine must not make the plan flap), and never change
the math. `Rebalancer` judges every re-split by what it delivered and backs off when re-splits
do not deliver, so the shares settle.
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
              threshold: float, step_time_s: float = 0.0, unit: int = 1) -> RebalanceDecision | None:
    """Shares proportional to `rates` (multiples of `unit`, the group size) if that cuts the
    predicted compute time by at least `threshold` of the step time (`step_time_s`, at least the
    predicted compute time: a step dominated by communication gains little from new shares);
    otherwise None."""
    if len(shares) != len(rates):
        raise ValueError(f"{len(shares)} shares but {len(rates)} rates")
    if any(r <= 0 for r in rates):
        raise ValueError(f"rates must be positive, got {list(rates)}")
    proposed = apportion(global_batch_size, rates, unit)
    before = predicted_compute_s(shares, rates)
    after = predicted_compute_s(proposed, rates)
    if tuple(proposed) == tuple(shares) or before - after < threshold * max(before, step_time_s):
        return None
    return RebalanceDecision(shares_before=tuple(shares), shares_after=proposed,
                             samples_per_s=tuple(rates), predicted_before_s=before,
                             predicted_after_s=after)


@dataclass(frozen=True)
class Judgement:
    """How a re-split did, one observation window after it was made.

    Attributes:
        delivered: the realised saving was at least half the predicted one.
        predicted_saving_s: predicted compute time before minus after.
        realised_saving_s: measured compute time (median step) before minus after.
        window: chunks the next re-split will be observed for.
        threshold: the threshold the next re-split must clear.
    """

    delivered: bool
    predicted_saving_s: float
    realised_saving_s: float
    window: int
    threshold: float


@dataclass
class _UnderTrial:
    decision: RebalanceDecision
    measured_before_s: float
    chunks_left: int
    realised: list[float]


class Rebalancer:
    """Re-splits shares when the rates call for it, and checks every re-split against what it
    predicted before making another.

    After a re-split nothing else is decided for `window` chunks; then the realised saving
    (median compute time of a step before and after) is compared with the predicted one. A
    re-split that did not deliver at least half its prediction doubles both the observation
    window and the threshold the next one must clear, so that on noise (a shared machine,
    tiny steps) re-splits become rare instead of endless; one that delivered halves them
    again, down to the configured values. The threshold stops at 0.5 (or the configured one,
    if higher): at 0.95 no re-split could ever pass again, nor so be judged and bring it down.
    A membership change ends any trial (the rates change anyway) and halves what was learnt
    about the machine: a node that joins slow must be able to get a smaller share.

    Args:
        threshold: the configured threshold (`BatchConfig.rebalance_threshold`).
        window: chunks a re-split is observed for, at least.
    """

    def __init__(self, threshold: float, window: int = 1) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
        if window < 1:
            raise ValueError(f"window must be at least 1 chunk, got {window}")
        self.base_threshold, self.base_window = threshold, window
        self.scale = 1  # 1, 2, 4, ...: how much the machine has taught us to distrust a re-split
        self._trial: _UnderTrial | None = None

    @property
    def threshold(self) -> float:
        return min(max(0.5, self.base_threshold), self.base_threshold * self.scale)

    @property
    def window(self) -> int:
        return self.base_window * self.scale

    @property
    def under_trial(self) -> bool:
        return self._trial is not None

    def membership_changed(self) -> None:
        self._trial = None
        self.scale = max(1, self.scale // 2)

    def observe(self, compute_s: float) -> Judgement | None:
        """One chunk's median step compute time (slowest rank); the judgement of the re-split
        under trial once its window is over."""
        trial = self._trial
        if trial is None:
            return None
        trial.realised.append(compute_s)
        trial.chunks_left -= 1
        if trial.chunks_left > 0:
            return None
        self._trial = None
        after = sorted(trial.realised)[len(trial.realised) // 2]
        predicted = trial.decision.predicted_before_s - trial.decision.predicted_after_s
        realised = trial.measured_before_s - after
        delivered = realised >= 0.5 * predicted
        self.scale = max(1, self.scale // 2) if delivered else min(64, self.scale * 2)
        return Judgement(delivered=delivered, predicted_saving_s=predicted,
                         realised_saving_s=realised, window=self.window, threshold=self.threshold)

    def decide(self, global_batch_size: int, shares: Sequence[int], rates: Sequence[float],
               step_time_s: float, compute_s: float, unit: int = 1) -> RebalanceDecision | None:
        """A re-split (see `rebalance`; shares in multiples of `unit`) at the current
        threshold, unless one is under trial; `compute_s` is the measured median step compute
        time it will be judged against."""
        if self._trial is not None:
            return None
        decision = rebalance(global_batch_size, shares, rates, self.threshold, step_time_s, unit)
        if decision is not None:
            self._trial = _UnderTrial(decision, compute_s, self.window, [])
        return decision
