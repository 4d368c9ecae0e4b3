"""When the controller evaluates, what a failure during an evaluation leads to, and which
checkpoints it writes after one: decisions as pure functions, and the state machine against
`SimulatedWorkers` (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.config import (
    BatchConfig,
    ChaosEvent,
    CheckpointConfig,
    EvaluationConfig,
    FailureConfig,
    FitConfig,
    ScalingConfig,
)
from elastic.control import decisions
from elastic.control.context import Context
from elastic.control.simulation import SimulatedWorkers
from elastic.control.states import Failed, Finished, Machine
from elastic.errors import ConfigError, EvaluationError, UserCodeError
from elastic.runlog import RunLog
from elastic.trainer.replica import UserFailure

B = 16
PER_EPOCH = 6  # steps per epoch of the simulated data set


class _Checkpointing(SimulatedWorkers):
    """Simulated workers that also answer the checkpoint calls, recording (step, manifest
    fields) of every checkpoint asked for."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.written: list[tuple[int, dict[str, Any]]] = []

    def call(self, worker_id: int, method: str, *args: Any) -> Any:
        if method == "restore_checkpoint":
            return {"step": None, "path": None, "skipped": [], "unsigned": []}
        if method == "flush_checkpoints":
            return []
        if method == "checkpoint":
            self.written.append((self.workers[worker_id].step, dict(args[0])))
            return {"submitted": True, "reports": []}
        return super().call(worker_id, method, *args)


def _run(tmp_path, *, steps=10, epochs=None, evaluation=None, chaos=(), sim=None,
         evaluates=True, **config):
    """Runs the machine with 4 simulated members to its end; returns (state, ctx, sim)."""
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=steps, epochs=epochs, steps_per_chunk=8,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                    evaluation=evaluation or EvaluationConfig(every_steps=4), chaos=chaos,
                    **config)
    sim = sim or SimulatedWorkers(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim, has_eval_step=evaluates)
    return Machine(ctx).run(), ctx, sim


def _events(ctx, kind):
    return [e for e in ctx.log.events if e["event"] == kind]


def _evaluated(ctx):
    return [(e["step"], e["score"]) for e in _events(ctx, "evaluate")]


# --- decisions -----------------------------------------------------------------------------


def test_evaluation_is_due_at_multiples_epochs_and_the_end_never_twice():
    base = dict(step=8, evaluated_at=4, every_steps=4, every_epochs=None, epoch_ended=False,
                epochs_done=1, at_end=False, ending=False)
    assert decisions.evaluation_due(**base)
    assert not decisions.evaluation_due(**{**base, "evaluated_at": 8})
    assert not decisions.evaluation_due(**{**base, "step": 9})
    assert decisions.evaluation_due(**{**base, "step": 9, "at_end": True, "ending": True})
    assert not decisions.evaluation_due(**{**base, "step": 9, "ending": True})
    epochs = {**base, "step": 12, "every_steps": None, "every_epochs": 2, "epoch_ended": True}
    assert decisions.evaluation_due(**{**epochs, "epochs_done": 2})
    assert not decisions.evaluation_due(**{**epochs, "epochs_done": 3})
    assert not decisions.evaluation_due(**{**epochs, "epochs_done": 2, "epoch_ended": False})
    assert not decisions.evaluation_due(**{**base, "step": 0, "evaluated_at": None})


def test_chunks_end_at_the_periodic_evaluations():
    base = dict(step=6, steps_per_chunk=8, total_steps=100, steps_left_in_epoch=50,
                trial_steps_left=None, checkpoint_every=None, chaos_steps=[])
    assert decisions.chunk_length(**base) == 8
    assert decisions.chunk_length(**base, evaluation_every=4) == 2
    assert decisions.chunk_length(**{**base, "checkpoint_every": 5}, evaluation_every=4) == 2
    assert decisions.chunk_length(**{**base, "step": 8}, evaluation_every=4) == 4


def test_the_default_evaluates_after_every_epoch():
    assert EvaluationConfig().epoch_interval == 1
    assert EvaluationConfig(every_steps=5).epoch_interval is None
    assert EvaluationConfig(every_steps=5, every_epochs=2).epoch_interval == 2


def test_chaos_in_the_evaluation_is_a_kill_a_hang_or_an_error_of_user_code():
    for action in ("kill", "hang", "raise"):
        assert ChaosEvent(step=4, rank=1, action=action, phase="evaluate").phase == "evaluate"
    with pytest.raises(ValueError, match=r"data, forward, backward \(or 'restore', as a "
                       r"generation forms\), not 'evaluate'"):
        ChaosEvent(step=4, rank=1, action="oom", phase="evaluate")
    with pytest.raises(ValueError, match="'slow' stretches training steps"):
        ChaosEvent(step=4, rank=1, action="slow", phase="evaluate")


