"""Real worker faults during elastic.fit: SIGKILL in every phase of the step, and a hang."""

from datetime import timedelta

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FailureConfig, FitConfig, ScalingConfig
from tests.jobs import reference_weights, regression_job

pytestmark = pytest.mark.fault

B = 16


def _config(tmp_path, chaos, **kwargs):
    return FitConfig(
        scaling=ScalingConfig(num_workers=4, min_workers=1), max_steps=9,
        batch=BatchConfig(global_batch_size=B, max_micro_batch=4),
        run_dir=str(tmp_path / "run"), chaos=chaos, **kwargs,
    )


def _kinds(result, kind):
    return [e for e in result.events if e["event"] == kind]


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "allreduce", "optimizer"])
def test_sigkill_in_any_phase_recovers_to_the_reference_weights(ray_cluster, tmp_path, phase):
    chaos = (ChaosEvent(step=4, rank=3, action="kill", phase=phase),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos))
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    assert [f["lost_ranks"] for f in _kinds(result, "worker_failure")] == [[3]]
    (recovered,) = _kinds(result, "recovered")
    assert recovered["world_before"] == 4
    assert recovered["world_after"] == 3


def test_a_hung_worker_is_found_by_the_watchdog_killed_and_the_run_continues(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=3, rank=1, action="hang", phase="forward"),)
    config = _config(tmp_path, chaos, failure=FailureConfig(hang_timeout=timedelta(seconds=2)))
    result = elastic.fit(regression_job(), config)
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    hung = _kinds(result, "worker_hung")
    assert [(h["rank"], h["phase"]) for h in hung] == [(1, "forward")]
    assert [f["lost_ranks"] for f in _kinds(result, "worker_failure")] == [[1]]


def test_losing_every_worker_fails_with_a_typed_error_instead_of_restarting_from_scratch(
        ray_cluster, tmp_path):
    from elastic.errors import WorkerLostError

    chaos = (ChaosEvent(step=3, rank=0, action="kill", phase="forward"),
             ChaosEvent(step=3, rank=1, action="kill", phase="forward"))
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1), max_steps=9,
        batch=BatchConfig(global_batch_size=B), run_dir=str(tmp_path / "run"), chaos=chaos,
    )
    with pytest.raises(WorkerLostError, match="no checkpoint") as info:
        elastic.fit(regression_job(), config)
    assert info.value.step == 3


def test_below_min_workers_without_capacity_in_time_fails_with_a_clear_error(ray_cluster, tmp_path):
    from elastic.errors import InsufficientWorkersError

    chaos = (ChaosEvent(step=2, rank=1, action="kill", phase="forward"),)
    # A replacement cannot start within 0.2 s (a worker process plus torch takes seconds).
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=2), max_steps=9,
        batch=BatchConfig(global_batch_size=B), run_dir=str(tmp_path / "run"), chaos=chaos,
        failure=FailureConfig(capacity_timeout=timedelta(seconds=0.2)),
    )
    with pytest.raises(InsufficientWorkersError, match="min_workers"):
        elastic.fit(regression_job(), config)
