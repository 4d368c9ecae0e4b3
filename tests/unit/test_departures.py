"""Planned departures (issue 38) in the control loop, without Ray: a member on notice leaves at
a step boundary with nothing aborted or redone, and preemptions have their own budget."""

from __future__ import annotations

import pytest

from elastic.config import BatchConfig, ChaosEvent, FailureConfig, FitConfig, ScalingConfig
from elastic.control.context import Context, Requests
from elastic.control.policy import Fail, FailurePolicy, Recover
from elastic.control.port import Notice
from elastic.control.simulation import SimulatedWorkers
from elastic.control.states import Failed, Finished, Machine
from elastic.errors import WorkerLostError
from elastic.runlog import RunLog


def _config(tmp_path, *, ahead=True, world=4, steps=24, **kwargs) -> FitConfig:
    return FitConfig(chunks_ahead=ahead, run_dir=str(tmp_path), max_steps=steps,
                     steps_per_chunk=4,
                     scaling=ScalingConfig(num_workers=world, min_workers=1, max_workers=world),
                     batch=BatchConfig(global_batch_size=16, autotune=False), **kwargs)


def _machine(tmp_path, config, notices):
    """Runs `config` on simulated workers; `notices(step, ctx, sim)` makes requests as each
    chunk is handed out."""
    holder = {}
    sim = SimulatedWorkers(dataset_size=16000, capacity=config.scaling.num_workers,
                           start_delay_s=0.02,
                           before_chunk=lambda step: notices(step, holder["ctx"], sim))
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    return Machine(ctx).run(), ctx, sim


def _kinds(ctx):
    return [e["event"] for e in ctx.log.events]


def _of(ctx, kind):
    return [e for e in ctx.log.events if e["event"] == kind]


def _tell(ctx, sim, worker_id, *, deadline=None, source="sigterm"):
    """What `Controller.notify` does: record the notice, end the chunks after their step."""
    if ctx.requests.notice(Notice(worker_id, source, deadline, sim.now(), "test")):
        sim.yield_chunks()


def test_a_member_on_notice_leaves_at_the_step_boundary_and_nothing_is_redone(tmp_path):
    told = []

    def notices(step, ctx, sim):
        if step >= 8 and not told:
            told.append(step)
            _tell(ctx, sim, worker_id=2)

    end, ctx, sim = _machine(tmp_path, _config(tmp_path), notices)
    assert isinstance(end, Finished)
    # Told as the chunk from 8 went out ahead, while the one from 4 ran its first step: that
    # one ended after it, on every rank, and the member left there.
    [departure] = _of(ctx, "planned_departure")
    assert departure["ranks"] == [2] and departure["worker_ids"] == [2]
    assert departure["step"] == 5 and departure["steps_redone"] == 0
    assert departure["sources"] == ["sigterm"]
    # No failure path: nothing lost, aborted, recovered or restored; every step ran once.
    kinds = _kinds(ctx)
    for kind in ("worker_failure", "worker_lost", "recovered", "restored_from_checkpoint"):
        assert kind not in kinds
    assert ("running", "recovering") not in [(e["previous"], e["state"])
                                             for e in _of(ctx, "state")]
    assert [m["step"] for m in ctx.log.metrics] == list(range(24))
    assert ctx.cursor.samples == 24 * 16  # the global batch held at every size
    # The generation after it formed without worker 2, which was let go; a replacement
    # started and joined at a later boundary.
    generations = _of(ctx, "generation")
    assert generations[1]["reason"] == "departure" and 2 not in generations[1]["workers"]
    assert generations[1]["step"] == 5
    assert not sim.workers[2].alive
    sizes = [m["world_size"] for m in ctx.log.metrics]
    assert sizes[:5] == [4] * 5 and sizes[5] == 3 and sizes[-1] == 4
    assert _of(ctx, "worker_starting")[0]["reason"] == "replacement"
    assert ctx.policy.preemptions == 1 and ctx.policy.workers_lost == 0
    assert not ctx.requests.departures


def test_a_member_on_notice_that_dies_before_a_boundary_counts_as_a_preemption(tmp_path):
    # Told at the boundary before the chunk in which it dies (chunks are not handed out ahead
    # here, so the notice does not end an earlier chunk): the failure path recovers, and the
    # loss counts against max_preemptions, not max_failures (0 here).
    def notices(step, ctx, sim):
        if step == 8:
            ctx.requests.notice(Notice(1, "ray_drain", None, sim.now()))

    config = _config(tmp_path, ahead=False, chaos=(ChaosEvent(step=8, rank=1, action="kill"),),
                     failure=FailureConfig(max_failures=0))
    end, ctx, _ = _machine(tmp_path, config, notices)
    assert isinstance(end, Finished)
    assert ctx.policy.preemptions == 1 and ctx.policy.workers_lost == 0
    assert "planned_departure" not in _kinds(ctx)
    assert _of(ctx, "worker_failure")[0]["lost_workers"] == [1]
    assert [m["step"] for m in ctx.log.metrics if m["step"] < 8] == list(range(8))


