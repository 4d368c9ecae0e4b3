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

from tests.jobs import reference_weights

pytestmark = pytest.mark.fault

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_a_node_joins_and_a_node_is_lost_and_the_run_goes_on(tmp_path):
    out = tmp_path / "summary.json"
    child = subprocess.run(
        [sys.executable, "-m", "tests.fault.cluster_driver", str(out)], cwd=ROOT,
        capture_output=True, text=True, timeout=540,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    summary = json.loads(out.read_text()) if out.exists() else {}
    assert child.returncode == 0 and summary.get("ok"), child.stderr[-3000:]

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
    failures = [e for e in events if e["event"] == "worker_failure"]
    assert sum(len(f["lost_ranks"]) for f in failures) == lost
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered and recovered[0]["world_after"] == 4 - lost
    assert kinds.count("worker_joined") >= 2 + lost  # two on node B, the replacements on node C
    assert kinds[-2:] == ["final_model_written", "detached_exit"]
    finish = next(e for e in events if e["event"] == "finish")
    model = torch.load(os.path.join(summary["run_dir"], "final_model.pt"), weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, finish["step"]), rtol=1e-9, atol=1e-10)
