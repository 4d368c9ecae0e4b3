"""The timing record of one recovery, from the kill to the first completed step after it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PendingRecovery:
    """Timestamps (time.time()) of a recovery whose first step has not completed yet."""

    detected: float
    killed_at: float | None  # known for chaos kills and kill() requests
    aborted: float
    rebuilt: float
    restored: float
    lost_ranks: list[int]
    work_lost_steps: int
    world_before: int
    world_after: int
    step: int

    def breakdown(self, first_step_end: float) -> dict[str, Any]:
        """The fields of the `recovered` event: each stage's duration in seconds."""
        start = self.killed_at or self.detected
        return {
            "lost_ranks": self.lost_ranks, "world_before": self.world_before,
            "world_after": self.world_after, "step": self.step,
            "work_lost_steps": self.work_lost_steps, "total_s": first_step_end - start,
            "detect_s": (self.detected - self.killed_at) if self.killed_at else None,
            "abort_s": self.aborted - self.detected,
            "rebuild_s": self.rebuilt - self.aborted,
            "restore_s": self.restored - self.rebuilt,
            "first_step_s": first_step_end - self.restored,
        }
