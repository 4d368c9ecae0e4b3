"""What one global step came to on one rank: a committed `StepRecord`, or the step voted down
on every rank (`UserFailure`, `OutOfMemory`, `NonFinite`), which the controller maps to an
action (retry, smaller micro-batches, fail)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """What one committed global step did, as seen by one rank."""

    step: int
    epoch: int
    loss: float
    world_size: int
    global_batch_size: int
    shares: tuple[int, ...]
    micro_batch: int
    step_time_s: float
    compute_time_s: float  # data, forward and backward on this rank (its throughput)
    end_time: float
    lr: float
    indices: tuple[int, ...] | None = None
    skipped_ranks: tuple[int, ...] = ()  # non-finite loss or gradients: no update was applied
    # (wall-clock start, data, forward+backward, communication, optimizer) in seconds: the
    # step timeline (communication is the exposed part: nothing overlaps it).
    timeline: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    rescaled: int = 0  # exact mode: redos of the step at a wider fixed-point scale
    metrics: dict[str, float] = field(default_factory=dict)  # user metrics of the global batch
    grad_norm: float | None = None  # the summed gradients' 2-norm before clipping (clipping on)
    scale: float | None = None  # 'fp16-mixed': the loss scale the step ran with
    yielded: bool = False  # the controller asked to end the chunk: every rank ends it here
    # Sharded state: the step is committed here but gathering the parameters after it failed
    # (the error's text); the chunk ends after it, and the next generation completes it.
    interrupted: str | None = None
    # This rank's checkpoint write ran beside the step: its compute time measures the write's
    # competition, not the rank's speed (not fed to rebalancing or straggler detection).
    writing: bool = False


@dataclass(frozen=True)
class UserFailure:
    """User code raised on some rank; the step was voted down on all ranks."""

    step: int
    ranks: tuple[int, ...]
    traceback: str | None  # this rank's traceback, if it was one of them


@dataclass(frozen=True)
class NonFinite:
    """The loss or gradients were NaN or infinite on some ranks and the policy is 'stop'."""

    step: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class OutOfMemory:
    """Some ranks ran out of memory (and no rank's user code raised otherwise); the step was
    voted down on all ranks and can be redone with smaller micro-batches on those ranks."""

    step: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class EvalFailure:
    """The evaluation failed on every rank: user code raised on `ranks`, or the ranks
    disagree (metric names, evaluation set size).

    Attributes:
        ranks: the ranks at fault.
        traceback: this rank's traceback when it is one of them, or the disagreement (the
            same text on every rank); None on a rank that has nothing to tell.
    """

    ranks: tuple[int, ...]
    traceback: str | None
