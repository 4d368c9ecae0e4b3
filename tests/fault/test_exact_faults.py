"""Exact mode through real kills and a resize: elastic.fit on local Ray ends with the very bits
(`torch.equal`, every entry of the state dict) of one plain process summing the same groups in
fixed point (`tests/fidelity.py: exact_reference`, run in this process with the workers' one
thread)."""

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.events import Grouped, WorkerFailure
from tests import fidelity
from tests.events import of_kind
from tests.integration.test_fit import Operator

pytestmark = pytest.mark.fault

B = 24


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a worker with one CPU runs (exact mode fixes it there)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(False)


def _assert_bits(result, expected):
    assert result.model_state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result.model_state[key], value), key


@pytest.mark.timeout(300)
def test_three_kills_in_three_phases_leave_the_bits_of_one_plain_process(ray_cluster, tmp_path,
                                                                         one_thread):
    """BatchNorm CNN at 4 workers; kills in the forward pass, the allreduce and the optimizer
    step; replacements join (the world shrinks and grows back)."""
    steps = 8
    chaos = (ChaosEvent(step=1, rank=1, action="kill", phase="forward"),
             ChaosEvent(step=3, rank=2, action="kill", phase="allreduce"),
             ChaosEvent(step=5, rank=0, action="kill", phase="optimizer"))
    config = FitConfig(scaling=ScalingConfig(num_workers=4, min_workers=1),
                       batch=BatchConfig(global_batch_size=B, exact=True), max_steps=steps,
                       steps_per_chunk=2, run_dir=str(tmp_path / "run"), chaos=chaos)
    result = elastic.fit(fidelity.cnn_job(), config)
    assert result.steps == steps
    assert len(of_kind(result.events, WorkerFailure)) == 3
    assert len({m["world_size"] for m in result.metrics}) >= 2
    assert of_kind(result.events, Grouped)[0].group_size == 6
    _assert_bits(result, fidelity.exact_reference(fidelity.cnn_job(), 0, B, 6, steps))


@pytest.mark.timeout(300)
def test_a_resize_leaves_the_bits_of_one_plain_process(ray_cluster, tmp_path, one_thread):
    """The padded-token LM (a sum-and-count loss) grown from 2 workers to 4 (G = 12: two
    groups for four ranks)."""
    name = "exact-resize"
    config = FitConfig(scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=4),
                       batch=BatchConfig(global_batch_size=B, exact=True), max_steps=100_000,
                       steps_per_chunk=2, run_dir=str(tmp_path / "run"), name=name)

    def script(op):
        op.wait_for(lambda s: s["step"] >= 2)
        elastic.scale(name, 4)
        op.wait_for(lambda s: s["world_size"] == 4 and s["step"] >= 7, limit=120)

    with Operator(name, script):
        result = elastic.fit(fidelity.lm_job(), config)
    assert {2, 4} <= {m["world_size"] for m in result.metrics}
    _assert_bits(result, fidelity.exact_reference(fidelity.lm_job(), 0, B, 12, result.steps))
