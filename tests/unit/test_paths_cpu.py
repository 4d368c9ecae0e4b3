"""The bodies of `tests/gpu/test_paths_gpu.py` on the CPU: the same steps, so that a mistake in
those tests shows here, not in a GPU machine's few minutes; and the CPU's own answer to each."""

from __future__ import annotations

import pytest
import torch

from tests import fidelity, sharding
from tests.gpu.test_paths_gpu import (
    STEPS,
    TOLERANCE,
    B,
    channels_last_cnn,
    cnn_replica_steps,
    sharded_steps,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("alone", [False, True], ids=["buckets", "one-rank"])
def test_a_channels_last_batchnorm_cnn_trains_as_a_plain_loop(tmp_path, alone):
    from elastic import TrainJob
    from tests.gpu.test_paths_gpu import StridesSeen

    state, strides = cnn_replica_steps(tmp_path, CPU, alone)
    assert strides == [True] * STEPS
    job = TrainJob(model=channels_last_cnn, optimizer=StridesSeen, loss=fidelity.classify,
                   dataset=fidelity.images)
    torch.testing.assert_close(state, fidelity.reference(job, 3, B, 4, STEPS), **TOLERANCE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "workers"), [(1, 2), (2, 1)],
                         ids=["stage1-two", "stage2-alone"])
def test_sharded_state_ends_on_one_plain_process(tmp_path, stage, workers):
    states = sharded_steps(tmp_path, CPU, stage, workers)
    assert len(states) == workers
    expected = sharding.reference(sharding.sgd, STEPS)
    for state in states:
        torch.testing.assert_close(state, expected, **TOLERANCE)
