"""Preemption is not a failure (issue 38), on real worker processes: a SIGTERM to a worker and
`elastic drain` let the rank leave at a step boundary while the others go on, with nothing
aborted, restored or redone; a deadline too short for that falls back to the failure path; a
hot spare takes a lost or departing worker's place at once.
(A Ray node drained with a deadline: tests/fault/test_nodes.py.)"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FailureConfig, FitConfig, ScalingConfig
from elastic.errors import ConfigError
from elastic.events import (
    DeadlineMissed,
    DrainRequested,
    PlannedDeparture,
    PreemptionNotice,
    Recovered,
    SpareLost,
    SparePromoted,
    StragglerFound,
    WorkerFailure,
    WorkerLost,
)
from tests.events import kinds, of_kind
from tests.integration.test_fit import Operator
from tests.jobs import N_SAMPLES, reference_weights, regression_job

pytestmark = pytest.mark.fault

B = 16
PER_EPOCH = N_SAMPLES // B


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(300)
def test_sigterm_and_drain_leave_at_a_boundary_and_a_short_deadline_recovers(ray_cluster, tmp_path):
    name = "preempted-run"
    config = FitConfig(
        name=name, run_dir=str(tmp_path / "run"), max_steps=100_000, steps_per_chunk=2,
        ledger=True, scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=3),
        # No failure is allowed: the departures, even the late one, are preemptions.
        failure=FailureConfig(max_failures=0))
    seen = {}

    def script(op):
        start = op.wait_for(lambda s: s["state"] == "running" and s["step"] >= 2)
        # Rank 1's process gets SIGTERM, as from a scheduler; it goes on to the boundary.
        seen["sigtermed"] = start["workers"][1]["worker_id"]
        os.kill(start["workers"][1]["pid"], signal.SIGTERM)
        first = op.wait_for(lambda s: s["preemptions"] == 1 and s["state"] == "running")
        seen["after_sigterm"] = {w["worker_id"]: w["pid"] for w in first["workers"]}
        # It left, and its process ended on its own.
        op.wait_for(lambda s: not _alive(start["workers"][1]["pid"]))
        with pytest.raises(ConfigError, match="no rank 7"):
            elastic.drain(name, rank=7)
        seen["drained"] = elastic.drain(name, rank=0)
        second = op.wait_for(lambda s: s["preemptions"] == 2 and s["state"] == "running"
                             and s["world_size"] >= 2)
        seen["after_drain"] = {w["worker_id"]: w["pid"] for w in second["workers"]}
        # A deadline that has passed already: no step boundary can come first.
        seen["late"] = elastic.drain(name, rank=1, deadline=0)
        op.wait_for(lambda s: s["preemptions"] == 3 and s["step"] >= 3 * PER_EPOCH
                    and any(e["event"] == "recovered" for e in elastic.events(name)))

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)

    assert result.stopped
    torch.testing.assert_close(result.model_state, reference_weights(0, B, result.steps),
                               rtol=1e-9, atol=1e-10)
    ledger = [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]
    assert [entry["step"] for entry in ledger] == list(range(result.steps))  # none redone twice
    for epoch in range(result.steps // PER_EPOCH):
        seen_indices = [i for e in ledger if e["epoch"] == epoch for i in e["indices"]]
        assert sorted(seen_indices) == list(range(N_SAMPLES))

    events = result.events
    notices = of_kind(events, PreemptionNotice)
    assert [n.source for n in notices] == ["sigterm", "drain", "drain"]
    assert notices[0].worker_ids == [seen["sigtermed"]] and notices[0].ranks == [1]
    assert notices[1].worker_ids == seen["drained"] and notices[2].worker_ids == seen["late"]
    assert [d.deadline_s for d in of_kind(events, DrainRequested)] == [None, 0.0]
    # The first two left at a step boundary: no failure, abort or recovery around them, and
    # the others kept their processes.
    departures = of_kind(events, PlannedDeparture)
    assert [d.worker_ids for d in departures] == [notices[0].worker_ids, seen["drained"]]
    assert [d.sources for d in departures] == [["sigterm"], ["drain"]]
    assert all(d.steps_redone == 0 for d in departures)
    order = kinds(events)
    assert WorkerFailure not in order[:order.index(DeadlineMissed)]
    assert WorkerLost not in order[:order.index(DeadlineMissed)]
    sigtermed, drained = notices[0].worker_ids[0], seen["drained"][0]
    assert sigtermed not in seen["after_sigterm"] and drained not in seen["after_drain"]
    for worker_id, pid in seen["after_sigterm"].items():
        if worker_id in seen["after_drain"]:
            assert seen["after_drain"][worker_id] == pid
    # The last one could not reach a boundary by its deadline: killed, and the failure path
    # recovered with nothing committed lost; it counts as a preemption, not a failure.
    [missed] = of_kind(events, DeadlineMissed)
    assert [missed.worker_id] == seen["late"]
    [failure] = of_kind(events, WorkerFailure)
    assert failure.lost_workers == seen["late"]
    assert len(of_kind(events, Recovered)) == 1


@pytest.mark.timeout(300)
def test_a_hot_spare_takes_the_place_of_a_killed_and_of_a_drained_worker(ray_cluster, tmp_path):
    name = "spare-run"
    config = FitConfig(
        name=name, run_dir=str(tmp_path / "run"), max_steps=100_000, steps_per_chunk=2,
        ledger=True,
        scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3, spares=1),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=3))
    seen = {}

    def ready_spare(status, other_than=()):
        return (status["state"] == "running" and status["spare_workers"] == 1
                and status["spares"][0]["worker_id"] not in other_than)

    def script(op):
        first = op.wait_for(ready_spare)
        seen["first_spare"] = first["spares"][0]
        elastic.kill(name, rank=1)
        # The spare took the place in the same recovery; a new spare started cold meanwhile.
        second = op.wait_for(lambda s: s["failures"] == 1 and ready_spare(
            s, other_than=[seen["first_spare"]["worker_id"]]))
        seen["after_kill"] = second
        # A spare that dies while it waits is replaced; the run does not notice.
        os.kill(second["spares"][0]["pid"], signal.SIGKILL)
        third = op.wait_for(lambda s: ready_spare(
            s, other_than=[seen["first_spare"]["worker_id"], second["spares"][0]["worker_id"]]))
        seen["spare_before_drain"] = third["spares"][0]
        elastic.drain(name, rank=0)
        op.wait_for(lambda s: s["preemptions"] == 1 and s["state"] == "running"
                    and s["step"] >= 2 * PER_EPOCH)

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)

    torch.testing.assert_close(result.model_state, reference_weights(0, B, result.steps),
                               rtol=1e-9, atol=1e-10)
    ledger = [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]
    assert [entry["step"] for entry in ledger] == list(range(result.steps))
    # Full size at every step: each place was filled in the recovery or departure itself.
    assert {m["world_size"] for m in result.metrics} == {3}
    events = result.events
    promoted = of_kind(events, SparePromoted)
    assert [p.worker_ids for p in promoted] == [[seen["first_spare"]["worker_id"]],
                                                [seen["spare_before_drain"]["worker_id"]]]
    [recovered] = of_kind(events, Recovered)
    assert recovered.world_before == 3 and recovered.world_after == 3
    [departure] = of_kind(events, PlannedDeparture)
    assert departure.steps_redone == 0
    assert [e.worker_id for e in of_kind(events, SpareLost)] == [
        seen["after_kill"]["spares"][0]["worker_id"]]
    assert len(of_kind(events, WorkerFailure)) == 1  # the spare's death is not a failure


@pytest.mark.timeout(300)
def test_a_straggler_is_swapped_for_a_hot_spare(ray_cluster, tmp_path):
    # Rank 1's compute is 6 times as slow for the rest of its life; a spare is ready.
    name = "straggler-run"
    config = FitConfig(
        name=name, run_dir=str(tmp_path / "run"), max_steps=100_000, steps_per_chunk=2,
        scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3, spares=1),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=3),
        chaos=(ChaosEvent(step=0, rank=1, action="slow", factor=6.0, steps=None),),
        failure=FailureConfig(straggler_factor=2.0, straggler_window=3, max_preemptions=0))

    def swapped(_status):
        return any(e["event"] == "planned_departure" for e in elastic.events(name))

    def script(op):
        op.wait_for(swapped)

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)

    torch.testing.assert_close(result.model_state, reference_weights(0, B, result.steps),
                               rtol=1e-9, atol=1e-10)
    events = result.events
    [found] = of_kind(events, StragglerFound)
    assert found.rank == 1
    [departure] = of_kind(events, PlannedDeparture)
    assert departure.worker_ids == [found.worker_id] and departure.sources == ["straggler"]
    [promoted] = of_kind(events, SparePromoted)
    assert promoted.world_size == 3
    assert {m["world_size"] for m in result.metrics} == {3}
    assert not of_kind(events, WorkerFailure)


@pytest.mark.timeout(120)
def test_workers_started_after_a_node_drain_by_elastic_are_kept_off_that_node(ray_cluster):
    """`elastic drain --node` is not known to Ray, which would place the replacements on the
    drained node again: they are started with a label selector that keeps them off it
    (`RayWorkers.avoid_node`). Checked on Ray itself: an actor kept off another node is placed
    here; one kept off this (the only) node is not placed within 5 s."""
    import ray

    from elastic.actors.workers import placement

    @ray.remote(num_cpus=0)
    class Where:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    here = ray.get_runtime_context().get_node_id()
    placed = Where.options(**placement({"ab" * 28})).remote()
    assert ray.get(placed.node.remote(), timeout=60) == here
    kept_off = Where.options(**placement({"ab" * 28, here})).remote()
    try:
        ready, _ = ray.wait([kept_off.node.remote()], timeout=5)
        assert not ready
    finally:
        ray.kill(kept_off)
        ray.kill(placed)
    assert placement(set()) == {}
