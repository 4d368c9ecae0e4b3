"""The training features through a real kill on Ray: fp16 with its loss scale, clipping, a
plateau scheduler, user metrics and an EMA as extra state end where the plain loop of
tests/unit/test_training_features.py ends, and metrics.jsonl holds every step once with its
metrics; a scheduler that raises fails the run at once, without a retry."""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, CollectiveConfig, FitConfig, ScalingConfig
from elastic.config import TrainingConfig
from elastic.errors import AfterStepError
from elastic.events import Failed, UserError
from elastic.runlog import read_jsonl
from tests.events import of_kind
from tests.unit.test_training_features import (
    SEED,
    B,
    G,
    Overflowing,
    _close,
    _job,
    _reference,
    ema_state,
    failing_scheduler,
    metric_loss,
    plateau,
)

pytestmark = pytest.mark.fault


def _config(tmp_path, training: TrainingConfig, **kwargs) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=3, min_workers=1),
                     batch=BatchConfig(global_batch_size=B, groups="on", group_size=G,
                                       max_micro_batch=G, autotune=False, rebalance=False),
                     training=training, seed=SEED, max_steps=8, steps_per_chunk=2,
                     run_dir=str(tmp_path / "run"), **kwargs)


@pytest.mark.timeout(300)
def test_fp16_clipping_plateau_metrics_and_ema_through_a_kill(ray_cluster, tmp_path):
    job = _job(dataset=Overflowing, loss=metric_loss, lr_scheduler=plateau, extra_state=ema_state)
    training = TrainingConfig(precision="fp16-mixed", init_scale=2.0**10, growth_interval=2,
                              clip_grad_norm=0.5, scheduler_monitor="loss")
    result = elastic.fit(job, _config(tmp_path, training,
                                      chaos=(ChaosEvent(step=3, rank=1, action="kill"),)))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    expected, log, _ = _reference(job, 8, precision="fp16-mixed", scaler=scaler,
                                  clip=("norm", 0.5), extra=ema_state,
                                  scheduler_step=lambda s, step, loss, m: s.step(loss)
                                  if math.isfinite(loss) else None)
    _close(result.model_state, expected, tol=1e-4)
    lines = read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
    assert [m["step"] for m in lines] == list(range(8))  # every step once, through the kill
    assert [m["scale"] for m in lines] == [e["scale"] for e in log]
    for line, e in zip(lines, log, strict=True):
        assert line["lr"] == pytest.approx(e["lr"], rel=1e-12)
        if e["skipped"]:
            assert "grad_norm" not in line
        else:
            assert line["grad_norm"] == pytest.approx(e["norm"], rel=1e-4)
        assert line["metrics"].keys() == e["metrics"].keys()
        for name, value in e["metrics"].items():
            assert line["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True)


@pytest.mark.timeout(300)
def test_a_scheduler_error_fails_the_run_once_without_a_retry(ray_cluster, tmp_path):
    with pytest.raises(AfterStepError) as info:
        elastic.fit(_job(lr_scheduler=failing_scheduler), _config(tmp_path, TrainingConfig()))
    assert info.value.step == 1 and "ZeroDivisionError" in info.value.traceback
    events = read_jsonl(os.path.join(tmp_path, "run", "events.jsonl"))
    assert len(of_kind(events, Failed)) == 1
    [user] = of_kind(events, UserError)
    assert user.attempt == 1 and user.ranks == [0, 1, 2] and user.step == 1
    steps = [m["step"] for m in read_jsonl(os.path.join(tmp_path, "run", "metrics.jsonl"))]
    assert steps == [0]  # step 1 applied, but its chunk ended in the error


class RaisesOnOneRank:
    """Extra state whose `after_step` raises after the second step in the one process that
    claims `marker` first: user code failing on one rank only."""

    def __init__(self, marker: str) -> None:
        self.marker, self.steps = marker, 0

    def after_step(self, model) -> None:
        self.steps += 1
        if self.steps == 2:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            raise RuntimeError("after_step failed on this rank only")

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state) -> None:
        self.steps = state["steps"]


def _raises_on_one_rank(model, optimizer, marker):
    return {"flaky": RaisesOnOneRank(marker)}


@pytest.mark.timeout(120)
def test_an_after_step_error_on_one_rank_releases_the_others_at_once(ray_cluster, tmp_path):
    # The other ranks go on into step 2's allreduce, where the failed rank never comes: they
    # are aborted as soon as its failure is reported, not after the 10-minute collective
    # timeout (which would outlast this test's timeout).
    marker = str(tmp_path / "claimed")
    job = _job(extra_state=functools.partial(_raises_on_one_rank, marker=marker))
    config = _config(tmp_path, TrainingConfig(), collective=CollectiveConfig(
        timeout=timedelta(minutes=10))).model_copy(update={"steps_per_chunk": 4})
    with pytest.raises(AfterStepError) as info:
        elastic.fit(job, config)
    assert info.value.step == 1 and "this rank only" in info.value.traceback
    events = read_jsonl(os.path.join(tmp_path, "run", "events.jsonl"))
    [user] = of_kind(events, UserError)
    assert user.attempt == 1 and len(user.ranks) == 1 and user.step == 1
    assert len(of_kind(events, Failed)) == 1