def test_an_empty_monitor_is_refused():
    with pytest.raises(ValueError, match=r"checkpoint\.monitor is empty"):
        CheckpointConfig(path="ckpt", monitor=" ")


# --- the state machine -----------------------------------------------------------------------


def test_evaluations_run_at_every_multiple_and_at_the_end_on_every_member(tmp_path):
    end, ctx, sim = _run(tmp_path)
    assert isinstance(end, Finished)
    assert _evaluated(ctx) == [(4, 4.0), (8, 8.0), (10, 10.0)]
    assert sim.evaluations == [(4, (4, 4, 4, 4)), (8, (4, 4, 4, 4)), (10, (4, 4, 4, 4))]
    assert ctx.evaluation == {"score": 10.0} and ctx.evaluated_at == 10
    assert [m["step"] for m in ctx.log.metrics] == list(range(10))
    assert [e["state"] for e in _events(ctx, "state")] == ["running", "finishing", "finished"]


@pytest.mark.parametrize(("every_epochs", "at_end", "expected"), [
    (None, True, [(6, 1), (12, 2), (18, 3), (20, 3)]),
    (2, True, [(12, 2), (20, 3)]),
    (2, False, [(12, 2)]),
])
def test_epoch_evaluations_follow_the_epochs_run(tmp_path, every_epochs, at_end, expected):
    evaluation = EvaluationConfig(every_epochs=every_epochs, at_end=at_end)
    end, ctx, _ = _run(tmp_path, steps=20, epochs=4, evaluation=evaluation)
    assert isinstance(end, Finished)
    # The run ends after step 20, inside the fourth epoch (max_steps comes first): 3 done.
    assert [(e["step"], e["epoch"]) for e in _events(ctx, "evaluate")] == expected


def test_a_worker_killed_during_an_evaluation_recovers_and_it_runs_again_at_the_same_step(tmp_path):
    chaos = (ChaosEvent(step=4, rank=1, action="kill", phase="evaluate"),)
    end, ctx, sim = _run(tmp_path, chaos=chaos)
    assert isinstance(end, Finished)
    [failure] = _events(ctx, "worker_failure")
    assert (failure["lost_ranks"], failure["step"], failure["planned"]) == ([1], 4, True)
    assert [e["phase"] for e in _events(ctx, "chaos")] == ["evaluate"]
    # Evaluated on the three survivors, at the same step, before any further step.
    assert [(step, len(shares)) for step, shares in sim.evaluations][:2] == [(4, 4), (4, 3)]
    assert _evaluated(ctx) == [(4, 4.0), (8, 8.0), (10, 10.0)]
    assert [m["step"] for m in ctx.log.metrics] == list(range(10))  # no step lost or redone
    assert [e["state"] for e in _events(ctx, "state")][:3] == ["running", "recovering", "running"]


def test_a_user_error_in_the_evaluation_is_retried_then_fails_the_run(tmp_path):
    chaos = (ChaosEvent(step=4, rank=2, action="raise", phase="evaluate"),)
    end, ctx, sim = _run(tmp_path, chaos=chaos)
    assert isinstance(end, Finished)
    [error] = _events(ctx, "user_error")
    assert (error["step"], error["ranks"], error["attempt"]) == (4, [2], 1)
    assert [step for step, _ in sim.evaluations][:2] == [4, 4]
    assert _evaluated(ctx)[0] == (4, 4.0)
    assert not _events(ctx, "worker_failure")

    end, ctx, _ = _run(tmp_path / "b", chaos=chaos, failure=FailureConfig(max_user_retries=0))
    assert isinstance(end, Failed) and isinstance(end.error, UserCodeError)
    assert (end.error.step, end.error.rank) == (4, 2)


def _stopped_at_5(tmp_path, sim_type, **config) -> tuple[Any, Context, Any]:
    """Runs one step a chunk on 4 simulated members (a `sim_type`) with a stop asked for
    during the chunk that ends at step 5; returns (state, ctx, sim)."""
    contexts: list[Context] = []

    def stop(step):
        if step >= 4:
            with contexts[0].requests.lock:
                contexts[0].requests.stop = True

    sim = sim_type(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01, before_chunk=stop)
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=100, steps_per_chunk=1,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                    **config)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim, has_eval_step=True)
    contexts.append(ctx)
    return Machine(ctx).run(), ctx, sim


@pytest.mark.parametrize(("every_steps", "expected"), [(4, [(4, 4.0), (5, 5.0)]), (5, [(5, 5.0)])])
def test_a_stopped_run_is_evaluated_where_it_stopped_once(tmp_path, every_steps, expected):
    end, ctx, _ = _stopped_at_5(tmp_path, SimulatedWorkers,
                                evaluation=EvaluationConfig(every_steps=every_steps))
    assert isinstance(end, Finished) and ctx.stopped_early and ctx.step == 5
    assert _evaluated(ctx) == expected
    assert len(_events(ctx, "stopping")) == 1


