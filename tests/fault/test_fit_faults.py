"""Real worker faults during elastic.fit: SIGKILL in every phase of the step, and a hang."""

import os
import signal
import threading
from datetime import timedelta

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, CheckpointConfig, FailureConfig, FitConfig, ScalingConfig
from elastic.events import (
    CheckpointBusy,
    CheckpointFailed,
    CheckpointWritten,
    Failed,
    Nonfinite,
    Recovered,
    Resumed,
    WorkerFailure,
    WorkerHung,
    WorkerJoined,
    WorkerStarting,
    read_events,
)
from tests.events import kinds, of_kind
from tests.jobs import reference_weights, regression_job

pytestmark = pytest.mark.fault

B = 16


def _config(tmp_path, chaos, **kwargs):
    return FitConfig(
        scaling=ScalingConfig(num_workers=4, min_workers=1), max_steps=9,
        batch=BatchConfig(global_batch_size=B, max_micro_batch=4),
        run_dir=str(tmp_path / "run"), chaos=chaos, **kwargs,
    )


def _kinds(result, cls):
    return of_kind(result.events, cls)


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "allreduce", "optimizer"])
def test_sigkill_in_any_phase_recovers_to_the_reference_weights(ray_cluster, tmp_path, phase):
    chaos = (ChaosEvent(step=4, rank=3, action="kill", phase=phase),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos))
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    assert [(f.lost_ranks, f.planned) for f in _kinds(result, WorkerFailure)] == [([3], True)]
    (recovered,) = _kinds(result, Recovered)
    assert recovered.world_before == 4
    assert recovered.world_after == 3


def test_a_hung_worker_is_found_by_the_watchdog_killed_and_the_run_continues(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=3, rank=1, action="hang", phase="forward"),)
    config = _config(tmp_path, chaos, failure=FailureConfig(hang_timeout=timedelta(seconds=2)))
    result = elastic.fit(regression_job(), config)
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    hung = _kinds(result, WorkerHung)
    assert [(h.rank, h.phase) for h in hung] == [(1, "forward")]
    assert [(f.lost_ranks, f.planned) for f in _kinds(result, WorkerFailure)] == [([1], False)]


def test_an_unplanned_death_is_reported_with_rays_reason(ray_cluster, tmp_path):
    # SIGKILL from outside (as the OOM killer would): not planned, and Ray's reason is kept.
    name = "unplanned-kill"
    config = _config(tmp_path, (), name=name).model_copy(update={"max_steps": 400})
    killed = threading.Event()

    def kill_rank_1() -> None:
        while not killed.is_set():
            try:
                status = elastic.status(name)
            except elastic.errors.RunNotFoundError:
                status = None
            if status and status["state"] == "running" and status["step"] >= 2:
                os.kill(status["workers"][1]["pid"], signal.SIGKILL)
                killed.set()
                return
            killed.wait(0.05)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    try:
        result = elastic.fit(regression_job(), config)
    finally:
        killed.set()
        killer.join()
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 400), rtol=1e-9, atol=1e-9)
    (failure,) = _kinds(result, WorkerFailure)
    assert failure.planned is False
    assert failure.lost_ranks == [1]
    assert "exit" in failure.reasons[0].lower()


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


@pytest.mark.parametrize("stage", [0, 1])
def test_below_min_workers_writes_a_final_checkpoint_that_a_new_run_resumes(ray_cluster, tmp_path,
                                                                           stage):
    # Stage 1: the survivor writes the dead owner's parts too (before, the dead member was
    # asked for its shard and the final checkpoint was skipped).
    from elastic.config import ShardingConfig
    from elastic.errors import InsufficientWorkersError

    ckpt = CheckpointConfig(path=str(tmp_path / "ckpt"))
    chaos = (ChaosEvent(step=5, rank=1, action="kill", phase="forward"),)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=2), max_steps=9, checkpoint=ckpt,
        batch=BatchConfig(global_batch_size=B), run_dir=str(tmp_path / "run"), chaos=chaos,
        failure=FailureConfig(capacity_timeout=timedelta(seconds=0.2)),
        sharding=ShardingConfig(stage=stage),
    )
    with pytest.raises(InsufficientWorkersError):
        elastic.fit(regression_job(), config)
    written = kinds(read_events(tmp_path / "run"))
    assert written.index(CheckpointWritten) < written.index(Failed)
    saved = elastic.load_checkpoint(ckpt.path)
    assert saved.step == 5
    torch.testing.assert_close(saved.parts["model"], reference_weights(0, B, 5), rtol=1e-9, atol=1e-10)
    # Capacity is back: a new run on the same path resumes at step 5 and ends on the reference.
    again = config.model_copy(update={"chaos": (), "run_dir": str(tmp_path / "again")})
    result = elastic.fit(regression_job(), again)
    assert [e.step for e in _kinds(result, Resumed)] == [5]
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)


