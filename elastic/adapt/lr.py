"""Policies for users who want the global batch to follow the world size.

With `scale_with_workers` the global batch is the per-worker batch times the world size, and
the learning rate is scaled with it: by k for a batch k times the initial one (the linear
scaling rule of Goyal et al. 2017) or by sqrt(k), ramped linearly from the factor in force to
the new one over `warmup_steps` steps after every change of the world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def global_batch_for(policy: str, global_batch_size: int, num_workers: int, world_size: int) -> int:
    """The global batch at `world_size` workers (`global_batch_size` is the batch at
    `num_workers`)."""
    if policy == "fixed":
        return global_batch_size
    if policy == "scale_with_workers":
        return global_batch_size // num_workers * world_size
    raise ValueError(f"unknown batch policy {policy!r}")


def lr_factor(rule: str, global_batch: int, initial_batch: int) -> float:
    """The learning-rate factor for `global_batch` relative to `initial_batch`."""
    k = global_batch / initial_batch
    if rule == "linear":
        return k
    if rule == "sqrt":
        return math.sqrt(k)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown learning-rate scaling rule {rule!r}")


@dataclass(frozen=True)
class LrRamp:
    """The learning-rate factor per global step: `from_factor` before `start_step`, then a
    linear ramp reaching `to_factor` after `warmup_steps` steps, `to_factor` from then on."""

    start_step: int
    warmup_steps: int
    from_factor: float
    to_factor: float

    def factor(self, step: int) -> float:
        if step < self.start_step:
            return self.from_factor
        done = step - self.start_step + 1
        if self.warmup_steps == 0 or done >= self.warmup_steps:
            return self.to_factor
        return self.from_factor + (self.to_factor - self.from_factor) * done / self.warmup_steps

    def rest_from(self, step: int) -> LrRamp:
        """What is left of this ramp at `step`, as a ramp that starts there: the same factor
        at every step from `step` on (up to rounding), for a run restored at `step`."""
        left = self.start_step + self.warmup_steps - step
        if step <= self.start_step or left <= 0:  # not begun, or over: the same factors
            return self
        return LrRamp(start_step=step, warmup_steps=left, from_factor=self.factor(step - 1),
                      to_factor=self.to_factor)

    def to_dict(self) -> dict[str, int | float]:
        """The ramp as a checkpoint's manifest records it (`from_dict` reads it back)."""
        return {"start_step": self.start_step, "warmup_steps": self.warmup_steps,
                "from_factor": self.from_factor, "to_factor": self.to_factor}

    @staticmethod
    def from_dict(record: object) -> LrRamp | None:
        """The ramp `to_dict` wrote; None for anything else (a checkpoint written before
        ramps were recorded, or a record that is not one)."""
        if not isinstance(record, dict):
            return None
        ints = [record.get(k) for k in ("start_step", "warmup_steps")]
        floats = [record.get(k) for k in ("from_factor", "to_factor")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints) \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           and math.isfinite(v) and v > 0 for v in floats):
            return None
        return LrRamp(start_step=ints[0], warmup_steps=ints[1], from_factor=float(floats[0]),
                      to_factor=float(floats[1]))


@dataclass(frozen=True)
class BatchResize:
    """The global batch and learning-rate ramp for a new world size."""

    world_size: int
    global_batch_size: int
    ramp: LrRamp


def resize(policy: str, rule: str, warmup_steps: int, global_batch_size: int, num_workers: int,
           world_size: int, step: int, current: LrRamp | None) -> BatchResize:
    """The decision for a generation of `world_size` workers starting at `step`."""
    batch = global_batch_for(policy, global_batch_size, num_workers, world_size)
    target = lr_factor(rule, batch, global_batch_size) if policy != "fixed" else 1.0
    if current is not None and current.to_factor == target:
        # A new generation at the same size (a replacement, a straggler swapped): the ramp in
        # progress goes on as it was (before, it started again from where it had got to).
        return BatchResize(world_size=world_size, global_batch_size=batch, ramp=current)
    # The ramp starts from the factor of the last step taken.
    now = current.factor(step - 1) if current is not None else target
    ramp = LrRamp(start_step=step, warmup_steps=warmup_steps if now != target else 0,
                  from_factor=now, to_factor=target)
    return BatchResize(world_size=world_size, global_batch_size=batch, ramp=ramp)
