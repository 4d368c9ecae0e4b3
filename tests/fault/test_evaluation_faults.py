"""A worker lost during a distributed evaluation: the run recovers as from a lost step, the
evaluation runs again at the same committed step on the survivors with the same values, and
training goes on to the reference weights."""

from datetime import timedelta

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FailureConfig, FitConfig, ScalingConfig
from elastic.config import EvaluationConfig, TrainingConfig
from elastic.events import Evaluate, Recovered, StateChanged, WorkerFailure, WorkerHung
from tests.eval_jobs import (
    eval_job,
    halving_plateau,
    reference_metrics_at,
    reference_with_eval_plateau,
    slow_eval_step,
)
from tests.events import of_kind
from tests.jobs import reference_weights

pytestmark = pytest.mark.fault

B = 16


@pytest.mark.parametrize("action", ["kill", "hang"])
def test_a_worker_lost_in_an_evaluation_is_recovered_and_the_evaluation_rerun_at_its_step(
        ray_cluster, tmp_path, action):
    chaos = (ChaosEvent(step=4, rank=1, action=action, phase="evaluate"),)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=4), max_steps=10,
        evaluation=EvaluationConfig(every_steps=4, batch_size=4), chaos=chaos,
        failure=FailureConfig(hang_timeout=timedelta(seconds=2)), run_dir=str(tmp_path / "run"))
    result = elastic.fit(eval_job(), config)
    assert result.steps == 10
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 10), rtol=1e-9,
                               atol=1e-10)
    [failure] = of_kind(result.events, WorkerFailure)
    assert (failure.lost_ranks, failure.step, failure.planned) == ([1], 4, action == "kill")
    if action == "hang":
        assert [(h.rank, h.phase) for h in of_kind(result.events, WorkerHung)] == [(1, "evaluate")]
    # One evaluation per step: the one at step 4 ran again, on the survivors, and gave the
    # values an uninterrupted run gives (those of the reference model after 4 steps).
    evaluations = of_kind(result.events, Evaluate)
    assert [e.step for e in evaluations] == [4, 8, 10]
    for event in evaluations:
        expected = reference_metrics_at(0, B, event.step)
        assert event.metrics == pytest.approx(expected, rel=1e-9, abs=1e-12)
    states = [e.state for e in of_kind(result.events, StateChanged)]
    assert states[:3] == ["running", "recovering", "running"]
    # Nothing was trained between the loss and the evaluation's rerun; no step was lost.
    assert [m["step"] for m in result.metrics] == list(range(10))
    assert {m["world_size"] for m in result.metrics if m["step"] >= 4} <= {2, 3}
    (recovered,) = of_kind(result.events, Recovered)
    assert (recovered.world_before, recovered.world_after, recovered.work_lost_steps) == (3, 2, 0)


def test_an_evaluation_longer_than_the_hang_timeout_that_moves_on_is_not_killed(ray_cluster, tmp_path):
    # 37 samples over 2 ranks in batches of 4: 5 batches of half a second each on a rank, so
    # every evaluation outlasts the 2 s hang timeout; each batch tells the watchdog it moved on.
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=2),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=4), max_steps=3,
        evaluation=EvaluationConfig(every_steps=3, at_end=False, batch_size=4),
        failure=FailureConfig(hang_timeout=timedelta(seconds=2)), run_dir=str(tmp_path / "run"))
    result = elastic.fit(eval_job(slow_eval_step), config)
    assert of_kind(result.events, WorkerHung) == []
    assert of_kind(result.events, WorkerFailure) == []
    [evaluation] = of_kind(result.events, Evaluate)
    assert evaluation.step == 3
    assert evaluation.metrics == pytest.approx(reference_metrics_at(0, B, 3), rel=1e-9, abs=1e-12)


def test_a_plateau_scheduler_on_an_evaluation_metric_steps_once_per_evaluation_through_a_kill(
        ray_cluster, tmp_path):
    # The evaluation at step 4 loses rank 1 and runs again on the survivors: the scheduler
    # steps once for it, as in the plain loop, and every step's rate is the plain loop's.
    config = FitConfig(
        scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=4), max_steps=12,
        evaluation=EvaluationConfig(every_steps=4, batch_size=4),
        training=TrainingConfig(scheduler_interval="evaluation", scheduler_monitor="eval/mse"),
        chaos=(ChaosEvent(step=4, rank=1, action="kill", phase="evaluate"),),
        run_dir=str(tmp_path / "run"))
    result = elastic.fit(eval_job(lr_scheduler=halving_plateau), config)
    expected, lrs = reference_with_eval_plateau(0, B, 12, every=4)
    assert lrs[0] > lrs[8] > 0 and lrs[4] > lrs[8]  # the rate did change (so the test can fail)
    assert [m["lr"] for m in result.metrics] == pytest.approx(lrs, rel=1e-12)
    torch.testing.assert_close(result.model_state, expected, rtol=1e-9, atol=1e-10)
    assert [e.step for e in of_kind(result.events, Evaluate)] == [4, 8, 12]
    assert len(of_kind(result.events, WorkerFailure)) == 1
