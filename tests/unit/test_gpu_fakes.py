"""The GPU tier's fake planes on CPU: a replica runs its step through them exactly as it does on
a GPU, so that a fake that lags behind what the step asks of a communicator fails here, not
first on a GPU machine (the tier's first run on an H100 found `PlaneCheck` without
`shared_buffers`). Also the fractional-GPU settings."""

from __future__ import annotations

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.config import CollectiveConfig, ShardingConfig
from elastic.trainer.replica import Replica, StepRecord
from elastic.trainer.step import BatchPlan
from tests.gpu.planes import PlaneCheck
from tests.jobs import reference_weights, regression_job

B, STEPS = 16, 3
BATCH = BatchConfig(global_batch_size=B)


def test_a_cpu_replica_steps_through_the_gpu_tiers_two_plane_fake(tmp_path):
    config = FitConfig(
        scaling=ScalingConfig(num_workers=1),
        collective=CollectiveConfig(backend="nccl", nccl_simulator=True),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=STEPS, ledger=True)
    replica = Replica(regression_job(), config, str(tmp_path))
    replica._solo = None  # the reducer of several ranks, over the one-rank fake's two planes
    replica.comm = PlaneCheck(cuda=False)
    try:
        records = [replica.run_step(BatchPlan(B, (B,), (4,)), []) for _ in range(STEPS)]
    finally:
        replica.close()
    assert all(isinstance(r, StepRecord) for r in records)
    assert replica.comm.calls and replica.comm.control.calls
    torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, STEPS),
                               rtol=1e-10, atol=1e-12)


def test_workers_may_share_a_gpu_on_the_host_plane_only():
    shared = ScalingConfig(num_workers=4, use_gpu=True, gpus_per_worker=0.25)
    FitConfig(scaling=shared, collective=CollectiveConfig(backend="gloo"), max_steps=1, batch=BATCH)
    with pytest.raises(ValueError, match=r"gpus_per_worker 0.25 .*backend='gloo'"):
        FitConfig(scaling=shared, collective=CollectiveConfig(backend="nccl"), max_steps=1, batch=BATCH)
    # Buckets overlap the backward pass on the host plane too (by default: the GPU computes
    # while the host copies and sums), or not, as asked.
    assert FitConfig(scaling=shared, collective=CollectiveConfig(backend="gloo"), max_steps=1,
                     batch=BATCH).collective.overlap_enabled
    assert not FitConfig(scaling=shared, collective=CollectiveConfig(backend="gloo", overlap=False),
                         max_steps=1, batch=BATCH).collective.overlap_enabled
    with pytest.raises(ValueError, match=r"sharding\.stage 2 .*collective\.backend='nccl'"):
        FitConfig(scaling=shared, collective=CollectiveConfig(backend="gloo"),
                  sharding=ShardingConfig(stage=2), max_steps=1, batch=BATCH)
    with pytest.raises(ValueError, match=r"scaling\.use_gpu=True"):
        FitConfig(scaling=ScalingConfig(num_workers=1, gpus_per_worker=0.5), max_steps=1, batch=BATCH)
    # Whole GPUs on NCCL, as before.
    FitConfig(scaling=ScalingConfig(num_workers=2, use_gpu=True),
              collective=CollectiveConfig(backend="nccl"), max_steps=1, batch=BATCH)


def test_a_fraction_of_a_gpu_fits_within_one_gpu():
    from elastic.control.decisions import gpu_worker_slots

    assert gpu_worker_slots([2.0], 0.4) == 4  # not 5: 0.2 left on each GPU is no place
    assert gpu_worker_slots([1.0], 0.25) == 4
    assert gpu_worker_slots([1.0, 2.0], 0.5) == 6
    assert gpu_worker_slots([8.0, 4.0], 2) == 6
    assert gpu_worker_slots([1.0], 1) == 1
    with pytest.raises(ValueError, match="whole number of GPUs"):
        ScalingConfig(num_workers=1, use_gpu=True, gpus_per_worker=1.5)
