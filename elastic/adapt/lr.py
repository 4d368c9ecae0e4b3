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