def test_preemptions_past_max_preemptions_fail_the_run_naming_the_setting(tmp_path):
    def notices(step, ctx, sim):
        if step >= 4:
            _tell(ctx, sim, worker_id=ctx.ids()[-1])

    config = _config(tmp_path, failure=FailureConfig(max_preemptions=1, max_failures=0))
    end, ctx, _ = _machine(tmp_path, config, notices)
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert "failure.max_preemptions = 1" in str(end.error)
    assert len(_of(ctx, "planned_departure")) == 2


def test_several_notices_for_one_worker_keep_the_earliest_deadline_and_first_time():
    requests = Requests(target=2)
    assert requests.notice(Notice(3, "sigterm", None, received=10.0))
    assert requests.notice(Notice(3, "ray_drain", 50.0, received=11.0))
    assert not requests.notice(Notice(3, "drain", 60.0, received=12.0))
    assert not requests.notice(Notice(3, "sigterm", None, received=13.0))
    assert requests.notice(Notice(3, "drain", 40.0, received=14.0))
    assert requests.departures[3] == Notice(3, "drain", 40.0, received=10.0)
    assert requests.leaving([1, 3]) == [3]
    assert requests.gone([3, 1]) == [Notice(3, "drain", 40.0, received=10.0)]
    assert requests.leaving([1, 3]) == []


@pytest.mark.parametrize(("limit", "expected"), [(None, Recover), (2, Recover), (1, Fail)])
def test_the_policy_counts_preemptions_apart_from_failures(limit, expected):
    policy = FailurePolicy(FailureConfig(max_failures=0, max_preemptions=limit))
    assert policy.departed(1, step=3) is None
    action = policy.decide(WorkerLostError("1 workers actor died", step=4), lost=0, preempted=1)
    assert isinstance(action, expected)
    assert policy.preemptions == 2 and policy.workers_lost == 0
    assert isinstance(policy.decide(WorkerLostError("x", step=5), lost=1), Fail)


# --- hot spares ------------------------------------------------------------------------------


def _spare_config(tmp_path, *, spares=1, max_workers=4, **kwargs) -> FitConfig:
    return FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                     scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=max_workers,
                                           spares=spares),
                     batch=BatchConfig(global_batch_size=16, autotune=False), **kwargs)


def _spare_run(tmp_path, config, capacity=5, before=lambda step, ctx, sim: None):
    holder = {}
    sim = SimulatedWorkers(dataset_size=16000, capacity=capacity, start_delay_s=0.02,
                           before_chunk=lambda step: before(step, holder["ctx"], sim))
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    return Machine(ctx).run(), ctx, sim


def test_a_spare_takes_a_lost_members_place_in_the_same_recovery(tmp_path):
    config = _spare_config(tmp_path, chaos=(ChaosEvent(step=8, rank=1, action="kill"),))
    end, ctx, _ = _spare_run(tmp_path, config)
    assert isinstance(end, Finished)
    [ready, *_] = _of(ctx, "spare_ready")
    [promoted] = _of(ctx, "spare_promoted")
    assert promoted["worker_ids"] == [ready["worker_id"]] and promoted["world_size"] == 4
    # The recovery's generation has the spare: the run never ran a step below full size.
    recovery = next(g for g in _of(ctx, "generation") if g["reason"] == "recovery")
    assert ready["worker_id"] in recovery["workers"] and len(recovery["workers"]) == 4
    assert _of(ctx, "recovered")[0]["world_after"] == 4
    assert {m["world_size"] for m in ctx.log.metrics} == {4}
    assert [m["step"] for m in ctx.log.metrics if m["step"] < 8] == list(range(8))
    # Another spare started in its place, after the recovery's first step, and is ready.
    assert [e["reason"] for e in _of(ctx, "worker_starting")] == ["spare"]
    assert len(ctx.spares) == 1 and ctx.spares[0].worker_id != ready["worker_id"]
    assert ctx.policy.workers_lost == 1


def test_a_spare_takes_a_departing_members_place_at_the_boundary(tmp_path):
    def before(step, ctx, sim):
        if step >= 12 and not ctx.requests.departures and ctx.policy.preemptions == 0:
            _tell(ctx, sim, worker_id=0)

    end, ctx, _ = _spare_run(tmp_path, _spare_config(tmp_path), before=before)
    assert isinstance(end, Finished)
    [departure] = _of(ctx, "planned_departure")
    departed = next(g for g in _of(ctx, "generation") if g["reason"] == "departure")
    assert 0 not in departed["workers"] and len(departed["workers"]) == 4
    assert {m["world_size"] for m in ctx.log.metrics} == {4}
    assert ctx.policy.preemptions == 1 and ctx.policy.workers_lost == 0
    assert departure["steps_redone"] == 0


