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

    events = summary["events"]
    kinds = [e["event"] for e in events]
    # One record per lost worker, whether the chunk saw it die or the new generation did.
    assert kinds.count("worker_lost") == lost
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered and recovered[0]["world_after"] == 4 - lost
    assert kinds.count("worker_joined") >= 2 + lost  # two on node B, the replacements on node C
    assert kinds[-2:] == ["final_model_written", "detached_exit"]
    finish = next(e for e in events if e["event"] == "finish")
    model = torch.load(os.path.join(summary["run_dir"], "final_model.pt"), weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, finish["step"]), rtol=1e-9, atol=1e-10)


@pytest.mark.timeout(600)
def test_chaos_ten_kills_and_a_node_lose_no_sample_and_end_on_the_reference(tmp_path):
    summary = _drive(tmp_path, "chaos")
    faults = summary["faults"]
    assert len(faults) == 11 and [f["kind"] for f in faults].count("node") == 1
    events = summary["events"]
    finish = next(e for e in events if e["event"] == "finish")
    steps = finish["step"]
    lost = sum(e["event"] == "worker_lost" for e in events)
    assert lost >= 11  # every kill, and at least one worker with the node
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == len([e for e in events if e["event"] == "worker_failure"])
    model = torch.load(os.path.join(summary["run_dir"], "final_model.pt"), weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, steps), rtol=1e-9, atol=1e-10)
    # The ledger: every committed step once, and every index once in each completed epoch.
    ledger = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "ledger.jsonl"))]
    assert [r["step"] for r in ledger] == list(range(steps))
    per_epoch = N_SAMPLES // 16
    for epoch in range(steps // per_epoch):
        seen = [i for r in ledger if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(seen) == sorted(set(seen)) and len(seen) == per_epoch * 16
