"""`elastic.fit` with GPU workers on the local Ray cluster (which finds the machine's GPUs):
training equal to the CPU reference, a real CUDA out-of-memory error backed off, four workers
sharing one GPU over the host plane through two kills and the replacements' return, and, with
two GPUs, a worker killed and the run recovered by a peer restore between GPUs.

The NCCL tests need CuPy (`pip install 'elastic[gpu]'` or `'elastic[gpu-cu13]'`) and skip
without it; the shared-GPU test needs only a GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig, TrainJob
from elastic.config import CollectiveConfig
from elastic.events import OomBackoff, WorkerFailure
from tests.events import of_kind
from tests.gpu import deterministic_kernels
from tests.jobs import make_dataset, make_model, make_optimizer, mse, reference_weights, regression_job

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

needs_two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                    reason="needs two GPUs")

B = 16
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}  # float64, but another device's kernels


@pytest.fixture
def nccl():
    pytest.importorskip("cupy", reason="backend 'nccl' needs CuPy: pip install 'elastic[gpu]' "
                        "(CUDA 12) or 'elastic[gpu-cu13]' (CUDA 13)")


def _config(tmp_path, workers: int, **kwargs) -> FitConfig:
    base = {
        "scaling": ScalingConfig(num_workers=workers, min_workers=1, max_workers=workers,
                                 use_gpu=True),
        "collective": CollectiveConfig(backend="nccl"),
        "batch": BatchConfig(global_batch_size=B, max_micro_batch=4, autotune=False),
        "run_dir": str(tmp_path / "run"),
    }
    return FitConfig(**{**base, **kwargs})


def test_one_gpu_worker_trains_as_the_cpu_reference(ray_cluster, nccl, tmp_path):
    result = elastic.fit(regression_job(), _config(tmp_path, 1, max_steps=12))
    assert result.steps == 12
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 12), **TOLERANCE)


class OutOfMemoryOnce:
    """A loss whose first call in the run asks the GPU for more memory than it has (a real
    CUDA out-of-memory error); `marker` says it fired, across processes."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, model, batch) -> torch.Tensor:
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            device = batch[0].device
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=device)
        return mse(model, batch)


def test_a_real_cuda_out_of_memory_error_halves_the_micro_batch_and_redoes_the_step(
        ray_cluster, nccl, tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer,
                   loss=OutOfMemoryOnce(str(tmp_path / "fired")), dataset=make_dataset)
    result = elastic.fit(job, _config(tmp_path, 1, max_steps=6))
    [backoff] = of_kind(result.events, OomBackoff)
    assert (backoff.step, backoff.rank) == (0, 0)
    assert (backoff.micro_batch_before, backoff.micro_batch_after) == (4, 2)
    assert not of_kind(result.events, WorkerFailure)
    assert result.steps == 6
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 6), **TOLERANCE)


@needs_two_gpus
def test_two_gpu_workers_train_as_the_reference_and_recover_a_killed_one(ray_cluster, nccl,
                                                                         tmp_path):
    kill = (ChaosEvent(step=3, rank=1, action="kill", phase="forward"),)
    result = elastic.fit(regression_job(), _config(tmp_path, 2, max_steps=8, chaos=kill))
    assert result.steps == 8
    assert of_kind(result.events, WorkerFailure)
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 8), **TOLERANCE)


@pytest.mark.parametrize("overlap", [None, False], ids=["buckets", "flat"])
def test_four_workers_sharing_one_gpu_train_as_the_gpu_reference_through_two_kills(ray_cluster,
                                                                                  tmp_path,
                                                                                  overlap):
    """gpus_per_worker=0.25 on the host plane (backend 'gloo': gradients staged in host
    memory, the registered shared-memory region; in buckets during the backward pass by
    default, or flat after it): two workers killed mid-step, the survivors restore from a
    peer, replacements join; the weights are the plain single-process GPU loop's and every
    sample is seen once per epoch."""
    kills = (ChaosEvent(step=3, rank=1, action="kill", phase="backward"),
             ChaosEvent(step=6, rank=2, action="kill", phase="allreduce"))
    steps = 12  # two epochs of 96 samples
    config = _config(tmp_path, 4, max_steps=steps, chaos=kills, ledger=True,
                     collective=CollectiveConfig(backend="gloo", overlap=overlap),
                     scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4,
                                           use_gpu=True, gpus_per_worker=0.25))
    result = elastic.fit(regression_job(), config)
    assert result.steps == steps
    assert len(of_kind(result.events, WorkerFailure)) == 2
    # The survivors went on without the killed workers (when the replacements join depends on
    # how fast they start: the weights below do not).
    assert min(m["world_size"] for m in result.metrics) < 4
    ledger = [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]
    assert [e["step"] for e in ledger] == list(range(steps))
    for epoch in range(2):
        seen = sorted(i for e in ledger if e["epoch"] == epoch for i in e["indices"])
        assert seen == list(range(96))
    torch.testing.assert_close(result.model_state,
                               reference_weights(0, B, steps, device="cuda"), **TOLERANCE)


def test_exact_mode_with_four_workers_sharing_one_gpu_ends_with_the_plain_gpu_bits(ray_cluster,
                                                                                  tmp_path):
    """batch.exact on GPU workers (the host plane, picked by 'auto'): a kill mid-step, and
    the final weights are the very bits of one plain process on the GPU summing the same
    groups in fixed point (tests/fidelity.py), under the same deterministic kernels."""
    from tests import fidelity

    steps, seed, group = 6, 0, 4
    kills = (ChaosEvent(step=2, rank=1, action="kill", phase="backward"),)
    config = FitConfig(
        scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4, use_gpu=True,
                              gpus_per_worker=0.25),
        batch=BatchConfig(global_batch_size=B, group_size=group, exact=True, autotune=False),
        run_dir=str(tmp_path / "run"), max_steps=steps, seed=seed, chaos=kills)
    assert config.collective.backend == "gloo"
    result = elastic.fit(fidelity.cnn_job(), config)
    assert result.steps == steps
    assert len(of_kind(result.events, WorkerFailure)) == 1
    with deterministic_kernels():
        expected = fidelity.exact_reference(fidelity.cnn_job(), seed, B, group, steps,
                                            device="cuda")
    assert result.model_state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result.model_state[key].cpu(), value), key
