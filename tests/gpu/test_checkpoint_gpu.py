"""A checkpoint a GPU worker writes loads in a process that sees no GPU: its snapshot was copied
to host memory (`elastic.trainer.device.to_host`, as `WorkerActor.checkpoint` does), so every
part is host tensors, readable even by a plain `torch.load` without `map_location`."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.adapt.plan import BatchPlan
from elastic.checkpoint import CheckpointWriter
from elastic.checkpoint.store import serialize
from elastic.config import CollectiveConfig
from elastic.trainer.device import to_host
from elastic.trainer.replica import Replica
from tests.gpu.planes import PlaneCheck
from tests.jobs import regression_job

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
B = 16

# Runs with CUDA_VISIBLE_DEVICES="": loads the newest checkpoint into a CPU replica and saves
# what it got.
LOAD_ON_CPU = r"""
import sys

import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.checkpoint.store import newest_checkpoint
from elastic.trainer.replica import Replica
from tests.jobs import regression_job

root, run_dir, out = sys.argv[1:4]
assert not torch.cuda.is_available()
loaded, skipped = newest_checkpoint(root)
assert loaded is not None, skipped
for name in loaded.parts:  # no map_location: every part is host tensors
    torch.load(f"{loaded.path}/{name}.pt", weights_only=True)
config = FitConfig(scaling=ScalingConfig(num_workers=1),
                   batch=BatchConfig(global_batch_size=16, autotune=False, rebalance=False),
                   run_dir=run_dir, max_steps=6)
replica = Replica(regression_job(), config, run_dir)
replica.load_state(loaded.parts)
torch.save({"model": replica.model.state_dict(), "step": replica.global_step,
            "parts": sorted(loaded.parts)}, out)
"""


@pytest.mark.parametrize("async_write", [True, False], ids=["background", "at-once"])
def test_a_gpu_workers_checkpoint_loads_where_no_gpu_is_visible(tmp_path, async_write):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=1, use_gpu=True),
        collective=CollectiveConfig(backend="nccl"),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path / "gpu"), max_steps=6)
    replica = Replica(regression_job(), config, str(tmp_path / "gpu"), device)
    replica.comm = PlaneCheck()
    for _ in range(3):
        replica.run_step(BatchPlan(B, (B,), (8,)), [])
    state = replica.state()
    assert "cuda_rng" in state
    root = str(tmp_path / "checkpoints")
    writer = CheckpointWriter(root, keep_last=2)
    if async_write:  # WorkerActor.checkpoint's two ways
        snapshot = {k: to_host(v, copy=True, pin=True) for k, v in state.items() if v is not None}
        assert snapshot["model"]["0.weight"].is_pinned()
        assert writer.submit(replica.global_step, snapshot, {})
        writer.flush()
    else:
        writer.write_now(replica.global_step,
                         {k: serialize(to_host(v)) for k, v in state.items() if v is not None}, {})
    [report] = writer.take_reports()
    assert report.error is None
    out = tmp_path / "loaded.pt"
    subprocess.run([sys.executable, "-c", LOAD_ON_CPU, root, str(tmp_path / "cpu"), str(out)],
                   cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=True,
                   timeout=120)
    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == 3 and "cuda_rng" in loaded["parts"]
    expected = {k: v.detach().cpu() for k, v in replica.model.state_dict().items()}
    torch.testing.assert_close(loaded["model"], expected, rtol=0, atol=0)
