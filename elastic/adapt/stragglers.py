"""Stragglers: members whose compute stays far slower than the others' (a throttled CPU, a
failing GPU, a noisy neighbour), found so that a hot spare can take their place.

`StragglerWatch` reads each member's measured throughput (samples per second of compute, the
rates the rebalancer uses) once per completed chunk. A member whose rate is at most 1/factor of
the median of the others' in `window` chunks in a row is a straggler. Rebalancing already
gives a slow member a smaller share, which evens out step times but not its throughput: the
rate is what says a member is worth swapping.

No Ray, no torch here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class StragglerWatch:
    """Counts, per worker id, the chunks in a row in which it was slow.

    Args:
        factor: a member is slow when the median of the others' rates is at least `factor`
            times its own.
        window: chunks in a row it must be slow to be a straggler.
    """

    factor: float
    window: int
    _streaks: dict[int, int] = field(default_factory=dict)

    def observe(self, rates: Mapping[int, float]) -> list[int]:
        """One chunk's rates (worker id -> samples per second); returns the stragglers, slowest
        first. A member missing from `rates` starts over."""
        streaks = {}
        if len(rates) >= 2:
            for worker_id, rate in rates.items():
                others = statistics.median(r for w, r in rates.items() if w != worker_id)
                if rate * self.factor <= others:
                    streaks[worker_id] = self._streaks.get(worker_id, 0) + 1
        self._streaks = streaks
        return sorted((w for w, n in streaks.items() if n >= self.window), key=rates.__getitem__)

    def reset(self) -> None:
        """The members changed: every streak starts over."""
        self._streaks.clear()
