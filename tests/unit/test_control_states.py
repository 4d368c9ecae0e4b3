"""The controller's state machine, failure policy and decisions, without Ray.

The machine runs against `SimulatedWorkers` (members are records, time is simulated), so every
transition and every failure path is driven here in milliseconds, at up to 256 members.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest

from elastic.config import (
    BatchConfig,
    ChaosEvent,
    CheckpointConfig,
    FailureConfig,
    FitConfig,
    ScalingConfig,
)
from elastic.control import decisions
from elastic.control.context import Context, Roster
from elastic.control.policy import BackOff, Fail, FailurePolicy, Reconfigure, Recover, Retry
from elastic.control.port import ChunkDone, ChunkInterrupted, ChunkSkipped, ChunkVotedDown
from elastic.control.simulation import SimulatedWorkers
from elastic.control.states import Failed, Finished, Machine
from elastic.errors import (
    CollectiveError,
    ConfigError,
    ControllerError,
    GenerationOutOfMemoryError,
    InsufficientWorkersError,
    MembershipChanged,
    NonFiniteLossError,
    RendezvousError,
    StartupTimeoutError,
    UserCodeError,
    WorkerHangError,
    WorkerLostError,
    WorkerOutOfMemoryError,
)
from elastic.runlog import RunLog
from elastic.trainer.data import Cursor
from elastic.trainer.replica import NonFinite, OutOfMemory, UserFailure

PER_RANK = 4  # samples per rank and step


def _run(tmp_path, world=4, *, steps=24, chunk=4, sim=None, **config):
    """Runs the machine to its end; returns (final state, context, simulation)."""
    config.setdefault("scaling", ScalingConfig(num_workers=world, min_workers=1, max_workers=world))
    config.setdefault("batch", BatchConfig(global_batch_size=world * PER_RANK))
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=steps,
                    steps_per_chunk=chunk, **config)
    sim = sim or SimulatedWorkers(dataset_size=world * PER_RANK * 1000, capacity=world,
                                  start_delay_s=0.02)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    return end, ctx, sim


def _states(ctx):
    return [(e["previous"], e["state"]) for e in ctx.log.events if e["event"] == "state"]


def _events(ctx, kind):
    return [e for e in ctx.log.events if e["event"] == kind]


def _steps(ctx):
    return [m["step"] for m in ctx.log.metrics]


# --- transitions ---------------------------------------------------------------------------


def test_an_uninterrupted_run_starts_runs_finishes(tmp_path):
    end, ctx, _ = _run(tmp_path, steps=10)
    assert isinstance(end, Finished) and end.model_state == {"step": 10}
    assert _states(ctx) == [("starting", "running"), ("running", "finishing"),
                            ("finishing", "finished")]
    assert _steps(ctx) == list(range(10))
    assert ctx.cursor.samples == 10 * 4 * PER_RANK
    assert [e["reason"] for e in _events(ctx, "generation")] == ["start"]


def test_a_lost_worker_recovers_in_place_and_its_replacement_joins(tmp_path):
    end, ctx, _ = _run(tmp_path, chaos=(ChaosEvent(step=6, rank=1, action="kill"),))
    assert isinstance(end, Finished)
    assert _states(ctx) == [
        ("starting", "running"), ("running", "recovering"), ("recovering", "running"),
        ("running", "resizing"), ("resizing", "running"), ("running", "finishing"),
        ("finishing", "finished")]
    [failure] = _events(ctx, "worker_failure")
    assert (failure["lost_ranks"], failure["step"], failure["planned"]) == ([1], 6, True)
    assert [e["reason"] for e in _events(ctx, "generation")] == ["start", "recovery", "resize"]
    assert [e["why"] for e in _events(ctx, "worker_lost")] == ["actor died"]
    assert _steps(ctx) == list(range(24))  # every step once: the interrupted one redone
    assert len(ctx.members) == 4 and ctx.policy.workers_lost == 1
    [recovered] = _events(ctx, "recovered")
    assert (recovered["world_before"], recovered["world_after"]) == (4, 3)


def test_a_joined_worker_is_not_in_the_world_until_its_resize_formed_a_generation(tmp_path):
    # World 1 after a kill; the replacement is admitted at a boundary (a member from then on)
    # and the resize forms its generation. `status` reports `ctx.roster()`: until that
    # generation formed, the replacement is joining, with no rank, and the world is the one
    # rank that holds the state (a caller that saw two workers and killed rank 0 lost it).
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=16, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=2),
                    batch=BatchConfig(global_batch_size=2 * PER_RANK),
                    chaos=(ChaosEvent(step=6, rank=1, action="kill"),))
    sim = SimulatedWorkers(dataset_size=2 * PER_RANK * 1000, capacity=2, start_delay_s=0.02)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    seen = {}

    def on_change(previous, state):
        roster = ctx.roster()
        seen[previous.value, state.label.value] = (
            [m.worker_id for m in roster.world], [m.worker_id for m in roster.joining],
            roster.generation, ctx.ids())

    assert ctx.roster() == Roster(-1, [], [])
    end = Machine(ctx, on_change=on_change).run()
    assert isinstance(end, Finished)
    assert [e["reason"] for e in _events(ctx, "generation")] == ["start", "recovery", "resize"]
    assert seen["recovering", "running"] == ([0], [], 1, [0])
    # Admitted: a member, not yet in the world.
    assert seen["running", "resizing"] == ([0], [2], 1, [0, 2])
    assert seen["resizing", "running"] == ([0, 2], [], 2, [0, 2])
    assert ctx.roster().generation == _events(ctx, "generation")[-1]["generation"]


def test_scale_down_then_up_resizes_at_boundaries(tmp_path):
    # `before_chunk` runs as a chunk is handed out, ahead, while the one before runs: the
    # scale down ends that one after the step in flight (the simulation's first step); the
    # scale up applies at the first boundary after the new workers are up.
    made = []

    def requests(step):
        with ctx.requests.lock:
            if step >= 8 and not made:
                made.append(step)
                ctx.requests.target, ctx.requests.scaled_by_user = 2, True
            elif step >= 16 and len(made) == 1:
                made.append(step)
                ctx.requests.target = 4

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0,
                           before_chunk=lambda step: requests(step))
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=16, autotune=False))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished)
    sizes = [m["world_size"] for m in ctx.log.metrics]
    # Made as the chunk from 8 went out (the one from 4 at its first step) and as the one from
    # 17 went out (a growth: the chunk runs on; the workers are up at its end).
    assert made == [8, 17]
    assert sizes == [4] * 5 + [2] * 16 + [4] * 3
    assert [e["world_size"] for e in _events(ctx, "resized")] == [2, 4]
    assert _states(ctx).count(("running", "resizing")) == 2
    assert _steps(ctx) == list(range(24))


def test_a_stop_request_finishes_after_the_step_in_flight(tmp_path):
    def stop(step):
        if step >= 8:
            with ctx.requests.lock:
                ctx.requests.stop = True

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, before_chunk=stop)
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=100, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4),
                    batch=BatchConfig(global_batch_size=16, autotune=False))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished) and ctx.stopped_early
    # Made as the chunk from 8 went out ahead while the one from 4 ran its first step: that
    # one ended after it, the one from 8 was skipped, and no further one ran.
    assert ctx.step == 5 and _steps(ctx) == list(range(5))
    assert [e["step"] for e in _events(ctx, "stopping")] == [5]
    assert _states(ctx)[-2:] == [("running", "finishing"), ("finishing", "finished")]


# --- failures ------------------------------------------------------------------------------


def test_a_stop_while_waiting_for_capacity_stops_the_run_instead_of_failing_it(tmp_path):
    # Two of four lost at step 6 (min_workers 3) and no replacement can come: the run waits.
    # Before, a stop then waited out failure.capacity_timeout and the run failed.
    class NoCapacity(SimulatedWorkers):
        waits = 0

        def spawn(self):
            worker_id = super().spawn()
            if worker_id >= 4:  # replacements never come up
                self.workers[worker_id].ready_at = float("inf")
            return worker_id

        def admit(self, wanted, timeout):
            if ctx_box and ctx_box[0].members and len(ctx_box[0].members) < 3:
                type(self).waits += 1
                if type(self).waits == 2:  # the user's stop arrives during the wait
                    with ctx_box[0].requests.lock:
                        ctx_box[0].requests.stop = True
            return super().admit(wanted, timeout)

    ctx_box = []
    sim = NoCapacity(dataset_size=16000, capacity=4, start_delay_s=0.02)
    config = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                       scaling=ScalingConfig(num_workers=4, min_workers=3, max_workers=4),
                       batch=BatchConfig(global_batch_size=16),
                       failure=FailureConfig(capacity_timeout=timedelta(hours=1)),
                       chaos=(ChaosEvent(step=6, rank=1, action="kill"),
                              ChaosEvent(step=6, rank=2, action="kill")))
    ctx = Context(config, "sim", RunLog(str(tmp_path)), sim)
    ctx_box.append(ctx)
    end = Machine(ctx).run()
    assert isinstance(end, Finished) and ctx.stopped_early
    assert end.model_state == {"step": 6} and _steps(ctx) == list(range(6))
    assert not _events(ctx, "failed")


def test_too_few_workers_at_start_fail_with_startup_timeout(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=2)
    end, ctx, _ = _run(tmp_path, sim=sim,
                       scaling=ScalingConfig(num_workers=4, min_workers=3, max_workers=4),
                       failure=FailureConfig(startup_timeout=timedelta(seconds=5)))
    assert isinstance(end, Failed) and isinstance(end.error, StartupTimeoutError)
    assert "failure.startup_timeout" in str(end.error)
    assert _states(ctx) == [("starting", "failed")]


def test_a_worker_that_dies_as_the_run_starts_is_replaced_and_the_others_train(tmp_path):
    # Before: the first start failure of any kind failed the run, min_workers = 1 or not.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           start_errors={2: WorkerLostError("worker 2 died while starting: "
                                                            "its node was lost")})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Finished) and _steps(ctx) == list(range(24))
    assert [e["error"] for e in _events(ctx, "worker_start_failed")] == [
        "worker 2 died while starting: its node was lost"]
    assert [e["workers"] for e in _events(ctx, "generation")][:2] == [[0, 1, 3], [0, 1, 3, 4]]
    assert ctx.cursor.samples == 24 * 4 * PER_RANK  # the global batch never changed


def test_workers_dying_as_the_run_starts_below_min_workers_fail_it_saying_so(tmp_path):
    lost = {w: WorkerLostError(f"worker {w} died while starting: node lost") for w in (1, 2)}
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           start_errors=lost)
    end, _, _ = _run(tmp_path, sim=sim,
                       scaling=ScalingConfig(num_workers=4, min_workers=3, max_workers=4))
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert str(end.error) == (
        "only 2 of 4 workers started, fewer than scaling.min_workers = 3; 2 died while "
        "starting, the first: worker 1 died while starting: node lost")


def test_a_factory_that_raises_on_one_worker_at_start_fails_the_run_with_its_error(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           start_errors={3: ConfigError("worker 3: model() raised: KeyError")})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and str(end.error) == "worker 3: model() raised: KeyError"
    assert _states(ctx) == [("starting", "failed")]


def test_a_run_that_fails_waits_for_its_checkpoint_writes_in_flight_first(tmp_path):
    # Before, a background write of a step the run had reached died with the workers.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4,
                           votes={9: [UserFailure(9, (1,), "Traceback\nValueError: bad")] * 9})
    asked, call = [], sim.call

    def recorded(worker_id, method, *args):
        asked.append((method, sorted(sim.checkpoints)))
        return call(worker_id, method, *args)

    sim.call = recorded
    end, ctx, _ = _run(tmp_path, sim=sim, failure=FailureConfig(max_user_retries=1),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=4))
    assert isinstance(end, Failed) and isinstance(end.error, UserCodeError)
    flushed = [i for i, (method, _) in enumerate(asked) if method == "flush_checkpoints"]
    assert asked[flushed[-1]][1] == [4, 8]  # after the last write, before the end
    assert len(flushed) == 4  # every member asked
    assert [e["event"] for e in ctx.log.events][-2:] == ["failed", "state"]


def test_a_run_that_fails_for_storage_that_does_not_answer_waits_for_no_write(tmp_path):
    from elastic.errors import CheckpointTimeoutError

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02)
    asked, call = [], sim.call

    def hung(worker_id, method, *args):
        asked.append(method)
        if method == "restore_checkpoint":
            raise CheckpointTimeoutError("loading the newest checkpoint did not finish")
        return call(worker_id, method, *args)

    sim.call = hung
    end, _, _ = _run(tmp_path, sim=sim,
                     checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=4))
    assert isinstance(end, Failed) and isinstance(end.error, CheckpointTimeoutError)
    assert "flush_checkpoints" not in asked  # each would wait out its write's time limit


def test_a_global_batch_that_follows_the_world_size_replans_the_steps_and_says_so(tmp_path):
    # Before, `planned` was written once: a progress bar stayed at the first total.
    sim = SimulatedWorkers(dataset_size=1600, capacity=4, start_delay_s=100.0)
    end, ctx, _ = _run(tmp_path, sim=sim, steps=None, epochs=1,
                       chaos=(ChaosEvent(step=20, rank=3, action="kill"),),
                       batch=BatchConfig(global_batch_size=16, policy="scale_with_workers"))
    assert isinstance(end, Finished)
    # 100 steps of 16 planned; after step 20 at 12 a step, the 1280 samples left take 106 more
    assert [e["total_steps"] for e in _events(ctx, "planned")] == [100, 126]
    assert ctx.step == 126 and _steps(ctx)[-1] == 125


def test_a_run_resumed_in_the_middle_of_a_learning_rate_ramp_goes_on_from_where_it_was(tmp_path):
    # Policy 'scale_with_workers': a kill at step 4 shrinks the run from 4 workers to 3, the
    # rate ramps from 1.0 to 0.75 over 20 steps; the run ends at step 10 in the middle of it.
    # Resumed at 4 workers (a new run from the checkpoints, as `elastic resume` or a
    # restarted controller does), the ramp goes from the factor it had reached back to 1.0.
    # Before, the resumed run jumped to 1.0 at once: the ramp was not in the checkpoints.
    store: list = []
    batch = BatchConfig(global_batch_size=16, policy="scale_with_workers", warmup_steps=20)
    checkpoint = CheckpointConfig(path=str(tmp_path / "c"), every_steps=2)
    first = SimulatedWorkers(dataset_size=1600, capacity=4, start_delay_s=100.0, store=store)
    end, ctx, _ = _run(tmp_path / "first", sim=first, steps=10, batch=batch,
                       checkpoint=checkpoint, chaos=(ChaosEvent(step=4, rank=3, action="kill"),))
    assert isinstance(end, Finished) and max(c["step"] for c in store) == 10
    lr = {m["step"]: m["lr"] for m in ctx.log.metrics}
    assert lr[3] == 0.1 and lr[9] == pytest.approx(0.1 * (1 - 0.25 * 6 / 20))
    again = SimulatedWorkers(dataset_size=1600, capacity=4, start_delay_s=0.02, store=store)
    end, ctx, _ = _run(tmp_path / "again", sim=again, steps=16, batch=batch,
                       checkpoint=checkpoint)
    assert isinstance(end, Finished) and _steps(ctx) == list(range(10, 16))
    [planned] = _events(ctx, "batch_planned")
    assert (planned["step"], planned["world_size"], planned["global_batch_size"]) == (10, 4, 16)
    assert planned["lr_factor_from"] == pytest.approx(lr[9] / 0.1)
    assert (planned["lr_factor_to"], planned["warmup_steps"]) == (1.0, 20)
    factor = lr[9] / 0.1
    assert [m["lr"] for m in ctx.log.metrics] == pytest.approx(
        [0.1 * (factor + (1 - factor) * (s - 9) / 20) for s in range(10, 16)])
    # Its checkpoints record the ramp, for the next resume.
    assert store[-1]["step"] == 16 and store[-1]["meta"]["lr_ramp"] == {
        "start_step": 10, "warmup_steps": 20, "from_factor": planned["lr_factor_from"],
        "to_factor": 1.0}
    # Resumed again at 3 workers, from the checkpoint of step 12 (the newer ones lost): a
    # new ramp towards 0.75 starts from the factor the recorded one had reached at step 11.
    del store[[c["step"] for c in store].index(16)], store[[c["step"] for c in store].index(14)]
    third = SimulatedWorkers(dataset_size=1600, capacity=3, start_delay_s=0.02, store=store)
    end, ctx3, _ = _run(tmp_path / "third", sim=third, steps=14, batch=batch,
                        checkpoint=checkpoint, scaling=ScalingConfig(num_workers=4,
                                                                      min_workers=1))
    [planned3] = _events(ctx3, "batch_planned")
    assert (planned3["step"], planned3["world_size"]) == (12, 3)
    rate = {m["step"]: m["lr"] for m in ctx.log.metrics}
    assert planned3["lr_factor_from"] == pytest.approx(rate[11] / 0.1)
    assert [m["lr"] for m in ctx3.log.metrics] == pytest.approx(
        [0.1 * (rate[11] / 0.1 + (0.75 - rate[11] / 0.1) * (s - 11) / 20) for s in (12, 13)])


def test_a_ramp_recorded_in_a_checkpoint_is_not_taken_by_a_run_of_policy_fixed(tmp_path):
    from elastic.control.cursor import Cursor

    ramp = {"start_step": 2, "warmup_steps": 20, "from_factor": 0.5, "to_factor": 0.75}
    store = [{"step": 4, "cursor": Cursor(step=4, offset=64, samples=64), "meta": {"lr_ramp": ramp}}]
    sim = SimulatedWorkers(dataset_size=1600, capacity=4, start_delay_s=0.02, store=store)
    end, ctx, _ = _run(tmp_path, sim=sim, steps=8, batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=2))
    assert isinstance(end, Finished) and _steps(ctx) == [4, 5, 6, 7]
    assert {m["lr"] for m in ctx.log.metrics} == {0.1} and not _events(ctx, "batch_planned")
    assert "lr_ramp" not in store[-1]["meta"]


def test_a_restarted_controller_takes_up_the_stop_and_scale_its_predecessor_was_asked(tmp_path):
    # Before, it forgot them: `elastic stop` had answered, and the run went on to its end.
    from elastic.control.context import standing_requests
    from elastic.events import ScaleRequested, Start, StopRequested, read_jsonl

    earlier = RunLog(str(tmp_path))
    earlier.emit(StopRequested())  # asked of an earlier run of this name: not this one's
    earlier.emit(Start(name="sim", config={}))
    earlier.emit(ScaleRequested(num_workers=3))
    assert standing_requests(earlier.events) == (False, 3)
    earlier.emit(StopRequested())
    earlier.close()
    cfg = FitConfig(run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=16),
                    checkpoint=CheckpointConfig(path=str(tmp_path / "c")))
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02)
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim, restarted=True)
    assert (ctx.requests.stop, ctx.requests.target, ctx.requests.scaled_by_user) == (True, 3, True)
    end = Machine(ctx).run()
    assert isinstance(end, Finished) and ctx.stopped_early and _steps(ctx) == []
    assert not Context(cfg, "sim", RunLog(str(tmp_path)), sim).requests.stop  # not restarted
    # That controller wrote `controller_restarted`, then `start`; were it to die before it
    # stopped, the next one must still stop.
    assert standing_requests(read_jsonl(str(tmp_path / "events.jsonl"))) == (True, 3)


def test_more_losses_than_max_failures_fail_the_run(tmp_path):
    end, ctx, _ = _run(tmp_path, chaos=(ChaosEvent(step=4, rank=0, action="kill"),
                                        ChaosEvent(step=8, rank=0, action="kill")),
                       failure=FailureConfig(max_failures=1))
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert "failure.max_failures = 1" in str(end.error)
    assert _states(ctx)[-1] == ("recovering", "failed")
    assert [e["event"] for e in ctx.log.events][-2:] == ["failed", "state"]


def test_below_min_workers_past_capacity_timeout_fails(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=100.0)
    end, _, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=4, rank=2, action="kill"),),
                       scaling=ScalingConfig(num_workers=4, min_workers=4, max_workers=4),
                       failure=FailureConfig(capacity_timeout=timedelta(seconds=3)))
    assert isinstance(end, Failed) and isinstance(end.error, InsufficientWorkersError)
    assert "scaling.min_workers = 4" in str(end.error)


def test_losing_every_holder_of_the_state_without_a_checkpoint_fails(tmp_path):
    kills = tuple(ChaosEvent(step=5, rank=r, action="kill") for r in range(4))
    end, _, _ = _run(tmp_path, chaos=kills, chunk=5)
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert "no checkpoint is available" in str(end.error)


def test_a_user_error_is_retried_then_the_run_goes_on(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4,
                           votes={5: [UserFailure(5, (2,), "Traceback\nValueError: bad")]})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Finished)
    [error] = _events(ctx, "user_error")
    assert (error["step"], error["ranks"], error["attempt"], error["error"]) == (
        5, [2], 1, "ValueError: bad")
    assert _steps(ctx) == list(range(24))
    assert ("running", "recovering") not in _states(ctx)


def test_a_user_error_past_max_user_retries_fails_with_the_traceback(tmp_path):
    failure = UserFailure(5, (1,), "Traceback\nKeyError: 'x'")
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={5: [failure] * 3})
    end, ctx, _ = _run(tmp_path, sim=sim, failure=FailureConfig(max_user_retries=2))
    assert isinstance(end, Failed) and isinstance(end.error, UserCodeError)
    assert (end.error.rank, end.error.step) == (1, 5)
    assert "KeyError" in end.error.traceback
    assert [e["attempt"] for e in _events(ctx, "user_error")] == [1, 2, 3]


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_step(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={3: [OutOfMemory(3, (2,))]})
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16,
                                                            autotune=False))
    assert isinstance(end, Finished)
    [backoff] = _events(ctx, "oom_backoff")
    assert (backoff["rank"], backoff["micro_batch_before"], backoff["micro_batch_after"]) == (2, 4, 2)
    assert ctx.log.metrics[3]["micro_batches"] == [4, 4, 2, 4]
    assert _steps(ctx) == list(range(24))


def test_out_of_memory_in_a_collective_backs_off_and_re_forms_the_generation(tmp_path):
    """The rank aborted its communicator: the micro-batch is halved as for a vote, and the
    broken generation is re-formed at once from the same members (nobody lost)."""
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={3: [OutOfMemory(3, (2,))]},
                           oom_in_collective=True)
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16,
                                                            autotune=False))
    assert isinstance(end, Finished)
    [backoff] = _events(ctx, "oom_backoff")
    assert (backoff["rank"], backoff["micro_batch_after"]) == (2, 2)
    generations = _events(ctx, "generation")
    assert len(generations) == 2 and generations[0]["world_size"] == generations[1]["world_size"] == 4
    [failure] = _events(ctx, "worker_failure")  # a recovery that loses nobody
    assert (failure["lost_ranks"], failure["step"]) == ([], 3)
    assert ctx.log.metrics[3]["micro_batches"] == [4, 4, 2, 4]
    assert _steps(ctx) == list(range(24))


def test_out_of_memory_in_the_apply_phase_restores_from_a_member_that_committed(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={3: [OutOfMemory(3, (2,))]},
                           oom_in_apply=True)
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16,
                                                            autotune=False))
    assert isinstance(end, Finished)
    generations = _events(ctx, "generation")
    assert [g["source_rank"] for g in generations] == [0, 0]
    assert _steps(ctx) == list(range(24))


def test_every_rank_half_updated_by_out_of_memory_and_no_checkpoint_fails(tmp_path):
    """Out of memory in every rank's apply phase (the same optimizer state everywhere): no
    member holds a committed state, so the run fails instead of training on half-updated
    weights (the simulation asserts that no torn worker is ever taken as the source)."""
    sim = SimulatedWorkers(dataset_size=16000, capacity=4,
                           votes={3: [OutOfMemory(3, (0, 1, 2, 3))]}, oom_in_apply=True)
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16,
                                                            autotune=False))
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert "half updated" in str(end.error) and "no checkpoint is available" in str(end.error)
    assert len(_events(ctx, "generation")) == 1


def test_every_rank_half_updated_in_the_first_step_is_replaced_by_fresh_workers(tmp_path):
    """Step 0's state is the model built from the seed: with no member holding it (all half
    updated by out of memory in the first optimizer step, Adam allocating its state, say) the
    members are replaced and the run goes on from step 0 with a smaller micro-batch."""
    sim = SimulatedWorkers(dataset_size=16000, capacity=8,
                           votes={0: [OutOfMemory(0, (0, 1, 2, 3))]}, oom_in_apply=True)
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16,
                                                            autotune=False),
                       failure=FailureConfig(max_failures=4))
    assert isinstance(end, Finished), end
    lost = _events(ctx, "worker_lost")
    assert sorted(e["worker_id"] for e in lost) == [0, 1, 2, 3]
    assert all("half updated" in e["why"] for e in lost)
    generations = _events(ctx, "generation")
    assert len(generations) == 2 and sorted(generations[1]["workers"]) == [4, 5, 6, 7]
    assert _steps(ctx) == list(range(24))


def test_out_of_memory_at_micro_batch_one_fails(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={3: [OutOfMemory(3, (0,))]})
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=4, autotune=False))
    assert isinstance(end, Failed) and isinstance(end.error, WorkerOutOfMemoryError)
    assert [e["micro_batch_after"] for e in _events(ctx, "oom_backoff")] == [None]


def test_a_model_with_batchnorm_runs_whole_groups_through_a_kill_and_a_rebalance(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, traits={"batchnorm": 3, "dropout": 0})
    end, ctx, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=6, rank=1, action="kill"),))
    assert isinstance(end, Finished)
    [grouped] = _events(ctx, "grouped")
    assert (grouped["groups"], grouped["group_size"], grouped["pinned"]) == (True, 4, False)
    assert not _events(ctx, "micro_batch_tuned")  # a forward is one group: nothing to tune
    shares = [m["shares"] for m in ctx.log.metrics]
    assert [4, 4, 4, 4] in shares and [8, 4, 4] in shares
    assert all(s % 4 == 0 for row in shares for s in row)
    assert all(mb == 4 for m in ctx.log.metrics for mb in m["micro_batches"] if mb is not None)


def test_out_of_memory_at_one_group_fails_naming_the_group_size(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={3: [OutOfMemory(3, (1,))]},
                           traits={"batchnorm": 0, "dropout": 2})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and isinstance(end.error, WorkerOutOfMemoryError)
    assert "one group (batch.group_size" in str(end.error)
    assert [e["micro_batch_after"] for e in _events(ctx, "oom_backoff")] == [None]


def test_groups_off_for_a_model_with_dropout_pins_the_split(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, traits={"batchnorm": 0, "dropout": 1})
    end, ctx, _ = _run(tmp_path, sim=sim, batch=BatchConfig(global_batch_size=16, groups="off"))
    assert isinstance(end, Finished)
    [grouped] = _events(ctx, "grouped")
    assert grouped["pinned"] and "follows the split" in grouped["reason"]
    assert not _events(ctx, "micro_batch_tuned") and not _events(ctx, "rebalanced")
    assert ctx.batch.tuner is None and ctx.batch.weights(ctx.ids()) is None


def test_a_non_finite_step_under_policy_stop_fails(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={7: [NonFinite(7, (0, 3))]})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and isinstance(end.error, NonFiniteLossError)
    assert "failure.nonfinite='skip'" in str(end.error)
    assert _events(ctx, "nonfinite")[-1]["ranks"] == [0, 3]


def test_a_bug_in_the_control_loop_becomes_a_controller_error_with_its_cause(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4)
    sim.call = lambda *args: 1 / 0
    end, _, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and isinstance(end.error, ControllerError)
    assert isinstance(end.error.__cause__, ZeroDivisionError)


def test_a_batch_larger_than_the_data_set_is_a_config_error(tmp_path):
    sim = SimulatedWorkers(dataset_size=8, capacity=4)
    end, _, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and isinstance(end.error, ConfigError)
    assert "batch.global_batch_size" in str(end.error)


def test_workers_that_built_data_sets_of_different_sizes_do_not_start_a_run(tmp_path):
    # One node reads another copy of the files: its order would be another permutation.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, dataset_sizes={2: 15999})
    end, ctx, _ = _run(tmp_path, sim=sim)
    assert isinstance(end, Failed) and isinstance(end.error, ConfigError)
    assert str(end.error).startswith(
        "workers built data sets of different sizes (most workers': 16000 samples; "
        "worker 2 on node sim: 15999)")
    assert "TrainJob.dataset" in str(end.error)
    assert _states(ctx) == [("starting", "failed")] and not _steps(ctx)


def test_a_replacement_that_built_another_data_set_is_refused_and_the_next_one_joins(tmp_path):
    # Worker 4 (the first replacement) lands where the data differ; worker 5 does not.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           dataset_sizes={4: 12000})
    end, ctx, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=6, rank=1, action="kill"),))
    assert isinstance(end, Finished)
    [refused] = _events(ctx, "worker_start_failed")
    assert refused["error"].startswith("workers built data sets of different sizes (the "
                                       "run's: 16000 samples; worker 4 on node sim: 12000)")
    assert [e["worker_id"] for e in _events(ctx, "worker_joined")] == [5]
    assert sorted(m.worker_id for m in ctx.members) == [0, 2, 3, 5]
    assert not sim.workers[4].alive
    assert _steps(ctx) == list(range(24))


# --- scale of the control plane ------------------------------------------------------------


def test_256_members_through_failures_joins_and_resizes(tmp_path):
    world = 256

    def requests(step):
        with ctx.requests.lock:
            if 20 <= step < 32:
                ctx.requests.target, ctx.requests.scaled_by_user = 200, True
            if step >= 32:
                ctx.requests.target = 256

    kills = (ChaosEvent(step=8, rank=17, action="kill"), ChaosEvent(step=8, rank=200, action="kill"),
             ChaosEvent(step=14, rank=0, action="kill"), ChaosEvent(step=40, rank=150, action="kill"))
    sim = SimulatedWorkers(dataset_size=world * PER_RANK * 100, capacity=world,
                           start_delay_s=0.01, before_chunk=lambda step: requests(step))
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=48, steps_per_chunk=4, chaos=kills,
                    scaling=ScalingConfig(num_workers=world, min_workers=128, max_workers=world),
                    batch=BatchConfig(global_batch_size=world * PER_RANK))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished)
    assert [f["lost_ranks"] for f in _events(ctx, "worker_failure")] == [[17, 200], [0], [150]]
    assert ctx.policy.workers_lost == 4
    assert _steps(ctx) == list(range(48))  # every step exactly once
    assert ctx.cursor.samples == 48 * world * PER_RANK  # a constant global batch throughout
    assert {m["global_batch_size"] for m in ctx.log.metrics} == {world * PER_RANK}
    sizes = [m["world_size"] for m in ctx.log.metrics]
    assert 200 in sizes and sizes[-1] == world and min(sizes) >= 128
    assert [e["world_size"] for e in _events(ctx, "resized")][-1] == world
    worker_ids = [e["workers"] for e in _events(ctx, "generation")]
    assert all(len(set(ids)) == len(ids) for ids in worker_ids)  # nobody twice in a ring
    assert len(ctx.members) == world
    # Generations form only at start, after each failure and at each resize.
    reasons = [e["reason"] for e in _events(ctx, "generation")]
    assert reasons.count("recovery") == 3 and reasons[0] == "start"


def _control_calls(tmp_path, world: int) -> int:
    """Python calls made by the control loop (not the simulation) in a 40-step run."""
    sim = SimulatedWorkers(dataset_size=world * PER_RANK * 100, capacity=world)
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path / str(world)), max_steps=40, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=world),
                    batch=BatchConfig(global_batch_size=world * PER_RANK))
    ctx = Context(cfg, "sim", RunLog(cfg.run_dir), sim)
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            name = frame.f_code.co_filename
            if "/elastic/" in name and not name.endswith("simulation.py"):
                calls += 1

    sys.setprofile(profile)
    try:
        Machine(ctx).run()
    finally:
        sys.setprofile(None)
    return calls


def test_control_work_per_step_grows_linearly_with_the_world(tmp_path):
    # Counting calls, not seconds: a quadratic decision would multiply them by 16 from 64 to
    # 256 members; linear work multiplies them by at most 4.
    small, large = _control_calls(tmp_path, 64), _control_calls(tmp_path, 256)
    assert large / small < 4.5, (small, large)


# --- the failure policy ----------------------------------------------------------------------


def test_the_policy_maps_each_error_class_to_its_action():
    policy = FailurePolicy(FailureConfig(max_failures=2, max_user_retries=1))
    assert policy.decide(WorkerLostError("x"), lost=1) == Recover()
    assert policy.decide(WorkerHangError("x"), lost=1) == Recover()
    assert policy.decide(CollectiveError("x")) == Recover()
    assert policy.decide(MembershipChanged("x")) == Reconfigure()
    assert policy.decide(UserCodeError("x", rank=0, step=3, traceback="")) == Retry(1)
    assert isinstance(policy.decide(UserCodeError("x", rank=0, step=3, traceback="")), Fail)
    assert policy.decide(UserCodeError("x", rank=0, step=4, traceback="")) == Retry(1)
    error = NonFiniteLossError("x", rank=0, step=1)
    assert policy.decide(error) == Fail(error)
    config_error = ConfigError("x")
    assert policy.decide(config_error) == Fail(config_error)
    lost = policy.decide(WorkerLostError("x"), lost=1)
    assert isinstance(lost, Fail) and "3 workers lost" in str(lost.error)


def test_a_collective_error_that_recurs_at_one_step_fails_the_run_instead_of_looping(tmp_path):
    # Malformed data a rank sends in every redo of the step: each time a recovery with nobody
    # lost. Before, the generation's retry count started over at each formed generation, and
    # the run recovered for ever.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, votes={5: ["collective"] * 9})
    end, ctx, _ = _run(tmp_path, sim=sim, failure=FailureConfig(max_collective_retries=2))
    assert isinstance(end, Failed) and isinstance(end.error, CollectiveError)
    assert str(end.error).startswith(
        "a collective failed 3 times in a row after step 5 with no worker lost, more than "
        "failure.max_collective_retries = 2")
    assert [e["reason"] for e in _events(ctx, "generation")] == ["start", "recovery", "recovery"]
    assert _steps(ctx) == list(range(5))
    # Fewer in a row than the limit: recovered, and the count starts over past the step.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4,
                           votes={5: ["collective"] * 2, 9: ["collective"] * 2})
    end, ctx, _ = _run(tmp_path / "again", sim=sim, failure=FailureConfig(max_collective_retries=2))
    assert isinstance(end, Finished) and _steps(ctx) == list(range(24))


def test_the_policy_retries_a_generation_three_times_then_fails():
    policy = FailurePolicy(FailureConfig())
    for _ in range(3):
        assert policy.decide(RendezvousError("boom", generation=5)) == Recover()
    failed = policy.decide(RendezvousError("boom", generation=5))
    assert isinstance(failed, Fail) and "could not form after 4 attempts: boom" in str(failed.error)
    policy.formed()
    assert policy.decide(RendezvousError("boom", generation=6)) == Recover()


def test_the_policy_halves_micro_batches_until_one():
    policy = FailurePolicy(FailureConfig())
    error = WorkerOutOfMemoryError("x", rank=1, step=3)
    action = policy.decide(error, micro_batches={1: (7, 8), 2: (9, 3)})
    assert isinstance(action, BackOff)
    assert [(d.rank, d.worker_id, d.before, d.after) for d in action.decisions] == [
        (1, 7, 8, 4), (2, 9, 3, 1)]
    failed = policy.decide(error, micro_batches={0: (1, 2), 1: (7, 1)})
    assert isinstance(failed, Fail) and isinstance(failed.error, WorkerOutOfMemoryError)
    assert [d.after for d in failed.backoffs] == [1, None]


def test_the_policy_waits_for_capacity_while_replacements_start():
    policy = FailurePolicy(FailureConfig())
    assert policy.capacity(alive=4, minimum=4, starting=0, time_left=0) is None
    assert policy.capacity(alive=3, minimum=4, starting=1, time_left=2.0) is None
    assert isinstance(policy.capacity(alive=3, minimum=4, starting=0, time_left=2.0), Fail)
    assert isinstance(policy.capacity(alive=3, minimum=4, starting=1, time_left=0.0), Fail)


# --- decisions -----------------------------------------------------------------------------


def test_chunk_length_stops_at_every_boundary():
    base = dict(step=10, steps_per_chunk=8, total_steps=100, steps_left_in_epoch=50,
                trial_steps_left=None, checkpoint_every=None, chaos_steps=[])
    assert decisions.chunk_length(**base) == 8
    assert decisions.chunk_length(**{**base, "total_steps": 13}) == 3
    assert decisions.chunk_length(**{**base, "steps_left_in_epoch": 2}) == 2
    assert decisions.chunk_length(**{**base, "trial_steps_left": 5}) == 5
    assert decisions.chunk_length(**{**base, "checkpoint_every": 4}) == 2
    assert decisions.chunk_length(**{**base, "chaos_steps": [10, 13, 11]}) == 1


def test_replacements_that_keep_failing_to_start_are_given_up_and_the_run_goes_on(tmp_path):
    # Every replacement lands where the data differ. Before: one more started at every chunk
    # boundary for the rest of the run.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           dataset_sizes={w: 12000 for w in range(4, 40)})
    end, ctx, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=6, rank=1, action="kill"),),
                       failure=FailureConfig(max_start_failures=2))
    assert isinstance(end, Finished) and _steps(ctx) == list(range(24))
    failed = [e["error"] for e in _events(ctx, "worker_start_failed")]
    assert len(failed) == 3 and failed[2].startswith(
        "2 workers in a row failed to start, failure.max_start_failures = 2: no more are "
        "started; the run goes on with the 3 it has")
    assert sorted(sim.workers) == [0, 1, 2, 3, 4, 5]  # none started after the second
    assert len(ctx.members) == 3


def test_a_data_set_mismatch_names_the_workers_that_differ_from_the_run_or_the_most():
    from elastic.control.port import Member

    def members(*sizes):
        return [Member(w, 100 + w, f"node{w % 2}", n) for w, n in enumerate(sizes)]

    assert decisions.data_set_mismatch(members(10, 10, 10)) is None
    assert decisions.data_set_mismatch(members(10, 10), expected=10) is None
    assert decisions.data_set_mismatch([]) is None
    # Among themselves, the size most built is the run's; a joiner must match the run's.
    assert decisions.data_set_mismatch(members(10, 9, 10)).startswith(
        "workers built data sets of different sizes (most workers': 10 samples; "
        "worker 1 on node node1: 9)")
    assert decisions.data_set_mismatch(members(9), expected=10).startswith(
        "workers built data sets of different sizes (the run's: 10 samples; "
        "worker 0 on node node0: 9)")
    many = decisions.data_set_mismatch(members(*[10] * 7 + [8] * 6))
    assert "worker 10 on node node0: 8 and 2 more)" in many


def test_a_drained_node_is_the_one_its_id_starts_and_an_ambiguous_start_is_refused():
    from elastic.control.port import Member

    members = [Member(0, 1, "3fa0", 8), Member(1, 2, "3fb1", 8), Member(2, 3, "3fa0", 8),
               Member(3, 4, "77c2", 8)]
    assert decisions.on_node(members, "3fa") == [0, 2]
    assert decisions.on_node(members, "77c2") == [3]
    assert decisions.on_node(members, "99") == []
    with pytest.raises(ValueError, match=r"'3f' is the start of 2 nodes' ids \(3fa0, 3fb1\)"):
        decisions.on_node(members, "3f")  # before: drained both nodes
    with pytest.raises(ValueError, match="empty"):
        decisions.on_node(members, "")


def test_restore_source_is_the_newest_lowest_rank_else_a_checkpoint():
    assert decisions.restore_source([5, 6, 6, 4], 5) == decisions.RestoreSource(1, False)
    assert decisions.restore_source([0, 0], 7) == decisions.RestoreSource(0, True)


def test_restore_source_with_sharded_state_needs_every_part_at_the_newest_step():
    # Parts 0-3; rank 1 is a step behind, so what it holds does not count.
    held = [(4, [0, 1], None), (4, [2, 3], None), (4, [1, 2], None)]
    assert decisions.restore_source([6, 5, 6], 6, held) == decisions.RestoreSource(0, True, (3,))
    assert decisions.restore_source([6, 6, 6], 6, held) == decisions.RestoreSource(0, False)
    # Rank 1 holds step 6's sums unapplied: it applies them as the generation forms.
    pending = [held[0], (4, [2, 3], 6), held[2]]
    assert decisions.restore_source([6, 5, 6], 6, pending) == decisions.RestoreSource(0, False)
    assert decisions.restore_source([5, 6, 6], 6, [(4, [0, 1, 2, 3], None)] * 3) == \
        decisions.RestoreSource(1, False)
    # Behind the run's step: a checkpoint whatever the parts.
    assert decisions.restore_source([4, 4], 6, [(2, [0, 1], None)] * 2) == \
        decisions.RestoreSource(0, True)


def test_hung_ranks_spare_the_ones_waiting_in_a_collective():
    inf = float("inf")
    where = {0: ("allreduce", 400.0), 2: ("forward", 301.0), 3: ("unresponsive", inf)}
    assert decisions.hung_ranks(where, 300.0) == [2, 3]


def test_hung_ranks_spare_a_rank_that_moved_on_within_the_timeout():
    # A long evaluation or step that is still moving from batch to batch (or phase to phase)
    # entered its phase less than the timeout ago: it is not hung, however long the call.
    where = {0: ("evaluate", 12.0), 1: ("forward", 299.9), 2: ("evaluate", 300.0)}
    assert decisions.hung_ranks(where, 300.0) == [2]


def test_steps_committed_in_the_chunk_ahead_count_when_the_chunk_before_looked_failed():
    # Rank 2 finished chunk [0, 4), went on into the chunk ahead, and died at step 6 before
    # its answer to [0, 4) reached the controller; ranks 0 and 1 committed steps 4 and 5 with
    # it, then were released from step 6's collective. Rank 3 skipped the chunk ahead.
    done = ChunkDone([], 4, Cursor(step=4).to_dict())
    cut = ChunkInterrupted([], 6, Cursor(step=6).to_dict(), "peer lost")
    skipped = ChunkSkipped([], 4, Cursor(step=4).to_dict())
    merged = decisions.merge_ahead({0: done, 1: done, 3: done}, {0: cut, 1: cut, 3: skipped})
    assert merged == {0: cut, 1: cut, 3: done}
    assert decisions.newest_committed(merged, 0) == 6
    assert decisions.newest_cursor(merged) == Cursor(step=6)
    assert decisions.newest_cursor({}) is None
    assert decisions.newest_committed(decisions.merge_ahead({0: done}, {}), 0) == 4


def test_a_chunk_error_prefers_a_loss_then_a_vote_then_a_collective_error():
    done = ChunkDone([], 3, Cursor(step=3).to_dict())
    cut = ChunkInterrupted([], 3, Cursor(step=3).to_dict(), "reset by peer")
    voted = ChunkVotedDown([], 3, Cursor(step=3).to_dict(), OutOfMemory(3, (1,)))
    assert decisions.chunk_error([], {0: done, 1: done}) is None
    assert isinstance(decisions.chunk_error([], {0: done, 1: cut}), CollectiveError)
    assert isinstance(decisions.chunk_error([], {0: cut, 1: voted}), WorkerOutOfMemoryError)
    lost = decisions.chunk_error([2], {0: cut, 1: voted})
    assert isinstance(lost, WorkerLostError) and lost.rank == 2
    user = ChunkVotedDown([], 3, {}, UserFailure(3, (0,), None))
    user_tb = ChunkVotedDown([], 3, {}, UserFailure(3, (0,), "Traceback\nValueError"))
    error = decisions.chunk_error([], {0: user, 1: user_tb})
    assert isinstance(error, UserCodeError) and error.traceback.endswith("ValueError")


@pytest.mark.parametrize("known", [{}, {1: 2.0, 2: 4.0}])
def test_weights_count_a_newcomer_as_a_typical_worker(known):
    result = decisions.weights(known, [1, 2, 3])
    assert result is None if not known else result == [2.0, 4.0, 4.0]


def test_a_loss_the_hang_watchdog_caused_is_a_hang():
    cut = ChunkInterrupted([], 3, Cursor(step=3).to_dict(), "aborted")
    assert isinstance(decisions.chunk_error([1], {0: cut}, hung=[1]), WorkerHangError)
    assert type(decisions.chunk_error([1], {0: cut}, hung=[])) is WorkerLostError


def test_growing_into_free_capacity_does_not_undo_itself(tmp_path):
    # Workers started for free capacity and admitted at the same boundary are not removed
    # again by the resize that admits them (the target rose with them).
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0)
    end, ctx, _ = _run(tmp_path, sim=sim,
                       scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=4),
                       batch=BatchConfig(global_batch_size=16))
    assert isinstance(end, Finished)
    assert _events(ctx, "worker_removed") == []
    assert [e["reason"] for e in _events(ctx, "worker_starting")] == ["capacity", "capacity"]
    assert ctx.log.metrics[-1]["world_size"] == 4


def test_a_failure_to_write_a_state_change_still_ends_the_run(tmp_path):
    calls = []

    def publish():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")

    sim = SimulatedWorkers(dataset_size=16000, capacity=4)
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=8,
                    scaling=ScalingConfig(num_workers=4),
                    batch=BatchConfig(global_batch_size=16))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim, publish=publish)
    end = Machine(ctx).run()
    assert isinstance(end, Failed) and isinstance(end.error, ControllerError)
    assert isinstance(end.error.__cause__, OSError)


def test_a_loss_while_resizing_fails_the_run_past_max_failures(tmp_path):
    def requests(step):
        if step >= 8:
            with ctx.requests.lock:
                ctx.requests.target, ctx.requests.scaled_by_user = 3, True

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, before_chunk=requests)
    connect = sim.connect

    def dying_connect(ids, generation):
        if generation > 0:  # the resize's generation: a member died since the last chunk
            sim.workers[ids[0]].alive = False
        return connect(ids, generation)

    sim.connect = dying_connect
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=16, autotune=False),
                    failure=FailureConfig(max_failures=0))
    ctx = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert _states(ctx)[-2:] == [("running", "resizing"), ("resizing", "failed")]
    assert [e["why"] for e in _events(ctx, "worker_lost")] == ["lost while connecting"]


def test_losing_every_member_while_finishing_without_a_checkpoint_fails_at_once(tmp_path):
    # Every member lost between chunks is a failure like one in a chunk (Recovering, from a
    # checkpoint): with none, nothing can hold the state and no replacement is started.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4)
    real_call = sim.call

    def call(worker_id, method, *args):
        if method == "model_state":
            raise WorkerLostError(f"worker {worker_id} is dead")
        return real_call(worker_id, method, *args)

    sim.call = call
    end, ctx, _ = _run(tmp_path, sim=sim, steps=8)
    assert isinstance(end, Failed) and "no checkpoint is available" in str(end.error)
    assert "every worker was lost at step 8" in str(end.error)
    assert _states(ctx)[-2:] == [("running", "finishing"), ("finishing", "failed")]
    assert len(_events(ctx, "member_unreachable")) == 4
    assert not _events(ctx, "worker_starting") or all(
        e["reason"] != "replacement" for e in _events(ctx, "worker_starting"))


def test_a_checkpoint_fingerprint_holds_the_group_size_once_groups_are_on(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, traits={"batchnorm": 1, "dropout": 0})
    _, ctx, _ = _run(tmp_path, sim=sim, steps=2)
    assert ctx.checkpoints.fingerprint() == "B=16;seed=0;G=4"
    _, plain, _ = _run(tmp_path / "plain", steps=2)
    assert plain.checkpoints.fingerprint() == "B=16;seed=0"


def test_members_beyond_the_number_of_groups_are_said_to_have_no_share(tmp_path):
    # Two groups of 4 (G = 8 / 2 at the start); the run grows into free capacity to 4 workers,
    # two of which get nothing to do. Before, nothing said so.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           traits={"batchnorm": 1, "dropout": 0})
    end, ctx, _ = _run(tmp_path, sim=sim, steps=24,
                       scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=4),
                       batch=BatchConfig(global_batch_size=8))
    assert isinstance(end, Finished) and max(len(e["workers"])
                                             for e in _events(ctx, "generation")) == 4
    said = [e["reason"] for e in _events(ctx, "grouped")][1:]
    assert len(said) == 1 and said[0].startswith(
        "2 of 4 workers have no share: the global batch is 2 groups of 4 samples")
    assert "batch.group_size" in said[0]


# --- chunks handed out ahead -----------------------------------------------------------------


def test_boundary_work_names_the_first_thing_a_boundary_must_do():
    base = dict(end=8, total_steps=100, ends_epoch=False, tuning=False, checkpoint_due=False,
                evaluation_due=False, recovering=False, stop=False, world_size=4, target=4,
                joining=False)
    assert decisions.boundary_work(**base) is None
    cases = {"total_steps": 8, "ends_epoch": True, "tuning": True, "checkpoint_due": True,
             "evaluation_due": True, "recovering": True, "stop": True, "target": 2,
             "joining": True}
    reasons = {name: decisions.boundary_work(**{**base, name: value})
               for name, value in cases.items()}
    assert reasons == {"total_steps": "the run ends", "ends_epoch": "the epoch ends",
                       "tuning": "a micro-batch trial", "checkpoint_due": "a checkpoint",
                       "evaluation_due": "an evaluation", "recovering": "a recovery's first chunk",
                       "stop": "a stop request", "target": "a shrink", "joining": "a worker joins"}
    assert decisions.boundary_work(**{**base, "stop": True, "tuning": True}) == "a micro-batch trial"
    assert decisions.boundary_work(**{**base, "target": 6}) is None  # growth waits for a worker


def _ahead_context(tmp_path, sim, steps=24, **config):
    """A run of 4 simulated workers (chunks of 4 steps, global batch 16, no autotuning) with
    chunks handed out ahead; `config`: further `FitConfig` fields."""
    cfg = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=steps, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=16, autotune=False), **config)
    return Context(cfg, "sim", RunLog(str(tmp_path)), sim)


def _ahead_run(tmp_path, sim, steps=24, **config):
    ctx = _ahead_context(tmp_path, sim, steps, **config)
    return Machine(ctx).run(), ctx


def test_every_chunk_but_the_first_is_handed_out_ahead_when_boundaries_have_nothing_to_do(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0)
    end, ctx = _ahead_run(tmp_path, sim)
    assert isinstance(end, Finished)
    assert (sim.chunks, sim.ahead) == (6, 5)  # chunks from 0, 4, ..., 20; the last boundary ends
    assert _steps(ctx) == list(range(24))
    assert _states(ctx) == [("starting", "running"), ("running", "finishing"),
                            ("finishing", "finished")]


def test_an_epoch_end_a_checkpoint_and_a_trial_are_boundaries_that_wait(tmp_path):
    # 40 samples of 16: epochs of 2 steps, so every chunk ends an epoch.
    sim = SimulatedWorkers(dataset_size=40, capacity=4, start_delay_s=0.0)
    end, ctx = _ahead_run(tmp_path / "epochs", sim, steps=8)
    assert isinstance(end, Finished) and (sim.chunks, sim.ahead) == (4, 0)
    assert _steps(ctx) == list(range(8))
    from elastic.config import CheckpointConfig
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0)
    end, ctx = _ahead_run(tmp_path / "ckpt", sim, steps=16,
                          checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=8))
    assert isinstance(end, Finished)
    assert (sim.chunks, sim.ahead) == (4, 2)  # not into steps 8-12 (after the checkpoint at 8)
    assert sim.checkpoints == [8, 16]  # the periodic one and the final one


def test_a_kill_with_a_chunk_ahead_drains_it_and_its_faults_fire_after_the_recovery(tmp_path):
    # The chunk from step 8 is handed out ahead and its kill fires; the chunk from 12, handed
    # out ahead of that one, is skipped by every rank, and its own kill waits for its rerun.
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0)
    end, ctx = _ahead_run(tmp_path, sim, chaos=(ChaosEvent(step=8, rank=1, action="kill"),
                                                ChaosEvent(step=12, rank=0, action="kill")))
    assert isinstance(end, Finished)
    assert [(e["step"], e["lost_ranks"]) for e in _events(ctx, "worker_failure")] == [
        (8, [1]), (12, [0])]
    assert [e["step"] for e in _events(ctx, "chaos")] == [8, 12]  # each announced once
    assert _steps(ctx) == list(range(24))  # every step once, none lost or repeated
    assert ctx.chaos == [] and len(ctx.members) == 4
    assert sim.ahead >= 3


def test_a_voted_down_step_with_a_chunk_ahead_is_redone_once(tmp_path):
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0,
                           votes={9: [UserFailure(9, (2,), "Traceback\nValueError: bad")]})
    end, ctx = _ahead_run(tmp_path, sim)
    assert isinstance(end, Finished)
    assert [(e["step"], e["ranks"]) for e in _events(ctx, "user_error")] == [(9, [2])]
    assert _steps(ctx) == list(range(24))
    assert _states(ctx) == [("starting", "running"), ("running", "finishing"),
                            ("finishing", "finished")]
    # 0-4, 4-8, 8-9 (voted down at 9), 9-12 (the redo), 12-16, ..., 20-24; the chunk from 12
    # handed out ahead of the vote was skipped, not run.
    assert sim.chunks == 7


def test_a_scale_down_made_while_a_chunk_is_ahead_ends_both_after_the_step_in_flight(tmp_path):
    def requests(step):
        if step == 12:  # the chunk from 12 is handed out while the one from 8 runs
            with ctx.requests.lock:
                ctx.requests.target, ctx.requests.scaled_by_user = 2, True

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0,
                           before_chunk=requests)
    ctx = _ahead_context(tmp_path, sim)
    assert isinstance(Machine(ctx).run(), Finished)
    assert [m["world_size"] for m in ctx.log.metrics] == [4] * 9 + [2] * 15
    assert [e["world_size"] for e in _events(ctx, "resized")] == [2]
    assert _steps(ctx) == list(range(24))


def test_a_stop_made_while_chunks_are_out_ends_them_after_the_step_in_flight(tmp_path):
    # The request comes as the chunk from 12 is handed out ahead of the one from 8: the
    # workers end that one after its first step (9), skip the one from 12, and the run stops.
    def requests(step):
        if step == 12:
            with ctx.requests.lock:
                ctx.requests.stop = True
            sim.yield_chunks()

    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0,
                           before_chunk=requests)
    ctx = _ahead_context(tmp_path, sim, steps=100)
    assert isinstance(Machine(ctx).run(), Finished) and ctx.stopped_early
    assert _steps(ctx) == list(range(9))
    assert [e["step"] for e in _events(ctx, "stopping")] == [9]
    assert _states(ctx) == [("starting", "running"), ("running", "finishing"),
                            ("finishing", "finished")]


def test_a_replacement_that_cannot_start_does_not_hold_chunks_back(tmp_path):
    # After the kill at 8 the replacement never comes up (no capacity for it in time): the
    # run goes on at 3 with chunks handed out ahead again from the second chunk after the
    # recovery (the first one after it records the recovery and starts the replacement).
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.0)
    spawn = sim.spawn

    def late_spawn():
        if len(sim.workers) >= 4:  # the first four start at once, later ones never in time
            sim.start_delay_s = 1e6
        return spawn()

    sim.spawn = late_spawn
    end, ctx = _ahead_run(tmp_path, sim, steps=40, chaos=(ChaosEvent(step=8, rank=1, action="kill"),))
    assert isinstance(end, Finished)
    assert _steps(ctx) == list(range(40)) and len(ctx.members) == 3
    assert sim.starting() == 1
    # Ahead: 4-8, 8-12, 12-16 (drained after the kill), then 16-20, ..., 36-40.
    assert sim.ahead == 9


# --- out of memory while a generation forms ------------------------------------------------


def test_out_of_memory_while_restoring_forms_the_generation_again_and_the_run_goes_on(tmp_path):
    """After a kill, a survivor runs out of memory taking the newest state: the generation
    forms once more (nobody dropped, no micro-batch halved) and every step runs once."""
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           oom_forming=[(6, "restoring", 2)])
    end, ctx, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=6, rank=1, action="kill"),))
    assert isinstance(end, Finished), end
    [failed] = _events(ctx, "generation_failed")
    assert failed["attempt"] == 1 and "(restoring)" in failed["errors"][0]
    assert [e["reason"] for e in _events(ctx, "generation")] == ["start", "recovery", "resize"]
    assert [e["worker_id"] for e in _events(ctx, "worker_lost")] == [1]  # the kill only
    assert not _events(ctx, "oom_backoff")
    assert _steps(ctx) == list(range(24))


@pytest.mark.parametrize("second, saved", [("connecting", [6]), ("restoring", [])])
def test_out_of_memory_twice_forming_at_one_step_fails_naming_what_to_change(
        tmp_path, second, saved):
    from elastic.config import CheckpointConfig
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           oom_forming=[(6, "restoring", 2), (6, second, 0)])
    end, ctx, _ = _run(tmp_path, sim=sim, chaos=(ChaosEvent(step=6, rank=1, action="kill"),),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=100))
    assert isinstance(end, Failed) and isinstance(end.error, GenerationOutOfMemoryError)
    assert (end.error.rank, end.error.doing) == (0, second)
    assert "out of memory on 2 attempts to form a generation at step 6" in str(end.error)
    assert [e["attempt"] for e in _events(ctx, "generation_failed")] == [1, 2]
    # A final checkpoint only when no state had moved (a member that ran out restoring may
    # hold part of another's).
    assert sim.checkpoints == saved


def test_out_of_memory_forming_counts_per_step():
    policy = FailurePolicy(FailureConfig())
    error = GenerationOutOfMemoryError("no room", rank=1, generation=4, doing="restoring")
    assert policy.decide(error, step=3) == Recover()
    policy.formed()  # a generation formed: the count of the step stays
    assert isinstance(policy.decide(error, step=3), Fail)
    assert policy.decide(error, step=9) == Recover()  # another step: once more


@pytest.mark.parametrize("times", [1, 2])
def test_out_of_memory_loading_the_checkpoint_to_resume_from_is_tried_once_more(tmp_path,
                                                                               times):
    from elastic.config import CheckpointConfig
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           oom_forming=[(0, "loading a checkpoint", 0)] * times)
    end, ctx, _ = _run(tmp_path, sim=sim, steps=8,
                       checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=100))
    if times == 1:
        assert isinstance(end, Finished), end
        assert _steps(ctx) == list(range(8))
    else:
        assert isinstance(end, Failed) and isinstance(end.error, GenerationOutOfMemoryError)
        assert "out of memory on 2 attempts to form the run's first generation: " in str(end.error)
        assert "step 0" not in str(end.error)  # the step it resumes is not known yet
        assert end.error.doing == "loading a checkpoint" and not _events(ctx, "generation")


def test_checkpoint_storage_that_does_not_answer_as_the_run_starts_fails_it_by_the_limit(
        tmp_path, monkeypatch):
    import threading
    from datetime import timedelta

    from elastic.checkpoint import store
    from elastic.config import CheckpointConfig
    from elastic.errors import CheckpointTimeoutError

    released = threading.Event()
    monkeypatch.setattr(store, "ensure_private_dir", lambda *args: released.wait())  # hung mount
    try:
        end, _, sim = _run(tmp_path, checkpoint=CheckpointConfig(
            path=str(tmp_path / "c"), every_steps=4, timeout=timedelta(milliseconds=50)))
    finally:
        released.set()
    assert isinstance(end, Failed) and isinstance(end.error, CheckpointTimeoutError)
    assert str(end.error).startswith(f"checking that checkpoint.path {str(tmp_path / 'c')!r} can be "
                                     "written did not finish within checkpoint.timeout (0.05 s)")
    assert not sim.workers  # nothing started


def test_a_run_stopped_right_after_a_restore_keeps_no_record_of_the_steps_it_went_back_over(
        tmp_path):
    """Every worker dies at step 10; the run restores the checkpoint of step 8 and is
    stopped before it redoes a step: it ends on the weights of step 8, and neither
    metrics.jsonl nor FitResult.metrics lists steps 8 and 9 (before, they did, though the
    weights hold neither: only a redone step replaced its record)."""
    from elastic.runlog import iter_jsonl

    class Workers(SimulatedWorkers):
        def call(self, worker_id, method, *args):
            if method == "restore_checkpoint" and self.store:  # not the start's look
                with holder["ctx"].requests.lock:
                    holder["ctx"].requests.stop = True
            return super().call(worker_id, method, *args)

    holder = {}
    sim = Workers(dataset_size=4 * PER_RANK * 1000, capacity=4, start_delay_s=0.02, store=[])
    cfg = FitConfig(chunks_ahead=False, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                    scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
                    batch=BatchConfig(global_batch_size=4 * PER_RANK),
                    checkpoint=CheckpointConfig(path=str(tmp_path / "c"), every_steps=4),
                    chaos=tuple(ChaosEvent(step=10, rank=r, action="kill") for r in range(4)))
    ctx = holder["ctx"] = Context(cfg, "sim", RunLog(str(tmp_path)), sim)
    assert isinstance(Machine(ctx).run(), Finished)
    assert ctx.step == 8 and ctx.stopped_early
    assert _steps(ctx) == list(range(8))
    assert [r["step"] for r in iter_jsonl(str(tmp_path / "metrics.jsonl"))] == list(range(8))
