"""What the adapters' oracle tests read from an elastic run besides its weights: each
evaluation's metrics (a callback in the controller writes them to a file) and the ledger."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import elastic


class EvaluationsToFile(elastic.Callback):
    """Appends each evaluation's `{"step", **metrics}` to a JSON-lines file (callbacks run in
    the controller, not in the test's process)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_evaluate(self, step, metrics):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


def with_evaluations(job: elastic.TrainJob, path: str) -> elastic.TrainJob:
    """`job` with an `EvaluationsToFile` writing to `path`."""
    return dataclasses.replace(job, callbacks=(*job.callbacks, EvaluationsToFile(path)))


def evaluations_by_step(path: str) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in map(json.loads, open(path))}


def assert_every_sample_once_per_epoch(run_dir: str, steps: int, epochs: int, per_epoch: int) -> None:
    """The ledger holds steps 0 to `steps - 1` once each, and every epoch's indices are
    `per_epoch` distinct samples."""
    ledger = [json.loads(line) for line in open(os.path.join(run_dir, "ledger.jsonl"))]
    assert [e["step"] for e in ledger] == list(range(steps))
    for epoch in range(epochs):
        seen = [i for e in ledger if e["epoch"] == epoch for i in e["indices"]]
        assert len(seen) == len(set(seen)) == per_epoch
