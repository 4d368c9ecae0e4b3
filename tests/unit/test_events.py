"""Typed events: every kind round-trips through its JSON record, which keeps the on-disk format;
the writer refuses free-form events; the reader tolerates newer versions and half lines."""

import dataclasses
import json

import pytest

import elastic
import elastic.api
from elastic.events import (
    KINDS,
    Evaluate,
    StateChanged,
    Stopping,
    UnknownEvent,
    WorkerFailure,
    build,
    parse,
    read_events,
    to_record,
)
from elastic.runlog import RunLog

# One record of every kind, with the fields (and in the order) the controller writes them.
SAMPLES = {
    "start": {"name": "r", "config": {"seed": 0, "scaling": {"num_workers": 2}}, "restarted": True},
    "controller_restarted": {"name": "r"},
    "planned": {"dataset_size": 1024, "steps_per_epoch": 16, "total_steps": 32},
    "grouped": {"groups": True, "group_size": 6, "pinned": False, "batchnorm": 2, "dropout": 0,
                "reason": "the model has 2 BatchNorm layers"},
    "state": {"previous": "running", "state": "resizing", "world_size": 3, "target": 2},
    "stopping": {"step": 7},
    "finish": {"step": 32, "stopped": False, "samples": 2048},
    "failed": {"error": "UserCodeError: boom", "step": 3},
    "detached_exit": {"failed": True},
    "final_model_written": {"path": "/runs/r/final_model.pt"},
    "final_model_failed": {"path": "/runs/r/final_model.pt", "error": "OSError: [Errno 28]"},
    "scale_requested": {"num_workers": 4},
    "kill_requested": {"rank": 1, "worker_id": 5},
    "stop_requested": {},
    "drain_requested": {"worker_ids": [3], "rank": 1, "node_id": None, "deadline_s": 30.0},
    "preemption_notice": {"source": "ray_drain", "ranks": [0, 1], "worker_ids": [2, 5],
                          "deadline": 1700000030.0, "reason": "Ray node 0a1b is draining"},
    "planned_departure": {"ranks": [1], "worker_ids": [3], "sources": ["drain"], "step": 12,
                          "notice_to_gone_s": 0.021, "steps_redone": 0},
    "deadline_missed": {"worker_id": 3, "deadline": 1700000030.0},
    "head_draining": {"deadline": 1700000030.0, "checkpoint": True,
                      "reason": "Ray node 0123456789ab (the head) is draining"},
    "spare_ready": {"worker_id": 7, "pid": 4343},
    "spare_promoted": {"worker_ids": [7], "world_size": 4},
    "spare_lost": {"worker_id": 7},
    "worker_retired": {"worker_id": 7, "source": "ray_drain", "role": "spare"},
    "straggler_found": {"rank": 1, "worker_id": 3, "samples_per_s": 410.5,
                        "others_median_samples_per_s": 1290.0, "factor": 2.0, "window": 4},
    "chaos": {"step": 8, "rank": 2, "action": "kill", "phase": "allreduce", "factor": 2.0,
              "steps": None},
    "worker_starting": {"reason": "replacement", "target": 4},
    "worker_start_failed": {"error": "no resources"},
    "worker_joined": {"worker_id": 6, "pid": 4242},
    "worker_removed": {"worker_id": 6},
    "worker_lost": {"rank": 1, "worker_id": 5, "why": "actor died"},
    "member_unreachable": {"worker_id": 5},
    "worker_hung": {"rank": 0, "phase": "allreduce", "worker_id": 3},
    "generation": {"generation": 2, "world_size": 3, "reason": "recovery", "source_rank": 0,
                   "step": 9, "transport": "shm", "workers": [3, 4, 6]},
    "generation_failed": {"generation": 2, "errors": ["rank 1: refused"], "attempt": 1},
    "resized": {"world_size": 3, "generation": 4, "previous_generation": 3},
    "batch_planned": {"reason": "resize", "world_size": 3, "step": 9, "global_batch_size": 48,
                      "lr_factor_from": 1.0, "lr_factor_to": 0.75, "warmup_steps": 10},
    "worker_failure": {"lost_ranks": [1], "step": 9, "lost_workers": [5], "survivors": 3,
                       "planned": True, "reasons": [""]},
    "recovered": {"lost_ranks": [1], "world_before": 4, "world_after": 3, "step": 9,
                  "work_lost_steps": 1, "total_s": 0.5, "detect_s": None, "abort_s": 0.1,
                  "rebuild_s": 0.2, "restore_s": 0.1, "first_step_s": 0.1},
    "oom_backoff": {"step": 4, "rank": 0, "worker_id": 3, "micro_batch_before": 1,
                    "micro_batch_after": None},
    "user_error": {"step": 4, "ranks": [0, 1], "attempt": 2, "error": "ValueError: bad"},
    "nonfinite": {"step": 4, "ranks": [1], "policy": "skip"},
    "micro_batch_tuned": {"step": 12, "reason": "start", "micro_batch": 32,
                          "samples_per_s": {"16": 900.5, "32": 1200.25}},
    "rebalance_judged": {"step": 24, "delivered": False, "predicted_saving_s": 0.002,
                         "realised_saving_s": 0.0004, "window": 2, "threshold": 0.3},
    "rebalanced": {"step": 16, "shares_before": [16, 16], "shares_after": [20, 12],
                   "samples_per_s": [800.0, 500.0], "predicted_before_s": 0.02,
                   "predicted_after_s": 0.016},
    "evaluate": {"step": 16, "epoch": 1, "accuracy": 0.91, "loss": 0.3},
    "resumed": {"step": 10, "path": "/ckpt/step-10", "work_lost_steps": 0, "from_run": "r",
                "world_size_then": 2, "world_size_now": 3, "changes": ["world size 2 -> 3"]},
    "restored_from_checkpoint": {"step": 10, "path": "/ckpt/step-10", "work_lost_steps": 2},
    "shards_lost": {"step": 10, "parts": [3, 7]},
    "checkpoint_written": {"step": 10, "path": "/ckpt/step-10", "seconds": 0.25, "pruned": [5],
                           "prune_error": "cannot remove step-000000000005: PermissionError"},
    "checkpoint_failed": {"step": 10, "error": "disk full"},
    "checkpoint_busy": {"step": 12, "note": "previous write still in flight; this one was skipped"},
    "checkpoint_skipped": {"path": "/ckpt/step-5", "reason": "unsigned"},
    "checkpoint_config_changed": {"path": "/ckpt/step-10",
                                  "note": "global batch or seed differ from the run that wrote it"},
    "logger_failed": {"logger": "mlflow", "error": "MlflowException: connection refused", "step": 12},
    "logger_behind": {"logger": "mlflow", "step": 1200, "queued": 10000},
    "logger_dropped": {"logger": "mlflow", "points": 310, "first_step": 1200, "last_step": 1509},
}


