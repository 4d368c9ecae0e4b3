"""elastic.fit with NCCL as the data plane, on CPU: the simulator of NCCL's execution model
(`CollectiveConfig.nccl_simulator`) stands in for cupy in every worker process, so the GPU
code path (two planes, grouped transfers, the communication stream, abort on failure) runs
end to end with real kills."""

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, CollectiveConfig, FitConfig, ScalingConfig
from elastic.events import Generation, Recovered, WorkerFailure
from tests.events import of_kind
from tests.jobs import reference_weights, regression_job

pytestmark = pytest.mark.integration

B = 16


@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_two_kills_with_nccl_as_the_data_plane_end_with_the_reference_weights(
        ray_cluster, tmp_path, algorithm):
    chaos = (ChaosEvent(step=3, rank=1, action="kill", phase="backward"),
             ChaosEvent(step=8, rank=2, action="kill", phase="allreduce"))
    config = FitConfig(
        scaling=ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
        collective=CollectiveConfig(backend="nccl", nccl_simulator=True, algorithm=algorithm,
                                    timeout=60),
        batch=BatchConfig(global_batch_size=B, max_micro_batch=3),
        run_dir=str(tmp_path / "run"), max_steps=12, chaos=chaos)
    result = elastic.fit(regression_job(), config)
    assert result.steps == 12
    torch.testing.assert_close(result.model_state, reference_weights(seed=0, global_batch=B, steps=12),
                               rtol=1e-9, atol=1e-10)
    assert [f.lost_ranks for f in of_kind(result.events, WorkerFailure)] == [[1], [2]]
    assert len(of_kind(result.events, Recovered)) == 2
    assert {e.transport for e in of_kind(result.events, Generation)} == {"nccl"}
