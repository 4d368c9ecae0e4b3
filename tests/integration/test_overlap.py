"""Gradient buckets overlapping the backward pass (on by default with nccl, asked for here on
gloo): the step contract holds exactly as without overlap."""

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.config import CollectiveConfig, FailureConfig
from elastic.events import Nonfinite, UserError
from tests.events import of_kind
from tests.jobs import (
    N_SAMPLES,
    poisoned_job,
    reference_run,
    reference_skipping_nonfinite,
    reference_weights,
    regression_job,
    wide_job,
)

pytestmark = pytest.mark.integration

B = 16


def _config(tmp_path, **kwargs):
    base = {
        "scaling": ScalingConfig(num_workers=3, min_workers=1),
        # Tiny buckets: the regression model's parameters land in several buckets.
        "collective": CollectiveConfig(overlap=True, bucket_bytes=1024, first_bucket_bytes=1024),
        "batch": BatchConfig(global_batch_size=B, max_micro_batch=3, autotune=False, rebalance=False),
        "run_dir": str(tmp_path / "run"), "max_steps": 12, "ledger": True,
    }
    base.update(kwargs)
    return FitConfig(**base)


def test_overlapped_buckets_with_accumulation_match_the_reference(ray_cluster, tmp_path):
    result = elastic.fit(regression_job(), _config(tmp_path))
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 12), rtol=1e-9, atol=1e-10)
    ledger = [i for m in open(tmp_path / "run" / "ledger.jsonl") for i in eval_indices(m)]
    assert len(ledger) == 12 * B and len(set(ledger[: N_SAMPLES])) == N_SAMPLES


def eval_indices(line: str) -> list[int]:
    import json

    return json.loads(line)["indices"]


@pytest.mark.parametrize("phase", ["backward", "allreduce"])
def test_a_kill_with_overlap_recovers_to_the_reference(ray_cluster, tmp_path, phase):
    chaos = (ChaosEvent(step=4, rank=2, action="kill", phase=phase),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos=chaos))
    assert result.steps == 12
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 12), rtol=1e-9, atol=1e-10)


def test_a_user_error_mid_backward_is_voted_down_and_retried(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=5, rank=1, action="raise", phase="backward"),)
    result = elastic.fit(regression_job(), _config(tmp_path, chaos=chaos))
    assert [e.step for e in of_kind(result.events, UserError)] == [5]
    torch.testing.assert_close(result.model_state, reference_weights(0, B, 12), rtol=1e-9, atol=1e-10)


def test_nan_steps_are_skipped_with_overlap(ray_cluster, tmp_path):
    config = _config(tmp_path, max_steps=18, failure=FailureConfig(nonfinite="skip"))
    result = elastic.fit(poisoned_job(), config)
    assert len(of_kind(result.events, Nonfinite)) == 3
    torch.testing.assert_close(result.model_state, reference_skipping_nonfinite(0, B, 18),
                               rtol=1e-9, atol=1e-10)


def test_a_float32_model_with_overlap_matches_its_replay(ray_cluster, tmp_path):
    job = wide_job()
    job32 = elastic.TrainJob(model=lambda: job.model().float(), optimizer=job.optimizer,
                             loss=lambda m, b: job.loss(m, (b[0].float(), b[1].float())),
                             dataset=job.dataset)
    config = _config(tmp_path, batch=BatchConfig(global_batch_size=256, autotune=False, rebalance=False),
                     collective=CollectiveConfig(overlap=True, bucket_bytes=64 << 10,
                                                 first_bucket_bytes=16 << 10), ledger=False)
    result = elastic.fit(job32, config)
    reference = reference_run(job32, 0, [256] * 12)
    torch.testing.assert_close(result.model_state, reference, rtol=1e-4, atol=1e-5)


def test_many_buckets_with_accumulation_and_a_kill_match_the_replay(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=3, rank=1, action="kill", phase="backward"),)
    config = _config(tmp_path, chaos=chaos, ledger=False, max_steps=8,
                     batch=BatchConfig(global_batch_size=192, max_micro_batch=32, autotune=False,
                                       rebalance=False),
                     collective=CollectiveConfig(overlap=True, bucket_bytes=128 << 10,
                                                 first_bucket_bytes=16 << 10))
    result = elastic.fit(wide_job(), config)
    assert result.steps == 8
    torch.testing.assert_close(result.model_state, reference_run(wide_job(), 0, [192] * 8),
                               rtol=1e-9, atol=1e-10)
