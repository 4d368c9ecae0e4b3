"""The step this worker is computing, for code inside `TrainJob.loss` that needs to know it
(the Lightning adapter passes it as `training_step`'s `batch_idx`).

One step runs at a time in a worker process; the compute phase sets it before the first
forward pass of each attempt of a step.
"""

from __future__ import annotations

_step: int | None = None


def set_current_step(step: int) -> None:
    global _step
    _step = step


def current_step() -> int | None:
    """The global step the worker is computing, or last computed (None before its first step,
    or outside a worker)."""
    return _step
