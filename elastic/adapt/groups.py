"""Groups of G samples: the unit of the math for models whose forward mixes samples
(BatchNorm) or draws random numbers (dropout).

The global batch of a step is a fixed sequence of groups of G consecutive samples. With groups
on, shares are whole groups and every forward/backward runs exactly one group, so BatchNorm
normalises over the same G samples (ghost batch normalisation) and a group's random numbers
are drawn from a generator seeded from (seed, step, group) whatever rank runs it, whatever
the shares and the world size. G defaults to what DDP at the starting world size computes
per rank: `global_batch_size / num_workers`.

Pure: plain numbers in, a `Grouping` out. `forward_seed` is public so that a plain-PyTorch
loop can replay a run (`torch.manual_seed(forward_seed(seed, step, first))` before the forward
whose first sample is at position `first` of the step's global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.errors import ConfigError

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def forward_seed(seed: int, step: int, first: int) -> int:
    """The seed of the random-number generators (CPU and CUDA) for the forward/backward pass
    of step `step` whose first sample sits at position `first` of the step's global batch.

    Keyed by the run's seed, the step and the position, never by rank: a group's dropout mask
    is the same on whichever rank runs it, and no two forwards of a step share a stream.
    With groups of G samples, the forward of group j has `first = j * G`.
    """
    if min(step, first) < 0:
        raise ValueError(f"step and first must be non-negative, got {step}, {first}")
    return _mix(_mix(_mix(seed & _MASK64) ^ step) ^ first) >> 1  # fits torch.manual_seed


def default_group_size(global_batch_size: int, num_workers: int, policy: str = "fixed",
                       max_micro_batch: int | None = None) -> int:
    """G when the user sets none: `global_batch_size / num_workers` (each rank's batch in DDP at
    the starting world size), or, when that does not divide the global batch (or exceeds
    `max_micro_batch`), the largest divisor of the global batch below it."""
    per_worker = max(1, global_batch_size // num_workers)
    whole = per_worker if policy == "scale_with_workers" else global_batch_size
    top = min(per_worker, max_micro_batch or per_worker)
    return max(d for d in range(1, top + 1) if whole % d == 0)


def _check_default_size(size: int, group_size: int | None, global_batch_size: int,
                        num_workers: int, policy: str, max_micro_batch: int | None,
                        batchnorm: int) -> None:
    """Refuses, for a model with BatchNorm, a default G that divisibility forced far below
    each worker's samples (a global batch of 101 over 4 workers: groups of 1): BatchNorm
    cannot normalise one sample, and over a few it is not the math DDP does. (Dropout's math
    holds at any G; a small one is only slower.)

    Raises:
        ConfigError: naming batch.group_size and what it could be.
    """
    per_worker = max(1, global_batch_size // num_workers)
    top = min(per_worker, max_micro_batch or per_worker)
    if group_size is not None or not batchnorm or 2 * size >= top:
        return
    whole = per_worker if policy == "scale_with_workers" else global_batch_size
    up = [d for d in range(top + 1, whole) if whole % d == 0
          and (max_micro_batch is None or d <= max_micro_batch)][:1]
    within = (f" within batch.max_micro_batch = {max_micro_batch}"
              if max_micro_batch is not None and max_micro_batch < per_worker else "")
    raise ConfigError(
        f"batch.global_batch_size = {global_batch_size} has no divisor near its {per_worker} "
        f"samples per worker (scaling.num_workers = {num_workers}){within}: the default group "
        f"would be {size} sample(s), and BatchNorm would normalise over that few (DDP: over "
        f"{per_worker}). Set batch.group_size to a divisor of "
        + ("each worker's batch" if policy == "scale_with_workers" else "the global batch")
        + (f" (such as {up[0]})" if up else "")
        + ", or a global batch that scaling.num_workers divides"
        + (", or raise batch.max_micro_batch" if within else ""))


@dataclass(frozen=True)
class Grouping:
    """How the global batch is cut for the math.

    Attributes:
        size: G, the samples of one group; every share is a multiple of it and, with groups on,
            every forward runs exactly one group (1 when groups are off).
        on: whether groups are on.
        pinned: the math follows the split (a model with BatchNorm or dropout, groups off):
            shares and micro-batches are not rebalanced or autotuned.
        reason: one line for the run's events.
    """

    size: int
    on: bool
    pinned: bool
    reason: str


def decide_grouping(setting: Literal["auto", "on", "off"], group_size: int | None,
                    global_batch_size: int, num_workers: int, policy: str,
                    batchnorm: int, dropout: int, max_micro_batch: int | None = None,
                    exact: bool = False) -> Grouping:
    """Whether groups are on and their size G.

    Args:
        setting: `batch.groups`; 'auto' turns groups on for a model with BatchNorm or dropout
            layers.
        group_size: `batch.group_size` (None: `default_group_size`).
        global_batch_size: the global batch at `num_workers`.
        num_workers: the starting world size (`scaling.num_workers`).
        policy: `batch.policy`.
        batchnorm: BatchNorm layers in the model (that track running statistics or not).
        dropout: dropout layers in the model.
        max_micro_batch: `batch.max_micro_batch`; a default G stays within it.
        exact: `batch.exact`, which sums whole groups: groups on, whatever the model.
    """
    found = ", ".join(f"{n} {what} layer{'s' if n != 1 else ''}"
                      for n, what in ((batchnorm, "BatchNorm"), (dropout, "dropout-like")) if n)
    size = group_size or default_group_size(global_batch_size, num_workers, policy,
                                             max_micro_batch)
    if exact and setting == "off":
        raise ValueError("batch.exact needs batch.groups 'auto' or 'on'")
    if setting == "on" or exact or (setting == "auto" and found):
        _check_default_size(size, group_size, global_batch_size, num_workers, policy,
                            max_micro_batch, batchnorm)
        why = ("batch.exact = True" if exact else
               f"the model has {found}" if found else "batch.groups = 'on'")
        return Grouping(size=size, on=True, pinned=False,
                        reason=f"{why}: every forward runs one group of {size} samples, seeded by "
                               "(seed, step, group), so the math does not depend on the split")
    if found:
        return Grouping(size=1, on=False, pinned=True,
                        reason=f"batch.groups = 'off' and the model has {found}: the math follows "
                               "the split, so shares and micro-batches are not rebalanced or "
                               "autotuned")
    return Grouping(size=1, on=False, pinned=False,
                    reason="no BatchNorm or dropout-like layers found: any split gives the same math, "
                           "unless the forward or the loss draws random numbers otherwise (then set "
                           "batch.groups = 'on')")
