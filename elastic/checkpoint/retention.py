"""Which checkpoints retention keeps: the newest `keep_last`, plus the best `keep_best` by a
monitored evaluation metric.

A checkpoint written right after an evaluation records the monitored metric in its manifest
(`monitor_record`): its name, value and mode. `kept` decides over plain records, so it is
tested without storage; `elastic.checkpoint.store.prune` reads the manifests and deletes the
rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MONITOR = "monitor"  # the manifest field of the monitored metric


@dataclass(frozen=True)
class Retention:
    """What retention keeps.

    Attributes:
        keep_last: the newest valid checkpoints kept (at least one is always kept).
        keep_best: with `monitor`: the best checkpoints by it kept besides.
        monitor: the evaluation metric checkpoints are ranked by (None: newest only).
        mode: 'min' or 'max': whether a lower or a higher value is better.
    """

    keep_last: int
    keep_best: int = 0
    monitor: str | None = None
    mode: Literal["min", "max"] = "min"


@dataclass(frozen=True)
class Candidate:
    """A valid checkpoint as retention sees it: its step and the monitored value its manifest
    records (None when it records none, or another metric's)."""

    step: int
    value: float | None = None


def monitor_record(name: str, value: float, mode: str) -> dict[str, Any]:
    """The manifest field for a checkpoint written right after an evaluation in which metric
    `name` came out as `value` (a value that is not finite is recorded as None: never best)."""
    return {MONITOR: {"name": name, "value": value if math.isfinite(value) else None,
                      "mode": mode}}


def monitored_value(manifest: Mapping[str, Any], name: str | None) -> float | None:
    """The value of metric `name` that `manifest` records, if it records that metric."""
    record = manifest.get(MONITOR)
    if name is None or not isinstance(record, dict) or record.get("name") != name:
        return None
    value = record.get("value")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def best(candidates: Sequence[Candidate], mode: str, count: int) -> list[int]:
    """The steps of the `count` best candidates that have a value, best first (among equal
    values the newer one first)."""
    sign = 1.0 if mode == "min" else -1.0
    ranked = sorted((sign * c.value, -c.step) for c in candidates if c.value is not None)
    return [-negative_step for _, negative_step in ranked[:count]]


def kept(candidates: Sequence[Candidate], retention: Retention) -> set[int]:
    """The steps retention keeps among the valid `candidates`: the newest `keep_last` (at
    least one) and, with a monitor, the best `keep_best` by it."""
    newest = sorted((c.step for c in candidates), reverse=True)[: max(1, retention.keep_last)]
    keep = set(newest)
    if retention.monitor is not None and retention.keep_best > 0:
        keep.update(best(candidates, retention.mode, retention.keep_best))
    return keep
