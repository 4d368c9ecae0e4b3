"""The batch plan: how the fixed global batch is shared among the workers of a generation.

Pure: plain numbers in, a `BatchPlan` out. Any world size works, including primes and worlds
larger than the batch (some shares are then zero).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """Shares of the global batch per rank, in rank order, and the micro-batch size."""

    global_batch_size: int
    shares: tuple[int, ...]
    micro_batch: int

    @property
    def world_size(self) -> int:
        return len(self.shares)

    def offset(self, rank: int) -> int:
        """Position of `rank`'s first sample within the global batch."""
        return sum(self.shares[:rank])

    def micro_batches(self, rank: int) -> list[tuple[int, int]]:
        """`(start, length)` of each micro-batch of `rank`, relative to its share."""
        share = self.shares[rank]
        return [(s, min(self.micro_batch, share - s)) for s in range(0, share, self.micro_batch)]


def plan_batch(global_batch_size: int, world_size: int, max_micro_batch: int | None) -> BatchPlan:
    """Splits `global_batch_size` as evenly as possible over `world_size` ranks.

    The first `global_batch_size % world_size` ranks take one sample more. The micro-batch is
    the largest share, capped by `max_micro_batch`.

    Raises:
        ValueError: a size is not positive.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise ValueError(f"max_micro_batch must be positive, got {max_micro_batch}")
    base, extra = divmod(global_batch_size, world_size)
    shares = tuple(base + (1 if r < extra else 0) for r in range(world_size))
    largest = max(1, shares[0])
    micro = min(largest, max_micro_batch) if max_micro_batch else largest
    return BatchPlan(global_batch_size=global_batch_size, shares=shares, micro_batch=micro)