def test_a_spare_that_dies_idle_is_replaced_without_touching_the_run(tmp_path):
    killed = []

    def before(step, ctx, sim):
        if ctx.spares and not killed:
            killed.append(ctx.spares[0].worker_id)
            sim.kill(killed[0])

    end, ctx, _ = _spare_run(tmp_path, _spare_config(tmp_path), before=before)
    assert isinstance(end, Finished)
    assert [e["worker_id"] for e in _of(ctx, "spare_lost")] == killed
    for kind in ("worker_failure", "worker_lost", "recovered", "resized"):
        assert kind not in _kinds(ctx)
    assert len(_of(ctx, "generation")) == 1  # the generation never changed
    assert len(ctx.spares) == 1 and ctx.spares[0].worker_id != killed[0]
    assert ctx.policy.workers_lost == 0


def test_spares_are_started_before_growth_into_free_capacity(tmp_path):
    # Room for 5 workers, max_workers 5: the fifth place is the spare's, not a fifth rank's.
    end, ctx, _ = _spare_run(tmp_path, _spare_config(tmp_path, max_workers=5), capacity=5)
    assert isinstance(end, Finished)
    assert {m["world_size"] for m in ctx.log.metrics} == {4}
    assert len(ctx.spares) == 1 and "resized" not in _kinds(ctx)
    # With room for 6, the sixth is used to grow.
    end, ctx, _ = _spare_run(tmp_path / "six", _spare_config(tmp_path / "six", max_workers=5),
                             capacity=6)
    assert isinstance(end, Finished)
    assert max(m["world_size"] for m in ctx.log.metrics) == 5 and len(ctx.spares) == 1


def test_chaos_preempt_sends_sigterm_to_the_workers_own_process_and_the_step_goes_on(tmp_path):
    import signal
    import threading

    from elastic.trainer.faults import FaultInjector

    received = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.set())
    try:
        FaultInjector(str(tmp_path)).fire(
            [ChaosEvent(step=3, rank=0, action="preempt", phase="backward")], "backward")
        FaultInjector(str(tmp_path)).fire(
            [ChaosEvent(step=3, rank=0, action="preempt", phase="backward")], "forward")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received.is_set()  # delivered to the main thread before `fire` returned


def test_a_straggler_is_swapped_for_a_ready_spare_and_it_is_no_preemption(tmp_path):
    config = _spare_config(tmp_path, failure=FailureConfig(straggler_factor=2.0,
                                                           straggler_window=2, max_preemptions=0))
    holder = {}
    sim = SimulatedWorkers(dataset_size=16000, capacity=5, start_delay_s=0.02, slow={1: 3.0})
    ctx = holder["ctx"] = Context(config.model_copy(update={"max_steps": 40}), "sim",
                                  RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished)
    [found] = _of(ctx, "straggler_found")
    assert found["worker_id"] == 1 and found["rank"] == 1
    assert found["samples_per_s"] * 2.0 <= found["others_median_samples_per_s"]
    [departure] = _of(ctx, "planned_departure")
    assert departure["worker_ids"] == [1] and departure["sources"] == ["straggler"]
    assert departure["steps_redone"] == 0
    assert _of(ctx, "spare_promoted")[0]["world_size"] == 4
    assert {m["world_size"] for m in ctx.log.metrics} == {4}
    assert ctx.policy.preemptions == 0  # max_preemptions 0 and the run finished


def test_a_member_slowed_by_its_own_checkpoint_writes_is_neither_a_straggler_nor_rebalanced(
        tmp_path):
    # Rank 0 writes the checkpoints, in the background beside its steps. Before, that
    # competition counted as slowness: it was swapped for a spare (and the next rank 0 then
    # wrote and was swapped in turn), and its share shrank and grew with every write.
    config = _spare_config(tmp_path, failure=FailureConfig(straggler_factor=2.0,
                                                           straggler_window=2))
    sim = SimulatedWorkers(dataset_size=16000, capacity=5, start_delay_s=0.02, slow={0: 3.0},
                           writing={0})
    ctx = Context(config.model_copy(update={"max_steps": 40}), "sim", RunLog(str(tmp_path)), sim)
    assert isinstance(Machine(ctx).run(), Finished)
    assert "straggler_found" not in _kinds(ctx) and "rebalanced" not in _kinds(ctx)
    assert {m["world_size"] for m in ctx.log.metrics} == {4}