def test_a_nan_loss_stops_the_run_with_rank_and_step(ray_cluster, tmp_path):
    from elastic.errors import NonFiniteLossError
    from tests.jobs import poisoned_job, poisoned_steps

    config = FitConfig(scaling=ScalingConfig(num_workers=4), max_steps=12,
                       batch=BatchConfig(global_batch_size=B, rebalance=False, autotune=False),
                       run_dir=str(tmp_path / "run"))
    (step, position), *_ = poisoned_steps(0, B, 12)
    with pytest.raises(NonFiniteLossError) as info:
        elastic.fit(poisoned_job(), config)
    assert (info.value.step, info.value.rank) == (step, position // (B // 4))


def test_nan_steps_are_skipped_on_every_rank_when_asked(ray_cluster, tmp_path):
    from tests.jobs import poisoned_job, poisoned_steps, reference_skipping_nonfinite

    config = FitConfig(scaling=ScalingConfig(num_workers=4), max_steps=18,
                       batch=BatchConfig(global_batch_size=B, rebalance=False, autotune=False),
                       failure=FailureConfig(nonfinite="skip"), run_dir=str(tmp_path / "run"))
    result = elastic.fit(poisoned_job(), config)
    assert result.steps == 18
    poisoned = poisoned_steps(0, B, 18)
    assert len(poisoned) == 3  # once per epoch
    assert [(e.step, e.ranks) for e in _kinds(result, Nonfinite)] == [
        (s, [p // (B // 4)]) for s, p in poisoned]
    torch.testing.assert_close(result.model_state, reference_skipping_nonfinite(0, B, 18),
                               rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("async_write", [True, False])
def test_sigkill_during_a_checkpoint_write_recovers_and_leaves_only_good_checkpoints(
        ray_cluster, tmp_path, async_write):
    from elastic.checkpoint.store import list_steps

    ckpt = CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=2, keep_last=10,
                            async_write=async_write)
    chaos = (ChaosEvent(step=3, rank=0, action="kill", phase="checkpoint"),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos, checkpoint=ckpt))
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    assert [f.lost_ranks for f in _kinds(result, WorkerFailure)] == [[0]]
    # The write that was cut short never counts; every checkpoint that loads is exact.
    steps = list_steps(ckpt.path)
    assert 9 in steps
    loaded = 0
    for step in steps:
        try:
            saved = elastic.load_checkpoint(ckpt.path, step=step)
        except elastic.errors.CheckpointCorruptError:
            continue
        loaded += 1
        torch.testing.assert_close(saved.parts["model"], reference_weights(0, B, step),
                                   rtol=1e-9, atol=1e-10)
    assert loaded >= 3


@pytest.mark.parametrize("async_write", [True, False])
def test_a_checkpoint_write_that_hangs_fails_by_its_time_limit_and_the_run_goes_on(
        ray_cluster, tmp_path, async_write):
    # Storage that stops answering in the middle of the write due at step 4 (after step 3):
    # the run waits for it timeout at most, goes on, and ends on the reference weights;
    # the checkpoints due while it hangs (the final one too) are skipped and say why.
    ckpt = CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=2, keep_last=10,
                            async_write=async_write, timeout=timedelta(seconds=3))
    chaos = (ChaosEvent(step=3, rank=0, action="hang", phase="checkpoint"),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos, checkpoint=ckpt))
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    assert not _kinds(result, WorkerFailure)
    [hung] = _kinds(result, CheckpointFailed)
    written = [e.step for e in _kinds(result, CheckpointWritten)]
    assert written and max(written) < hung.step and hung.step >= 3
    assert "checkpoint.timeout (3 s)" in hung.error and ckpt.path in hung.error
    busy = _kinds(result, CheckpointBusy)
    # Before the hang, a write still in flight on a slow machine can put one off (the hang
    # then fires at the next); after it, each due checkpoint is skipped, the final one too.
    before = [b for b in busy if b.step < hung.step]
    after = [b for b in busy if b.step > hung.step]
    assert all("still in flight" in b.note for b in before)
    assert after and after[-1].step == 9 and len(before) + len(after) == len(busy)
    assert f"the write of step {hung.step} has run" in after[-1].note
    assert elastic.load_checkpoint(ckpt.path).step == max(written)


def test_below_min_workers_the_run_waits_for_capacity_and_continues(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=3, rank=1, action="kill", phase="backward"),)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=2), max_steps=9,
        batch=BatchConfig(global_batch_size=B), run_dir=str(tmp_path / "run"), chaos=chaos,
    )
    result = elastic.fit(regression_job(), config)
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    order = kinds(result.events)
    # No step ran on one worker: the replacement joined before the ring was rebuilt.
    failure = order.index(WorkerFailure)
    assert order.index(WorkerJoined, failure) < order.index(Recovered, failure)
    assert {m["world_size"] for m in result.metrics} == {2}
    (recovered,) = _kinds(result, Recovered)
    assert recovered.world_after == 2


def test_without_replacements_the_run_goes_on_with_the_survivors(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=3, rank=2, action="kill", phase="forward"),)
    config = _config(tmp_path, chaos, failure=FailureConfig(replace_lost_workers=False))
    result = elastic.fit(regression_job(), config)
    assert result.steps == 9
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 9), rtol=1e-9, atol=1e-10)
    assert not [e for e in _kinds(result, WorkerStarting) if e.reason == "replacement"]
    assert not _kinds(result, WorkerJoined)
    assert [m["world_size"] for m in result.metrics] == [4] * 3 + [3] * 6