def test_every_kind_has_a_sample_here():
    assert set(KINDS) == set(SAMPLES)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_kind_round_trips_through_the_record_it_writes(kind):
    event = build(kind, **SAMPLES[kind])
    record = to_record(event, 12.5)
    # The on-disk format, key order included, is what the call sites wrote before types.
    assert list(record.items()) == [("time", 12.5), ("event", kind), *SAMPLES[kind].items()]
    read = parse(json.loads(json.dumps(record)))
    assert read == dataclasses.replace(event, time=12.5)
    assert (read.kind, read.time) == (kind, 12.5)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_class_names_are_the_camel_case_of_their_kind(kind):
    expected = "".join(part.capitalize() for part in kind.split("_"))
    assert KINDS[kind].__name__ == {"state": "StateChanged"}.get(kind, expected)


def test_an_optional_field_left_unset_is_not_written():
    record = to_record(StateChanged(previous="starting", state="running"), 1.0)
    assert record == {"time": 1.0, "event": "state", "previous": "starting", "state": "running"}
    assert parse(record) == StateChanged(time=1.0, previous="starting", state="running")


def test_a_required_field_that_is_none_is_written():
    record = to_record(build("recovered", **SAMPLES["recovered"]), 1.0)
    assert "detect_s" in record and record["detect_s"] is None


