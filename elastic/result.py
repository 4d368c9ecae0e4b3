"""What `elastic.fit` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FitResult:
    """The outcome of a finished run.

    Attributes:
        name: the run's name.
        run_dir: where events.jsonl, metrics.jsonl (and ledger.jsonl) are.
        model_state: the final model `state_dict`, CPU tensors.
        steps: optimizer steps taken in total.
        samples: samples processed by committed steps (steps x global batch).
        events: every event of the run, in order.
        metrics: one record per committed step, as metrics.jsonl holds it but for the
            per-rank step `timeline` (read that from the file: `elastic.runlog.DISK_ONLY`);
            the newest `LoggingConfig.result_metrics` (100,000) steps' (the file has all).
        evaluation: the last evaluation's metrics (`TrainJob.eval_step`'s and `evaluate`'s), if any.
        stopped: True when the run ended early because of `stop`.
    """

    name: str
    run_dir: str
    model_state: dict[str, torch.Tensor]
    steps: int
    samples: int
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evaluation: dict[str, float] = field(default_factory=dict)
    stopped: bool = False