def test_a_straggler_stays_without_a_ready_spare_and_a_fast_member_is_never_one(tmp_path):
    end, ctx, _ = _machine(tmp_path, _config(
        tmp_path, failure=FailureConfig(straggler_factor=2.0, straggler_window=2)),
        lambda step, ctx, sim: None)
    assert isinstance(end, Finished) and "straggler_found" not in _kinds(ctx)
    from elastic.adapt.stragglers import StragglerWatch

    watch = StragglerWatch(factor=2.0, window=2)
    assert watch.observe({1: 100.0, 2: 40.0}) == []  # 2.5x slower, once
    assert watch.observe({1: 100.0, 2: 50.0}) == [2]  # twice in a row: a straggler
    assert watch.observe({1: 100.0, 2: 51.0}) == []  # not slow enough: starts over
    assert watch.observe({1: 100.0, 2: 10.0, 3: 90.0}) == []
    assert watch.observe({1: 100.0, 2: 10.0, 3: 40.0}) == [2]  # 3 is 2.4x below 1 but not
    watch.reset()                                               # below the others' median
    assert watch.observe({1: 100.0, 2: 10.0}) == []


def test_a_spare_on_notice_is_retired_and_another_starts(tmp_path):
    told = []

    def before(step, ctx, sim):
        if ctx.spares and not told:
            told.append(ctx.spares[0].worker_id)
            ctx.requests.notice(Notice(told[0], "ray_drain", None, sim.now()))

    end, ctx, sim = _spare_run(tmp_path, _spare_config(tmp_path), before=before)
    assert isinstance(end, Finished)
    assert [(e["worker_id"], e["source"]) for e in _of(ctx, "worker_retired")] == [
        (told[0], "ray_drain")]
    assert not sim.workers[told[0]].alive and len(ctx.spares) == 1
    for kind in ("planned_departure", "worker_failure", "spare_promoted", "spare_lost"):
        assert kind not in _kinds(ctx)
    assert ctx.policy.preemptions == 0 and not ctx.requests.departures


def test_a_notice_made_while_no_chunk_was_out_ends_the_next_chunk_after_its_first_step(tmp_path):
    # Recorded without ending any chunk (as when it comes during a resize or a recovery):
    # the chunk handed out next ends after its first step, not after all of its steps.
    told = []

    def notices(step, ctx, sim):
        if step >= 8 and not told:
            told.append(step)
            ctx.requests.notice(Notice(2, "drain", None, sim.now()))

    end, ctx, _ = _machine(tmp_path, _config(tmp_path, ahead=False), notices)
    assert isinstance(end, Finished)
    [departure] = _of(ctx, "planned_departure")
    assert told == [8]
    assert departure["step"] == 9 and departure["steps_redone"] == 0


@pytest.mark.parametrize(("replicas", "hands_over"), [(1, True), (2, False)])
def test_with_sharded_state_a_leaver_hands_its_parts_over_in_a_generation_first(
        tmp_path, replicas, hands_over):
    from elastic.config import ShardingConfig

    told = []

    def notices(step, ctx, sim):
        if step >= 8 and not told:
            told.append(step)
            _tell(ctx, sim, worker_id=2)

    config = _config(tmp_path, sharding=ShardingConfig(stage=1, replicas=replicas))
    end, ctx, sim = _machine(tmp_path, config, notices)
    assert isinstance(end, Finished)
    [departure] = _of(ctx, "planned_departure")
    assert departure["worker_ids"] == [2] and departure["steps_redone"] == 0
    reasons = [e["reason"] for e in _of(ctx, "generation")]
    if hands_over:
        # Every member, the leaver included, forms once more and moves its parts to the
        # others (owning none itself); then the others form without it.
        assert sim.handed_over == [(2,)]
        i = reasons.index("hand_over")
        assert reasons[i + 1] == "departure"
        assert _of(ctx, "generation")[i]["workers"] == [0, 1, 2, 3]
    else:  # a copy of every part stays with the others: no extra generation
        assert sim.handed_over == [] and "hand_over" not in reasons


def test_a_notice_past_its_deadline_is_not_let_go_at_a_boundary_but_killed():
    requests = Requests(target=3)
    # `elastic drain --deadline 0`: recorded overdue with the notice (the controller kills it).
    assert requests.notice(Notice(1, "drain", 0.0, 1.0, "late"), overdue=True)
    assert requests.leaving([0, 1, 2]) == []  # a boundary before its death: it stays a member
    assert [n.worker_id for n in requests.gone([1])] == [1]  # its loss: a preemption
    assert not requests.overdue
    # A deadline that passes later (the timer): from then on it is not let go either.
    assert requests.notice(Notice(2, "drain", 5.0, 1.0, "soon"))
    assert requests.leaving([2]) == [2]
    requests.overdue_now(2)
    assert requests.leaving([2]) == []


# --- when every member leaves, and other edges (found by a review) -----------------------


