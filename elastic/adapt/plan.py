"""The batch plan: how the fixed global batch is shared among the workers of a generation.

Pure: plain numbers in, a `BatchPlan` out. Any world size works, including primes and worlds
larger than the batch (some shares are then zero). Shares may follow per-rank weights
(measured throughputs), and every rank has its own micro-batch size (an out-of-memory backoff
lowers one rank's without touching the others). None of this changes the math: each rank
scales a micro-batch's mean loss by `len/B`, so only the floating-point summation order moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """Shares of the global batch per rank, in rank order, and each rank's micro-batch size."""

    global_batch_size: int
    shares: tuple[int, ...]
    micro_batches: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.shares) != self.global_batch_size or len(self.micro_batches) != len(self.shares):
            raise ValueError(f"inconsistent batch plan: {self}")

    @property
    def world_size(self) -> int:
        return len(self.shares)

    @property
    def micro_batch(self) -> int:
        """The largest micro-batch of any rank (for display)."""
        return max(self.micro_batches)

    def offset(self, rank: int) -> int:
        """Position of `rank`'s first sample within the global batch."""
        return sum(self.shares[:rank])

    def accumulation(self, rank: int) -> int:
        """Forward/backward passes `rank` runs per step."""
        return math.ceil(self.shares[rank] / self.micro_batches[rank])

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """`(start, length)` of each micro-batch of `rank`, relative to its share."""
        share, micro = self.shares[rank], self.micro_batches[rank]
        return [(s, min(micro, share - s)) for s in range(0, share, micro)]


def apportion(total: int, weights: Sequence[float], unit: int = 1) -> tuple[int, ...]:
    """Splits `total` into non-negative multiples of `unit` proportional to `weights` (largest
    remainder).

    When `total >= len(weights) * unit` every part is at least `unit`, so that every rank keeps
    being measured. Deterministic: ties go to the lower index. Equal weights give the even
    split with the first parts one unit larger.

    Raises:
        ValueError: `unit` does not divide `total`, or the weights are not positive.
    """
    if unit < 1 or total % unit:
        raise ValueError(f"a unit of {unit} does not divide {total}")
    if unit > 1:
        return tuple(unit * p for p in apportion(total // unit, weights))
    n = len(weights)
    if n == 0:
        raise ValueError("cannot apportion over zero ranks")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    floor = 1 if total >= n else 0
    rest = total - floor * n
    weight_sum = math.fsum(weights)
    exact = [rest * w / weight_sum for w in weights]
    parts = [math.floor(x) for x in exact]
    short = rest - sum(parts)
    order = sorted(range(n), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[:short]:
        parts[i] += 1
    return tuple(floor + p for p in parts)


def plan_batch(
    global_batch_size: int,
    world_size: int,
    max_micro_batch: int | None,
    weights: Sequence[float] | None = None,
    micro_caps: Sequence[int | None] | None = None,
    unit: int = 1,
) -> BatchPlan:
    """Shares `global_batch_size` over `world_size` ranks.

    Args:
        global_batch_size: samples per optimizer step.
        world_size: ranks of the generation.
        max_micro_batch: largest micro-batch of any rank (None: a rank's whole share).
        weights: relative throughput per rank; shares follow it (default: equal).
        micro_caps: a further per-rank cap (out-of-memory backoff, autotuning); None entries
            mean no extra cap.
        unit: shares and micro-batches are multiples of it (the group size G); a cap below it
            is raised to it.

    Raises:
        ValueError: a size is not positive, or a per-rank sequence has the wrong length.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise ValueError(f"max_micro_batch must be positive, got {max_micro_batch}")
    if weights is not None and len(weights) != world_size:
        raise ValueError(f"{len(weights)} weights for {world_size} ranks")
    if micro_caps is not None and len(micro_caps) != world_size:
        raise ValueError(f"{len(micro_caps)} micro-batch caps for {world_size} ranks")
    shares = apportion(global_batch_size, weights if weights is not None else [1.0] * world_size,
                       unit)
    micros = []
    for rank, share in enumerate(shares):
        micro = max(unit, share)
        for cap in (max_micro_batch, micro_caps[rank] if micro_caps is not None else None):
            if cap is not None:
                if cap < 1:
                    raise ValueError(f"micro-batch cap of rank {rank} must be positive, got {cap}")
                micro = min(micro, max(unit, cap // unit * unit))
        micros.append(micro)
    return BatchPlan(global_batch_size=global_batch_size, shares=shares, micro_batches=tuple(micros))
