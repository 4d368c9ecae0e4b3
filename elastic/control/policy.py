"""The failure policy: one place that maps an error class to an action and owns the counters.

Every failure the control loop sees becomes a typed error from `elastic.errors` first (a lost
worker, a collective error, a voted-down step, a generation that did not form, too few
workers), and `FailurePolicy.decide` turns it into one of the actions below, following the
recovery each error class documents:

| error                                 | action                                            |
| ------------------------------------- | ------------------------------------------------- |
| `WorkerLostError`, `WorkerHangError`  | `Recover` (drop, re-form, restore); `Fail` past `max_failures` |
| `CollectiveError` (no loss)           | `Recover`                                         |
| `RendezvousError` (forming)           | `Recover` (a new generation); `Fail` after 3 retries |
| `GenerationOutOfMemoryError` (forming) | `Recover` once per step; `Fail` the second time    |
| `MembershipChanged`                   | `Reconfigure` (re-form, no restore needed)        |
| `UserCodeError`                       | `Retry` the step; `Fail` past `max_user_retries`  |
| `AfterStepError` (a `UserCodeError`)  | `Fail`: the step was applied                      |
| `EvaluationError` (a `UserCodeError`) | `Retry` the evaluation (own count); `Fail` past `max_user_retries` |
| `WorkerOutOfMemoryError`              | `BackOff` (halve the rank's micro-batch); `Fail` at 1 |
| `NonFiniteLossError`                  | `Fail` (policy 'stop'; 'skip' never reaches here) |
| anything else                         | `Fail`                                            |

Workers on notice (`elastic.control.port.Notice`) that leave at a step boundary, or die
before one, count against `max_preemptions` instead of `max_failures` (`departed`).

No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.adapt.tuning import OomBackoff, back_off
from elastic.config import FailureConfig
from elastic.errors import (
    AfterStepError,
    CollectiveError,
    ElasticError,
    EvaluationError,
    GenerationOutOfMemoryError,
    InsufficientWorkersError,
    MembershipChanged,
    NonFiniteLossError,
    RendezvousError,
    UserCodeError,
    WorkerLostError,
    WorkerOutOfMemoryError,
)

GENERATION_RETRIES = 3  # a generation that fails to form with no member dead is retried
# A generation that runs out of memory as it forms is formed again this often per step (memory
# an earlier failure left may have been the cause); again out of memory, the run fails.
FORMING_OOM_RETRIES = 1


@dataclass(frozen=True)
class Recover:
    """Drop the lost members, form a new generation from the survivors, restore the newest
    committed state (from a peer, else a checkpoint)."""


@dataclass(frozen=True)
class Reconfigure:
    """Form a new generation of the current members; every rank holds the committed state."""


@dataclass(frozen=True)
class Retry:
    """Redo the voted-down step as it was (attempt `attempt` of the step)."""

    attempt: int


@dataclass(frozen=True)
class BackOff:
    """Redo the step with these ranks' micro-batches halved."""

    decisions: tuple[OomBackoff, ...]


@dataclass(frozen=True)
class Fail:
    """End the run with `error` (`backoffs`: the out-of-memory decisions that led to it)."""

    error: ElasticError
    backoffs: tuple[OomBackoff, ...] = ()


Action = Recover | Reconfigure | Retry | BackOff | Fail