@pytest.mark.parametrize("stage", [0, 1])
def test_every_member_leaving_hands_the_state_to_ready_spares_without_a_checkpoint(
        tmp_path, stage):
    # Their node drains and holds every member; the spares are elsewhere. Without
    # checkpoints the state lived only in the leavers: before, they were let go first and
    # the run failed ("no checkpoint is available").
    from elastic.config import ShardingConfig

    config = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                       scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=2,
                                             spares=2),
                       batch=BatchConfig(global_batch_size=16, autotune=False),
                       sharding=ShardingConfig(stage=stage))
    told = []

    def before(step, ctx, sim):
        if step >= 8 and len(ctx.spares) == 2 and not told:
            told.extend(ctx.ids())
            for worker_id in told:
                _tell(ctx, sim, worker_id, source="ray_drain")

    end, ctx, sim = _spare_run(tmp_path, config, capacity=6, before=before)
    assert isinstance(end, Finished), end
    [departure] = _of(ctx, "planned_departure")
    assert departure["worker_ids"] == told and departure["steps_redone"] == 0
    # The spares joined the leavers in one generation (taking the state from them), then
    # formed on their own.
    generations = _of(ctx, "generation")
    i = [g["reason"] for g in generations].index("hand_over")
    assert set(generations[i]["workers"]) > set(told) and len(generations[i]["workers"]) == 4
    assert generations[i + 1]["reason"] == "departure"
    assert not set(told) & set(generations[i + 1]["workers"])
    assert _of(ctx, "spare_promoted")[0]["world_size"] == 4  # the hand-over's generation
    for kind in ("worker_failure", "restored_from_checkpoint"):
        assert kind not in _kinds(ctx)
    assert [m["step"] for m in ctx.log.metrics] == list(range(24))
    assert {m["world_size"] for m in ctx.log.metrics} == {2}
    assert not any(sim.workers[w].alive for w in told)


def test_the_only_member_leaving_without_spares_or_checkpoints_fails_saying_why(tmp_path):
    def notices(step, ctx, sim):
        if step >= 8 and not ctx.requests.departures and ctx.policy.preemptions == 0:
            _tell(ctx, sim, worker_id=ctx.ids()[0])

    end, _, _ = _machine(tmp_path, _config(tmp_path, world=1), notices)
    assert isinstance(end, Failed) and isinstance(end.error, WorkerLostError)
    assert "no checkpoint is available" in str(end.error)


