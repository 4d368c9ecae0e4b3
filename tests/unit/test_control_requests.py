"""Control requests as typed records, the run's status as a frozen dataclass, and the cursor
in a torch-free module; without Ray."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import pytest

from elastic import api
from elastic.control import cursor
from elastic.control.requests import KINDS, Events, Kill, Scale, Status, Stop, decode, encode
from elastic.control.status import RankedWorker, RunStatus
from elastic.errors import ControllerError, RunNotFoundError
from elastic.registry import RunRegistry, is_terminal, mark_lost
from elastic.trainer import data

REQUESTS = [Status(), Events(), Scale(3), Kill(1), Stop()]

# The record's keys, in order, as `elastic.status` has always returned them.
RECORD_KEYS = (
    "name", "state", "step", "total_steps", "generation", "world_size", "target_workers",
    "global_batch_size", "shares", "micro_batches", "starting_workers", "joining_workers",
    "failures", "workers", "run_dir", "started_at", "ended_at", "last_loss", "detached",
    "error_type", "error_message", "host", "pid", "control", "updated_at", "preemptions",
    "spare_workers", "spares", "resumed_from", "cluster",
)


def _status(**changes) -> RunStatus:
    fields = dict(
        name="r", state="running", step=7, total_steps=40, generation=2, world_size=2,
        target_workers=3, global_batch_size=32, shares=(16, 16), micro_batches=(8, 8),
        starting_workers=1, joining_workers=0, failures=1,
        workers=(RankedWorker(rank=0, worker_id=4, pid=101, node_id="n" * 40),
                 RankedWorker(rank=1, worker_id=6, pid=102, node_id="m" * 40)),
        run_dir="/tmp/runs/r", started_at=1.5, ended_at=None, last_loss=0.25, detached=False,
        error_type=None, error_message=None, host="h", pid=99, control="elastic-ab",
        updated_at=2.5,
    )
    return RunStatus(**{**fields, **changes})


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_a_request_crosses_the_channel_and_ray_as_itself(request_):
    assert decode(json.loads(json.dumps(encode(request_)))) == request_
    assert pickle.loads(pickle.dumps(request_)) == request_
    with pytest.raises(dataclasses.FrozenInstanceError):
        request_.verb = "kill"  # type: ignore[misc]


def test_the_wire_keeps_the_shape_of_method_and_args():
    # A controller or a caller of an earlier version reads and writes these lines.
    assert encode(Scale(3)) == {"method": "scale", "args": [3]}
    assert encode(Kill(0)) == {"method": "kill", "args": [0]}
    assert encode(Status()) == {"method": "status", "args": []}
    assert decode({"method": "stop"}) == Stop()
    assert set(KINDS) == {"status", "events", "scale", "kill", "stop", "drain"}


def test_an_unknown_verb_is_refused_before_the_controller():
    with pytest.raises(ControllerError, match="unknown control method 'shutdown'"):
        decode({"method": "shutdown", "args": []})
    with pytest.raises(ControllerError, match="unknown control method"):
        decode({"method": ["status"]})
    with pytest.raises(TypeError):
        decode({"method": "scale", "args": []})


def test_the_status_record_has_the_keys_and_values_it_always_had():
    record = _status().to_dict()
    assert tuple(record) == RECORD_KEYS
    assert record["shares"] == [16, 16] and record["micro_batches"] == [8, 8]
    assert record["workers"] == [{"rank": 0, "worker_id": 4, "pid": 101, "node_id": "n" * 40},
                                 {"rank": 1, "worker_id": 6, "pid": 102, "node_id": "m" * 40}]
    assert json.loads(json.dumps(record)) == record  # lists, not tuples: JSON gives it back equal
    before = _status(shares=None, micro_batches=None, workers=()).to_dict()
    assert before["shares"] is None and before["micro_batches"] is None and before["workers"] == []


def test_the_status_pickles_and_is_frozen():
    status = _status()
    assert pickle.loads(pickle.dumps(status)) == status
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.step = 8  # type: ignore[misc]


def test_the_index_stores_the_record_as_plain_json(tmp_path):
    registry = RunRegistry(str(tmp_path / "home"))
    record = _status(state="finished", ended_at=3.0).to_dict()
    registry.write(record)
    with open(os.path.join(registry.directory, "r.json")) as f:
        assert json.load(f) == record
    assert registry.read("r") == record and is_terminal(registry.read("r"))
    lost = mark_lost(_status().to_dict())
    assert lost["state"] == "lost" and lost["workers"] == [] and tuple(lost) == RECORD_KEYS


def test_an_ended_run_answers_status_and_events_and_refuses_the_rest(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "start"}) + "\n")
    record = _status(state="finished", step=40, run_dir=str(tmp_path)).to_dict()
    assert api._from_record(record, Status()) is record
    assert api._from_record(record, Events()) == [{"kind": "start"}]
    for request, verb in ((Scale(2), "scale"), (Kill(0), "kill"), (Stop(), "stop")):
        with pytest.raises(RunNotFoundError) as raised:
            api._from_record(record, request)
        assert str(raised.value) == ("run 'r' is not running (finished at step 40); "
                                     f"there is nothing to {verb}")


def test_the_cursor_lives_without_torch_and_the_trainer_re_exports_it():
    assert data.Cursor is cursor.Cursor and data.steps_per_epoch is cursor.steps_per_epoch
    probe = ("import sys, elastic.control.cursor, elastic.control.requests, elastic.control.status, "
             "elastic.control.channel, elastic.control.states, elastic.control.simulation, "
             "elastic.control.checkpoints; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