@dataclass
class FailurePolicy:
    """Decides what each failure means, counting workers lost, retries of each step and
    attempts to form a generation.

    Args:
        config: the run's `FailureConfig`.
    """

    config: FailureConfig
    workers_lost: int = 0
    preemptions: int = 0
    user_retries: dict[int, int] = field(default_factory=dict)
    evaluation_retries: dict[int, int] = field(default_factory=dict)
    generation_attempts: int = 0
    # step -> recoveries in a row from a collective error there (the last such step only;
    # cleared when an evaluation at the step goes through)
    collective_recoveries: dict[int, int] = field(default_factory=dict)
    # step -> generations that ran out of memory forming at it (the last such step only;
    # `formed` keeps it).
    forming_oom: dict[int, int] = field(default_factory=dict)
    unit: int = 1  # the group size with groups on: the smallest micro-batch

    def decide(self, error: ElasticError, *, lost: int = 0, preempted: int = 0,
               micro_batches: dict[int, tuple[int, int]] | None = None,
               step: int | None = None) -> Action:
        """The action for `error`.

        Args:
            error: what went wrong.
            lost: workers that died with it (counted against `max_failures`).
            preempted: workers told to leave that died with it before a step boundary
                (counted against `max_preemptions` instead).
            micro_batches: for out-of-memory errors, rank -> (worker id, micro-batch it ran).
            step: the run's committed step, for errors that do not carry one (a generation
                that fails, a collective error).

        Returns:
            The action; `Fail` carries the error the run ends with, with a message that says
            what to change.
        """
        match error:
            case WorkerLostError():  # WorkerHangError included
                return self.departed(preempted, error.step) or self._lost(lost, error)
            case RendezvousError():
                return self._generation_failed(error, step)
            case GenerationOutOfMemoryError():
                return self._forming_out_of_memory(error, step)
            case CollectiveError():
                return self._collective(error, step)
            case MembershipChanged():
                return Reconfigure()
            case AfterStepError():  # the step is applied: a retry would apply it again
                self.user_retries[error.step] = self.user_retries.get(error.step, 0) + 1
                return Fail(error)
            case EvaluationError():  # its own count: a step's retries are the step's
                return self._user_error(error, self.evaluation_retries,
                                        "the evaluation at step {step} failed")
            case UserCodeError():
                return self._user_error(error, self.user_retries, "user code raised at step {step}")
            case WorkerOutOfMemoryError():
                return self._out_of_memory(error, micro_batches or {})
            case NonFiniteLossError():
                return Fail(error)
            case _:
                return Fail(error)

    def departed(self, count: int, step: int | None) -> Fail | None:
        """`count` workers told to leave are gone (at a step boundary, or dead before one):
        a `Fail` past `max_preemptions`, else None."""
        self.preemptions += count
        limit = self.config.max_preemptions
        if count and limit is not None and self.preemptions > limit:
            return Fail(WorkerLostError(
                f"{self.preemptions} workers preempted, more than failure.max_preemptions = "
                f"{limit}; raise it (None: unlimited)", step=step))
        return None

    def _collective(self, error: CollectiveError, step: int | None) -> Action:
        """A recovery, unless collective errors at committed step `step` (None: not known)
        have recurred past `max_collective_retries`: redoing the step does not help then."""
        if step is None:
            return Recover()
        count = self.collective_recoveries.get(step, 0) + 1
        self.collective_recoveries = {step: count}
        limit = self.config.max_collective_retries
        if count > limit:
            return Fail(CollectiveError(
                f"a collective failed {count} times in a row after step {step} with no worker "
                f"lost, more than failure.max_collective_retries = {limit}: an error that "
                f"recurs as the step is redone ({error})", rank=error.rank))
        return Recover()

    def formed(self) -> None:
        """A generation formed: its retries start over."""
        self.generation_attempts = 0

    def _lost(self, lost: int, error: WorkerLostError) -> Action:
        self.workers_lost += lost
        limit = self.config.max_failures
        if limit is not None and self.workers_lost > limit:
            return Fail(WorkerLostError(
                f"{self.workers_lost} workers lost, more than failure.max_failures = {limit}",
                rank=error.rank, step=error.step))
        return Recover()

    def _generation_failed(self, error: RendezvousError, step: int | None) -> Action:
        self.generation_attempts += 1
        if self.generation_attempts > GENERATION_RETRIES:
            return Fail(WorkerLostError(
                f"generation {error.generation} could not form after {self.generation_attempts} "
                f"attempts: {error}", step=step))
        return Recover()

    def _forming_out_of_memory(self, error: GenerationOutOfMemoryError,
                               step: int | None) -> Action:
        key = -1 if step is None else step
        # Kept for the step of the last such error only: another step starts over.
        attempt = self.forming_oom.get(key, 0) + 1
        self.forming_oom = {key: attempt}
        if attempt > FORMING_OOM_RETRIES:
            what = "the run's first generation" if step is None else f"a generation at step {step}"
            return Fail(GenerationOutOfMemoryError(
                f"out of memory on {attempt} attempts to form {what}: {error}",
                rank=error.rank, generation=error.generation, doing=error.doing))
        return Recover()

    def _user_error(self, error: UserCodeError, retries: dict[int, int], what: str) -> Action:
        attempt = retries[error.step] = retries.get(error.step, 0) + 1
        if attempt > self.config.max_user_retries:
            return Fail(type(error)(
                f"{what.format(step=error.step)} on {attempt} attempts "
                f"(failure.max_user_retries = {self.config.max_user_retries})",
                rank=error.rank, step=error.step, traceback=error.traceback))
        return Retry(attempt)

    def _out_of_memory(self, error: WorkerOutOfMemoryError,
                       micro_batches: dict[int, tuple[int, int]]) -> Action:
        decisions = []
        for rank, (worker_id, micro) in sorted(micro_batches.items()):
            decision = back_off(error.step, rank, worker_id, micro, self.unit)
            decisions.append(decision)
            if decision.after is None:
                smallest = ("micro-batch 1" if self.unit == 1 else
                            f"micro-batch {micro}, one group (batch.group_size; a smaller group "
                            "changes the math)")
                return Fail(WorkerOutOfMemoryError(
                    f"rank {rank} ran out of memory at step {error.step} with {smallest}; "
                    "use a smaller model, more memory per worker or more workers (the gradient "
                    "buffers and the optimizer state do not shrink with the micro-batch)",
                    rank=rank, step=error.step), tuple(decisions))
        return BackOff(tuple(decisions))

    def capacity(self, alive: int, minimum: int, starting: int, time_left: float) -> Fail | None:
        """Below `minimum` workers: wait while replacements are starting and time is left,
        else fail."""
        if alive >= minimum:
            return None
        if time_left <= 0 or not starting:
            return Fail(InsufficientWorkersError(
                f"{alive} workers alive, fewer than scaling.min_workers = {minimum}, for "
                f"{self.config.capacity_timeout}; add capacity or lower scaling.min_workers"))
        return None