class _DieAtFinalWrite(SimulatedWorkers):
    """Kills `doomed` workers as the controller asks for a final checkpoint (their whole node
    gone mid-write); keeps the cursor of each checkpoint so that a restore finds it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.doomed: list[int] = []
        self.saved = {}

    def call(self, worker_id, method, *args):
        if method == "flush_checkpoints" and self.doomed:
            for w in self.doomed:
                self.kill(w)
            self.doomed = []
        result = super().call(worker_id, method, *args)
        worker = self.workers[worker_id]
        if method == "checkpoint":
            self.saved[worker.step] = worker.cursor
        if method == "restore_checkpoint" and self.saved:
            worker.step = max(self.saved)
            worker.cursor = self.saved[worker.step]
            return {"step": worker.step, "path": "sim", "skipped": [], "unsigned": []}
        return result


def test_every_leaver_dying_in_the_final_checkpoint_write_recovers_from_a_checkpoint(tmp_path):
    # Before, the loss of every member during a call between chunks failed the run
    # ("every worker was lost") where the same loss during a chunk recovers.
    from elastic.config import CheckpointConfig

    config = _config(tmp_path, world=2, steps=24,
                     checkpoint=CheckpointConfig(path=str(tmp_path / "ck"), every_steps=4,
                                                 sign=False))
    holder = {}

    def before(step, ctx, sim):
        if step >= 10 and not sim.doomed and ctx.policy.preemptions == 0 \
                and "worker_failure" not in _kinds(ctx):
            sim.doomed = list(ctx.ids())
            for worker_id in sim.doomed:
                _tell(ctx, sim, worker_id)

    sim = _DieAtFinalWrite(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           before_chunk=lambda step: before(step, holder["ctx"], sim))
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished), end
    [failure] = _of(ctx, "worker_failure")
    assert sorted(failure["lost_workers"]) == [0, 1]
    assert _of(ctx, "restored_from_checkpoint")
    assert "planned_departure" not in _kinds(ctx)
    assert ctx.policy.preemptions == 2 and ctx.policy.workers_lost == 0
    steps = [m["step"] for m in ctx.log.metrics]
    assert sorted(set(steps)) == list(range(24))  # the steps since the checkpoint, redone


def test_a_spare_drained_past_its_deadline_is_retired_not_promoted(tmp_path):
    told = []

    def before(step, ctx, sim):
        if ctx.spares and not told:
            told.append(ctx.spares[0].worker_id)
            ctx.requests.notice(Notice(told[0], "drain", sim.now(), sim.now()), overdue=True)

    config = _spare_config(tmp_path, chaos=(ChaosEvent(step=16, rank=1, action="kill"),))
    end, ctx, sim = _spare_run(tmp_path, config, before=before)
    assert isinstance(end, Finished)
    assert [e["worker_id"] for e in _of(ctx, "worker_retired")] == told
    assert all(told[0] not in g["workers"] for g in _of(ctx, "generation"))
    assert not sim.workers[told[0]].alive and not ctx.requests.departures


def test_a_straggler_that_dies_after_its_swap_notice_is_a_failure_not_a_preemption(tmp_path):
    from elastic.control.group import drop
    from elastic.control.port import Member

    config = _config(tmp_path, world=2, failure=FailureConfig(max_preemptions=0,
                                                              max_failures=1))
    sim = SimulatedWorkers(dataset_size=16000, capacity=2)
    ctx = Context(config, "t", RunLog(str(tmp_path)), sim)
    for worker_id in (sim.spawn(), sim.spawn()):
        ctx.members.append(Member(worker_id, worker_id + 100, "n", 16000))
    ctx.requests.notice(Notice(1, "straggler", None, 0.0))
    drop(ctx, [1], "actor died", replace=False)
    assert ctx.policy.preemptions == 0 and ctx.policy.workers_lost == 1


def test_preemptions_past_the_limit_checkpoint_the_state_of_those_who_stay_first(tmp_path):
    from elastic.config import CheckpointConfig

    def notices(step, ctx, sim):
        if step >= 8 and not ctx.requests.departures:
            _tell(ctx, sim, worker_id=ctx.ids()[-1])

    config = _config(tmp_path, failure=FailureConfig(max_preemptions=0),
                     checkpoint=CheckpointConfig(path=str(tmp_path / "ck"), every_steps=100,
                                                 sign=False))
    end, ctx, sim = _machine(tmp_path, config, notices)
    assert isinstance(end, Failed) and "failure.max_preemptions = 0" in str(end.error)
    [departure] = _of(ctx, "planned_departure")
    assert sim.checkpoints[-1] == departure["step"]


@pytest.mark.parametrize(("replicas", "hands_over"), [(1, True), (2, True), (4, False)])
def test_a_scale_down_with_sharded_state_hands_the_removed_members_parts_over_first(
        tmp_path, replicas, hands_over):
    # Before, `elastic scale` down killed the members above the target at once: parts only
    # they owned were lost and the run went back to a checkpoint (or failed without one).
    from elastic.config import ShardingConfig

    def notices(step, ctx, sim):
        if step >= 8 and not ctx.requests.scaled_by_user:
            with ctx.requests.lock:
                ctx.requests.target, ctx.requests.scaled_by_user = 2, True
            sim.yield_chunks()

    config = _config(tmp_path, sharding=ShardingConfig(stage=1, replicas=replicas))
    end, ctx, sim = _machine(tmp_path, config, notices)
    assert isinstance(end, Finished)
    reasons = [g["reason"] for g in _of(ctx, "generation")]
    if hands_over:
        assert sim.handed_over == [(2, 3)]
        i = reasons.index("hand_over")
        assert reasons[i + 1] == "resize"
        assert _of(ctx, "generation")[i + 1]["workers"] == [0, 1]
    else:  # 4 copies of every part: the two who stay hold them all
        assert sim.handed_over == [] and "hand_over" not in reasons
    for kind in ("worker_failure", "restored_from_checkpoint", "shards_lost"):
        assert kind not in _kinds(ctx)
    assert [m["step"] for m in ctx.log.metrics] == list(range(24))


def test_every_member_killed_twice_by_one_call_between_chunks_fails_instead_of_looping(
        tmp_path):
    # A call that kills whoever runs it (the final weights' copy out of host memory, say):
    # recovering and asking again would loop for ever with max_failures None.
    from elastic.config import CheckpointConfig

    config = _config(tmp_path, world=2, steps=8,
                     checkpoint=CheckpointConfig(path=str(tmp_path / "ck"), every_steps=4,
                                                 sign=False))
    holder = {}
    sim = _DieAtFinalWrite(dataset_size=16000, capacity=4, start_delay_s=0.02)
    real = sim.call

    def call(worker_id, method, *args):
        if method == "model_state":
            sim.kill(worker_id)
        return real(worker_id, method, *args)

    sim.call = call
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Failed) and "every worker died twice at step 8" in str(end.error)
    assert len(_of(ctx, "worker_failure")) == 1  # one recovery, then the end


def test_a_hand_over_whose_takers_died_forms_without_leavers_and_the_state_goes_on(tmp_path):
    # The spares promoted to take the state died as the hand-over formed: the generation
    # forms again of the leavers alone, who then hand nothing over (all of them leaving
    # would leave no owner), and the departure goes on as with no spare.
    from elastic.config import CheckpointConfig, ShardingConfig

    config = FitConfig(chunks_ahead=True, run_dir=str(tmp_path), max_steps=24, steps_per_chunk=4,
                       scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=2,
                                             spares=1),
                       batch=BatchConfig(global_batch_size=16, autotune=False),
                       sharding=ShardingConfig(stage=1),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "ck"), every_steps=100,
                                                   sign=False))
    holder, told = {}, []

    def before(step, ctx, sim):
        if step >= 8 and ctx.spares and not told:
            told.extend(ctx.ids())
            for worker_id in told:
                _tell(ctx, sim, worker_id, source="ray_drain")
            sim.doomed_spare = ctx.spares[0].worker_id

    sim = _DieAtFinalWrite(dataset_size=16000, capacity=6, start_delay_s=0.02,
                           before_chunk=lambda step: before(step, holder["ctx"], sim))
    connect = sim.connect

    def dying_connect(ids, generation):
        doomed = getattr(sim, "doomed_spare", None)
        if doomed in ids:
            sim.workers[doomed].alive = False
            sim.doomed_spare = None
        return connect(ids, generation)

    sim.connect = dying_connect
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished), end
    # The spare was lost connecting; the leavers formed alone and handed nothing over
    # (before, every rank was told to hand its parts over: the workers' map raised).
    assert [e["why"] for e in _of(ctx, "worker_lost")] == ["lost while connecting"]
    assert sim.handed_over == []
    assert _of(ctx, "planned_departure")


def test_a_checkpoint_is_not_left_to_a_member_on_notice_and_one_lost_with_it_is_said(tmp_path):
    """Worker 0 (rank 0, the checkpoint writer) is told to leave while its background write
    of step 4 runs. The checkpoint due at the boundary where it leaves goes to a member that
    stays; worker 0 dies before its write reports (a deadline kill): the write is reported
    failed, not taken as written (before: worker 0 was asked to write step 5 too, and the
    write lost with it went unsaid)."""
    from elastic.config import CheckpointConfig

    class Workers(SimulatedWorkers):
        def call(self, worker_id, method, *args):
            if method == "checkpoint":
                writes.append((self.workers[worker_id].step, worker_id))
            if method == "flush_checkpoints" and worker_id == 0 and told:
                self.workers[0].alive = False  # killed at its deadline, the write unreported
            return super().call(worker_id, method, *args)

    told, writes = [], []

    def notices(step, ctx, sim):
        if step == 4 and not told:
            told.append(step)
            _tell(ctx, sim, worker_id=0)

    config = _config(tmp_path, ahead=False, steps=12,
                     checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=1))
    holder = {}
    sim = Workers(dataset_size=16000, capacity=4, start_delay_s=0.02, async_writes=True,
                  before_chunk=lambda step: notices(step, holder["ctx"], sim))
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim)
    assert isinstance(Machine(ctx).run(), Finished)
    assert (4, 0) in writes  # written by worker 0 before it was told
    assert all(worker != 0 for step, worker in writes if step > 4)
    [failed] = _of(ctx, "checkpoint_failed")
    assert failed["step"] == 4 and "worker 0 was lost before it reported" in failed["error"]
    assert 4 not in [e["step"] for e in _of(ctx, "checkpoint_written")]
    assert [e["step"] for e in _of(ctx, "checkpoint_written")][-1] == 12


def test_a_scale_up_takes_a_ready_spare_at_the_next_boundary_with_chunks_handed_out_ahead(
        tmp_path):
    """`elastic scale` from 4 to 5 with one spare ready and no room for a fifth worker: the
    spare joins at the next boundary. Before, chunks went on being handed out ahead (no
    worker was joining) and the run stayed at 4 to its end."""
    def before(step, ctx, sim):
        if step == 8:
            with ctx.requests.lock:
                ctx.requests.target, ctx.requests.scaled_by_user = 5, True

    end, ctx, _ = _spare_run(tmp_path, _spare_config(tmp_path, max_workers=5), capacity=5,
                             before=before)
    assert isinstance(end, Finished)
    sizes = {m["step"]: m["world_size"] for m in ctx.log.metrics}
    assert sizes[8] == 4 and sizes[16] == 5
    [promoted] = _of(ctx, "spare_promoted")
    assert promoted["world_size"] == 5


def test_a_straggler_is_not_swapped_for_a_spare_on_notice(tmp_path):
    """Every spare is told to leave while a chunk runs (its node drains), as soon as it is
    ready: a straggler found at the end of that chunk stays, and the run never drops below
    its size. Before, it was told to leave for a spare that went too, and the run shrank
    until a cold start."""
    told = set()

    class Workers(SimulatedWorkers):
        def finish_chunk(self, *args, **kwargs):
            report = super().finish_chunk(*args, **kwargs)
            for spare in holder["ctx"].spares:  # a notice that came during the chunk
                if spare.worker_id not in told:
                    told.add(spare.worker_id)
                    holder["ctx"].requests.notice(
                        Notice(spare.worker_id, "ray_drain", None, self.now()))
            return report

    config = _spare_config(tmp_path, failure=FailureConfig(straggler_factor=2.0,
                                                           straggler_window=2))
    holder = {}
    sim = Workers(dataset_size=16000, capacity=5, start_delay_s=0.02, slow={1: 3.0})
    ctx = holder["ctx"] = Context(config.model_copy(update={"max_steps": 40}), "sim",
                                  RunLog(str(tmp_path)), sim)
    assert isinstance(Machine(ctx).run(), Finished)
    assert told and "straggler_found" not in _kinds(ctx)
    assert "straggler" not in {s for e in _of(ctx, "planned_departure") for s in e["sources"]}
    assert {m["world_size"] for m in ctx.log.metrics} == {4}


def test_a_draining_head_node_has_the_committed_state_written_at_the_next_boundary(tmp_path):
    """What the controller does when its own node drains (the cluster ends with it): a
    checkpoint of the committed state at the next boundary, though none is due for 100
    steps; the chunk handed out ahead ends after its step; the run goes on."""
    from elastic.config import CheckpointConfig

    def notices(step, ctx, sim):
        if step == 8 and not sim.checkpoints:
            with ctx.requests.lock:
                ctx.requests.save = True
            sim.yield_chunks()

    config = _config(tmp_path, checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"),
                                                           every_steps=100))
    end, ctx, sim = _machine(tmp_path, config, notices)
    assert isinstance(end, Finished)
    # Asked as the chunk from 8 went out ahead while the one from 4 ran its first step: it
    # ended after that step, and the state of step 5 was written there, then the final one.
    assert sim.checkpoints == [5, 24]
    assert [e["step"] for e in _of(ctx, "checkpoint_written")] == [5, 24]
    assert [m["step"] for m in ctx.log.metrics] == list(range(24))
    assert not ctx.requests.save


def _told_as_a_chunk_ends(tmp_path, config, worker_id: int, end: int):
    """Runs `config` on simulated workers (with an evaluation step); worker `worker_id` is
    told to leave while the chunk that ends at step `end` runs (the notice is there when its
    report comes in). Returns the context."""
    class Workers(SimulatedWorkers):
        def finish_chunk(self, *args, **kwargs):
            report = super().finish_chunk(*args, **kwargs)
            steps = max(len(o.records) for o in report.outcomes.values())
            if holder["ctx"].step + steps == end:
                holder["ctx"].requests.notice(Notice(worker_id, "sigterm", None, self.now()))
            return report

    holder = {}
    sim = Workers(dataset_size=16000, capacity=config.scaling.num_workers, start_delay_s=0.02)
    ctx = holder["ctx"] = Context(config, "sim", RunLog(str(tmp_path)), sim, has_eval_step=True)
    assert isinstance(Machine(ctx).run(), Finished)
    return ctx


def test_members_on_notice_leave_before_an_evaluation_due_at_their_boundary(tmp_path):
    """Worker 2 is told to leave while the chunk that ends at step 8 runs, and an evaluation
    is due at step 8: it leaves first, the others evaluate, once. Before, it evaluated with
    them (a deadline within the evaluation killed it there: recovered, and evaluated again)."""
    from elastic.config import EvaluationConfig

    config = _config(tmp_path, ahead=False, steps=12, evaluation=EvaluationConfig(every_steps=8))
    ctx = _told_as_a_chunk_ends(tmp_path, config, worker_id=2, end=8)
    order = [(e["event"], e.get("step")) for e in ctx.log.events
             if e["event"] in ("planned_departure", "evaluate")]
    assert order == [("planned_departure", 8), ("evaluate", 8), ("evaluate", 12)]


def test_a_worker_whose_node_ray_says_was_preempted_counts_as_a_preemption(tmp_path):
    """Worker 1's node is preempted before its drain was seen (no notice): Ray's reason says
    so, and the loss counts against max_preemptions, not max_failures (0 here: before, the
    run failed)."""
    config = _config(tmp_path, ahead=False, failure=FailureConfig(max_failures=0),
                     chaos=(ChaosEvent(step=8, rank=1, action="kill"),))
    sim = SimulatedWorkers(dataset_size=16000, capacity=4, start_delay_s=0.02,
                           on_preempted_nodes={1})
    ctx = Context(config, "sim", RunLog(str(tmp_path)), sim)
    end = Machine(ctx).run()
    assert isinstance(end, Finished)
    assert ctx.policy.preemptions == 1 and ctx.policy.workers_lost == 0
    assert [m["step"] for m in ctx.log.metrics if m["step"] < 8] == list(range(8))


def test_a_notice_at_the_runs_last_boundary_leaves_the_final_evaluation_to_everyone(tmp_path):
    """Told to leave as the last chunk ends, with the final evaluation due there: the run
    ends; nobody leaves first (which could need a replacement, or a checkpoint, for a run
    that finished)."""
    from elastic.config import EvaluationConfig

    config = _config(tmp_path, ahead=False, steps=8, evaluation=EvaluationConfig(every_steps=8))
    ctx = _told_as_a_chunk_ends(tmp_path, config, worker_id=0, end=8)
    assert [e["step"] for e in _of(ctx, "evaluate")] == [8]
    assert "planned_departure" not in _kinds(ctx)
