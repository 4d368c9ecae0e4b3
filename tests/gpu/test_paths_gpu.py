"""GPU paths changed since the tier last ran on a GPU (b31bac7), each against the same steps on
the CPU or a plain process: BatchNorm counters kept on the device through a step of several
micro-batches, gradient buckets released one by one during the backward pass on CUDA's
streams, channels-last gradients with their parameters' strides, sharded state on CUDA (stage 1
on two ranks sharing the GPU over the host plane: the gather through page-locked memory; stage
2 at one rank: the kept sums).

Each test's body takes the device, so that the same body runs on the CPU (`make test` runs
those in `tests/unit/test_paths_cpu.py`): a mistake in a test costs no GPU time."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elastic import BatchConfig, FitConfig, ScalingConfig, ShardingConfig, TrainJob
from elastic.adapt.plan import BatchPlan, plan_batch
from elastic.config import CollectiveConfig, TrainingConfig
from elastic.trainer.replica import Replica, StepRecord
from tests import fidelity, sharding
from tests.gpu.planes import PlaneCheck

pytestmark = pytest.mark.gpu

B = 16
STEPS = 4
# float32 models, another device's kernels, a few steps
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 kernels at float32 precision: cuDNN's convolutions default to TF32 (10 bits),
    which the CPU comparison's tolerance is not for."""
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def _cuda() -> torch.device:
    return torch.device("cuda", 0)


def channels_last_cnn() -> nn.Module:
    """Three convolution + BatchNorm blocks (one momentum: their counters stay on a GPU's
    device) laid out channels-last, one of them depthwise (a weight with a dimension of size
    1, whose stride channels-last sets too), and enough parameters for several 1 KB
    buckets."""
    w = 8
    return nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
                         nn.Conv2d(w, w, 3, padding=1, groups=w), nn.BatchNorm2d(w), nn.ReLU(),
                         nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 4)
                         ).to(memory_format=torch.channels_last)


class StridesSeen(torch.optim.SGD):
    """SGD with momentum that notes, at each step, whether every gradient has its parameter's
    strides (a channels-last weight's gradient is channels-last)."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.05, momentum=0.9)
        self.seen: list[bool] = []

    def step(self, closure=None):
        self.seen.append(all(p.grad.stride() == p.stride() for g in self.param_groups
                             for p in g["params"] if p.grad is not None))
        return super().step(closure)


def cnn_replica_steps(tmp_path, device: torch.device, alone: bool) -> tuple[dict, list[bool]]:
    """`STEPS` steps of four micro-batches on one rank: through the buckets of several ranks
    (1 KB each: released one by one during the backward pass) or a generation of one rank
    (`alone`). Returns the state on the host and the optimizer's strides notes."""
    job = TrainJob(model=channels_last_cnn, optimizer=StridesSeen, loss=fidelity.classify,
                   dataset=fidelity.images)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=1, use_gpu=device.type == "cuda"),
        collective=CollectiveConfig(backend="nccl" if device.type == "cuda" else "gloo",
                                    overlap=True, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=STEPS, seed=3)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    replica = Replica(job, config, str(tmp_path), device)
    if not alone:
        replica._solo = None
        assert len(replica.reducer.buckets.buckets) >= 3
    replica.comm = PlaneCheck(cuda=device.type == "cuda")
    try:
        records = [replica.run_step(BatchPlan(B, (B,), (4,)), []) for _ in range(STEPS)]
    finally:
        replica.close()
    assert all(isinstance(r, StepRecord) for r in records)
    state = {k: v.detach().cpu() for k, v in replica.model.state_dict().items()}
    return state, replica.optimizer.seen


@pytest.mark.parametrize("alone", [False, True], ids=["buckets", "one-rank"])
def test_a_channels_last_batchnorm_cnn_on_a_gpu_trains_as_on_the_cpu(tmp_path, alone):
    gpu, strides = cnn_replica_steps(tmp_path / "gpu", _cuda(), alone)
    cpu, _ = cnn_replica_steps(tmp_path / "cpu", torch.device("cpu"), alone)
    assert strides == [True] * STEPS
    torch.testing.assert_close(gpu, cpu, **TOLERANCE)
    torch.testing.assert_close(gpu, fidelity.reference(
        TrainJob(model=channels_last_cnn, optimizer=StridesSeen, loss=fidelity.classify,
                 dataset=fidelity.images), 3, B, 4, STEPS), **TOLERANCE)


def _sharded_config(tmp_path, device: torch.device, stage: int, workers: int) -> FitConfig:
    gpu = device.type == "cuda"
    return FitConfig(
        scaling=ScalingConfig(num_workers=workers, use_gpu=gpu,
                              gpus_per_worker=1 / workers if gpu and workers > 1 else 1),
        collective=CollectiveConfig(backend="gloo" if workers > 1 or not gpu else "nccl",
                                    bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=sharding.B, autotune=False, rebalance=False),
        training=TrainingConfig(clip_grad_norm=0.5),
        sharding=ShardingConfig(stage=stage, replicas=1),
        run_dir=str(tmp_path), max_steps=100, seed=sharding.SEED)


def sharded_steps(tmp_path, device: torch.device, stage: int, workers: int) -> list[dict]:
    """`STEPS` steps of the sharding job (SGD with momentum, clipping, a warm-up) with its
    optimizer state sharded over `workers` ranks as threads of this process: on a GPU, two
    share it over the host plane (stage 1), or one runs alone on it (stage 2). Returns each
    rank's state on the host."""
    from elastic.collective import RendezvousServer
    from tests.threads import run_ranks

    config = _sharded_config(tmp_path, device, stage, workers)
    job = sharding.job(sharding.sgd)
    plan = plan_batch(sharding.B, workers, None)
    building = threading.Lock()  # models are built under the process-wide seed

    def body(comm) -> dict:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with building:
            replica = Replica(job, config, str(tmp_path), device)
        replica.comm = comm
        try:
            replica.sync_from(0)
            for _ in range(STEPS):
                assert isinstance(replica.run_step(plan, []), StepRecord)
            owned = replica.shards.owned
            assert owned and (workers == 1 or len(owned) < len(replica.shards.params))
            return {k: v.detach().cpu() for k, v in replica.model.state_dict().items()}
        finally:
            replica.close()

    if workers == 1:
        return [body(PlaneCheck(cuda=device.type == "cuda"))]
    with building:
        lend = Replica(job, config, str(tmp_path), device).registered_bytes()
    server = RendezvousServer()
    try:
        return run_ranks(server, workers, body, shared_bytes=lend)
    finally:
        server.close()


@pytest.mark.parametrize(("stage", "workers"), [(1, 2), (2, 1)],
                         ids=["stage1-two-sharing", "stage2-alone"])
def test_sharded_state_on_a_gpu_ends_on_one_plain_process(tmp_path, stage, workers):
    states = sharded_steps(tmp_path, _cuda(), stage, workers)
    expected = sharding.reference(sharding.sgd, STEPS)
    for state in states:
        torch.testing.assert_close(state, expected, **TOLERANCE)