def test_without_evaluation_data_nothing_is_evaluated(tmp_path):
    end, ctx, sim = _run(tmp_path, evaluates=False)
    assert isinstance(end, Finished)
    assert _events(ctx, "evaluate") == [] and sim.evaluations == []


def test_a_checkpoint_recording_the_monitored_value_follows_every_evaluation(tmp_path):
    sim = _Checkpointing(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01,
                         metrics=lambda step: {"score": 100.0 - step, "other": 1.0})
    checkpoint = CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=4, monitor="score",
                                  mode="max", keep_best=2)
    end, _, _ = _run(tmp_path, sim=sim, checkpoint=checkpoint)
    assert isinstance(end, Finished)
    # One checkpoint per evaluated step (the periodic one at 4 and 8 is the same write), and the
    # final one at 10 records the evaluation at 10.
    assert [step for step, _ in sim.written] == [4, 8, 10]
    assert [meta["monitor"] for _, meta in sim.written] == [
        {"name": "score", "value": 100.0 - s, "mode": "max"} for s in (4, 8, 10)]


def test_a_monitor_the_evaluation_does_not_return_fails_at_the_first_evaluation(tmp_path):
    sim = _Checkpointing(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01)
    checkpoint = CheckpointConfig(path=str(tmp_path / "ckpt"), monitor="val_loss")
    end, ctx, _ = _run(tmp_path, sim=sim, checkpoint=checkpoint)
    assert isinstance(end, Failed) and isinstance(end.error, ConfigError)
    assert "checkpoint.monitor is 'val_loss', but the evaluation returned score" in str(end.error)
    assert _evaluated(ctx) == [(4, 4.0)] and sim.written == []


def test_a_monitor_without_anything_to_evaluate_fails_at_the_start(tmp_path):
    sim = _Checkpointing(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01)
    checkpoint = CheckpointConfig(path=str(tmp_path / "ckpt"), monitor="val_loss")
    end, ctx, _ = _run(tmp_path, sim=sim, checkpoint=checkpoint, evaluates=False)
    assert isinstance(end, Failed) and isinstance(end.error, ConfigError)
    assert "evaluates nothing" in str(end.error)
    assert ctx.log.metrics == []


def test_a_checkpoint_written_before_the_evaluation_of_its_step_is_written_again_with_the_value(
        tmp_path):
    end, ctx, sim = _stopped_at_5(
        tmp_path, _Checkpointing, evaluation=EvaluationConfig(every_steps=4),
        checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=1, monitor="score"))
    assert isinstance(end, Finished)
    # Step 5's periodic checkpoint came before the stop's evaluation at 5: it is written again
    # with the value, and the final checkpoint (the same) is not written a third time.
    assert [(step, "monitor" in meta) for step, meta in sim.written] == [
        (1, False), (2, False), (3, False), (4, True), (5, False), (5, True)]
    assert _evaluated(ctx) == [(4, 4.0), (5, 5.0)]


def test_an_evaluations_retries_are_counted_apart_from_the_next_steps(tmp_path):
    # The evaluation at step 4 raises once and is retried; then training step 4 (the next one)
    # raises once: with one retry allowed, each has its own, and the run finishes.
    chaos = (ChaosEvent(step=4, rank=2, action="raise", phase="evaluate"),)
    sim = SimulatedWorkers(dataset_size=B * PER_EPOCH, capacity=4, start_delay_s=0.01,
                           votes={4: [UserFailure(4, (1,), "Traceback\nKeyError: 'x'")]})
    end, ctx, _ = _run(tmp_path, chaos=chaos, sim=sim, failure=FailureConfig(max_user_retries=1))
    assert isinstance(end, Finished)
    assert [(e["step"], e["ranks"], e["attempt"]) for e in _events(ctx, "user_error")] == [
        (4, [2], 1), (4, [1], 1)]

    end, ctx, _ = _run(tmp_path / "b", chaos=chaos, failure=FailureConfig(max_user_retries=0))
    assert type(end.error) is EvaluationError
    assert str(end.error).startswith("the evaluation at step 4 failed on 1 attempts")


def test_only_evaluations_on_the_schedule_step_an_evaluation_scheduler(tmp_path):
    # Steps 4 and 8 are on the schedule (the one at 4 runs again after a kill); the run's end
    # at 10 is not: where a run ends must not change its learning-rate schedule.
    chaos = (ChaosEvent(step=4, rank=1, action="kill", phase="evaluate"),)
    end, _ctx, sim = _run(tmp_path, chaos=chaos)
    assert isinstance(end, Finished)
    assert [(step, scheduled) for (step, _), scheduled in zip(sim.evaluations, sim.scheduled,
                                                              strict=True)] == [
        (4, True), (4, True), (8, True), (10, False)]