def test_an_unknown_kind_parses_to_an_unknown_event_holding_the_record():
    record = {"time": 3.0, "event": "from_the_future", "x": 1}
    event = parse(record)
    assert isinstance(event, UnknownEvent)
    assert (event.kind, event.time, event.record) == ("from_the_future", 3.0, record)
    assert to_record(event) == record


def test_a_known_kind_missing_a_required_field_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=r"'worker_failure' lacks field\(s\) survivors"):
        parse({"time": 1.0, "event": "worker_failure", "lost_ranks": [1], "step": 2,
               "lost_workers": [5], "planned": False, "reasons": [""]})


def test_a_record_without_kind_or_time_raises_value_error():
    with pytest.raises(ValueError, match="not an event record"):
        parse({"time": 1.0, "step": 2})
    with pytest.raises(ValueError, match="not an event record"):
        parse({"event": "stopping", "step": 2})


def test_a_field_added_by_a_newer_version_is_dropped_when_read():
    assert parse({"time": 1.0, "event": "stopping", "step": 2, "new": "x"}) == Stopping(time=1.0, step=2)


def test_evaluate_metrics_are_top_level_fields_and_may_not_shadow_the_record():
    event = Evaluate(step=4, epoch=1, metrics={"accuracy": 0.5})
    assert to_record(event, 2.0) == {"time": 2.0, "event": "evaluate", "step": 4, "epoch": 1,
                                     "accuracy": 0.5}
    with pytest.raises(ValueError, match="time"):
        Evaluate(step=4, epoch=1, metrics={"time": 0.5})


def test_an_event_without_a_time_cannot_become_a_record():
    with pytest.raises(ValueError, match="no time"):
        to_record(Stopping(step=1))


def test_emit_writes_and_returns_the_record_stamped_with_the_time(tmp_path):
    log = RunLog(str(tmp_path))
    written = log.emit(WorkerFailure(lost_ranks=[1], step=3, lost_workers=[7], survivors=1,
                                     planned=False, reasons=["node died"]))
    log.close()
    assert written["event"] == "worker_failure" and isinstance(written["time"], float)
    assert log.events == [written]
    assert [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()] == [written]


def test_runlog_event_builds_the_typed_record(tmp_path):
    log = RunLog(str(tmp_path))
    log.event("stopping", step=5)
    log.close()
    [event] = read_events(tmp_path)
    assert event == Stopping(time=log.events[0]["time"], step=5)


@pytest.mark.parametrize(("kind", "fields", "error"), [
    ("started", {"x": 1}, ValueError),
    ("stopping", {"step": 1, "reason": "free-form"}, TypeError),
    ("stopping", {}, ValueError),
])
def test_runlog_event_refuses_free_form_events_and_writes_nothing(tmp_path, kind, fields, error):
    log = RunLog(str(tmp_path))
    with pytest.raises(error):
        log.event(kind, **fields)
    log.close()
    assert log.events == [] and (tmp_path / "events.jsonl").read_text() == ""


def test_read_events_leaves_a_half_written_last_line_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    first = to_record(Stopping(step=1), 1.0)
    path.write_text(json.dumps(first) + "\n" + '{"time": 2.0, "event": "fin')
    assert read_events(path) == [Stopping(time=1.0, step=1)]
    assert read_events(str(tmp_path)) == read_events(path)
    assert read_events(tmp_path / "missing") == []


def test_the_package_attribute_events_stays_the_api_function():
    # `elastic.events` (the function) and the module `elastic.events` share a name: importing
    # the module must not replace the function on the package.
    assert elastic.events is elastic.api.events
