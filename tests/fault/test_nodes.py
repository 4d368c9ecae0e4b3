"""Whole nodes lost and joined, on a multi-node Ray cluster on this machine.

The scenario runs in a child process (tests/fault/cluster_driver.py): a process holds one Ray
connection, and this session's is to the single-node test cluster."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from elastic.events import (
    CheckpointWritten,
    DetachedExit,
    FinalModelWritten,
    Finish,
    HeadDraining,
    PlannedDeparture,
    PreemptionNotice,
    Recovered,
    WorkerFailure,
    WorkerJoined,
    WorkerLost,
)
from tests.events import kinds, of_kind, typed
from tests.jobs import N_SAMPLES, reference_weights

pytestmark = pytest.mark.fault

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _drive(tmp_path, scenario: str) -> dict:
    out = tmp_path / "summary.json"
    child = subprocess.run(
        [sys.executable, "-m", "tests.fault.cluster_driver", str(out), scenario], cwd=ROOT,
        capture_output=True, text=True, timeout=540,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    summary = json.loads(out.read_text()) if out.exists() else {}
    assert child.returncode == 0 and summary.get("ok"), child.stderr[-3000:]
    return summary


@pytest.mark.timeout(600)
def test_a_node_joins_and_a_node_is_lost_and_the_run_goes_on(tmp_path):
    summary = _drive(tmp_path, "nodes")

    # The joining node was used at a step boundary without restarting anyone.
    assert set(summary["first_pids"]) <= set(summary["grown_pids"])
    assert len(summary["grown_pids"]) == 4
    # Node A's workers died together; the others went on in the same processes.
    lost = summary["workers_on_a"]
    assert lost >= 1
    assert set(summary["after_loss_pids"]) <= set(summary["grown_pids"])
    assert len(summary["after_loss_pids"]) == 4 - lost
    assert set(summary["after_loss_pids"]) <= set(summary["rejoined_pids"])

    events = typed(summary["events"])
    order = kinds(events)
    # One record per lost worker, whether the chunk saw it die or the new generation did.
    assert order.count(WorkerLost) == lost
    recovered = of_kind(events, Recovered)
    assert recovered and recovered[0].world_after == 4 - lost
    assert order.count(WorkerJoined) >= 2 + lost  # two on node B, the replacements on node C
    assert order[-2:] == [FinalModelWritten, DetachedExit]
    # Node C, drained by Ray with a deadline: its workers were told and left at one step
    # boundary; no failure, the others kept their processes.
    drained = summary["drained_workers"]
    notices = of_kind(events, PreemptionNotice)
    assert [n.source for n in notices] == ["ray_drain"] and sorted(notices[0].worker_ids) == drained
    assert notices[0].deadline is not None
    [departure] = of_kind(events, PlannedDeparture)
    assert sorted(departure.worker_ids) == drained and departure.steps_redone == 0
    after = summary["after_drain"]
    assert after["failures"] == summary["failures_before_drain"]
    assert after["world_size"] == 4 - len(drained)
    assert {w["pid"] for w in after["workers"]} <= set(summary["rejoined_pids"])
    # The head drained: a checkpoint of the committed state at the next boundary (none was
    # due), before the stop's final one.
    [head] = of_kind(events, HeadDraining)
    assert head.checkpoint and head.deadline is not None
    written = [e.step for e in events[events.index(head):] if isinstance(e, CheckpointWritten)]
    assert len(written) == 2 and written[0] > after["step"]
    finish = next(e for e in events if isinstance(e, Finish))
    model = torch.load(os.path.join(summary["run_dir"], "final_model.pt"), weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, finish.step), rtol=1e-9, atol=1e-10)


@pytest.mark.timeout(600)
def test_chaos_ten_kills_and_a_node_lose_no_sample_and_end_on_the_reference(tmp_path):
    summary = _drive(tmp_path, "chaos")
    faults = summary["faults"]
    assert len(faults) == 11 and [f["kind"] for f in faults].count("node") == 1
    events = typed(summary["events"])
    finish = next(e for e in events if isinstance(e, Finish))
    steps = finish.step
    lost = sum(isinstance(e, WorkerLost) for e in events)
    assert lost >= 11  # every kill, and at least one worker with the node
    recovered = of_kind(events, Recovered)
    assert len(recovered) == len(of_kind(events, WorkerFailure))
    model = torch.load(os.path.join(summary["run_dir"], "final_model.pt"), weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, steps), rtol=1e-9, atol=1e-10)
    # The ledger: every committed step once, and every index once in each completed epoch.
    ledger = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "ledger.jsonl"))]
    assert [r["step"] for r in ledger] == list(range(steps))
    per_epoch = N_SAMPLES // 16
    for epoch in range(steps // per_epoch):
        seen = [i for r in ledger if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(seen) == sorted(set(seen)) and len(seen) == per_epoch * 16
