"""Micro-batch autotuning and out-of-memory backoff.

The micro-batch size is not part of the math (each micro-batch's mean loss is scaled by
`len/B`), so the controller may try several on real training steps without wasting any: the
tuner hands out one candidate per trial, is told the measured step times, and decides on the
fastest. An out-of-memory error halves the micro-batch of the rank that hit it and the step is
redone by every rank; at micro-batch 1 there is nothing left to halve.
"""

from __future__ import annotations

from dataclasses import dataclass


def candidates(largest_share: int, max_micro_batch: int | None, count: int) -> tuple[int, ...]:
    """Micro-batch sizes worth trying, largest first: the largest allowed, then halvings."""
    if largest_share < 1 or count < 1:
        return (1,)
    top = min(largest_share, max_micro_batch) if max_micro_batch else largest_share
    out = [top]
    while len(out) < count and out[-1] > 1:
        out.append(out[-1] // 2)
    return tuple(out)


@dataclass(frozen=True)
class MicroBatchDecision:
    """The tuner's choice and what it measured (samples per second per candidate)."""

    micro_batch: int
    samples_per_s: dict[int, float]
    reason: str


class MicroBatchTuner:
    """Tries each candidate for `steps_per_trial` steps and keeps the fastest.

    A trial's figure is its fastest step (the least disturbed by noise on a shared machine).
    """

    def __init__(self, candidates: tuple[int, ...], steps_per_trial: int, reason: str) -> None:
        if not candidates or steps_per_trial < 1:
            raise ValueError("a tuner needs candidates and at least one step per trial")
        self._candidates = list(candidates)
        self.steps_per_trial = steps_per_trial
        self.reason = reason
        self._times: dict[int, list[float]] = {}
        self._batch: dict[int, int] = {}

    def _done(self, candidate: int) -> bool:
        return self.steps_left(candidate) == 0

    def steps_left(self, candidate: int) -> int:
        """Steps still to time for `candidate`."""
        return max(0, self.steps_per_trial - len(self._times.get(candidate, [])))

    def next_trial(self) -> int | None:
        """The micro-batch to try next, or None when every candidate was measured."""
        for c in self._candidates:
            if not self._done(c):
                return c
        return None

    def observe(self, micro_batch: int, global_batch: int, step_times: list[float]) -> None:
        """Records step times (seconds) of a trial; a trial cut short (an epoch ended) goes on
        in the next chunk until it has `steps_per_trial` steps."""
        self._times.setdefault(micro_batch, []).extend(t for t in step_times if t > 0)
        self._batch[micro_batch] = global_batch

    def decision(self) -> MicroBatchDecision | None:
        """The fastest candidate, once all were measured."""
        if self.next_trial() is not None:
            return None
        rates = {c: self._batch[c] / min(self._times[c]) for c in self._candidates}
        best = max(self._candidates, key=lambda c: (rates[c], c))
        return MicroBatchDecision(micro_batch=best, samples_per_s=rates, reason=self.reason)


@dataclass(frozen=True)
class OomBackoff:
    """A rank ran out of memory at `step`: its micro-batch goes from `before` to `after` and
    every rank redoes the step. `after` is None when `before` was already the smallest
    (1, or the group size with groups on)."""

    step: int
    rank: int
    worker_id: int
    before: int
    after: int | None


def back_off(step: int, rank: int, worker_id: int, micro_batch: int, unit: int = 1) -> OomBackoff:
    """Halves `micro_batch`, rounded down to a multiple of `unit` (the group size) but not
    below it; None when it is `unit` already."""
    after = max(unit, micro_batch // 2 // unit * unit) if micro_batch > unit else None
    return OomBackoff(step=step, rank=rank, worker_id=worker_id, before=micro_batch, after=after)
