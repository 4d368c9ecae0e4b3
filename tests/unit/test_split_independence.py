"""The same weights for the models people train, whatever the split: ranks as threads of the
test process (no Ray), every plan the controller could give (shares rebalanced, a kill, a
resize, groups on; micro-batches changed with groups off), against a plain-PyTorch reference
written in `tests/fidelity.py`, parameters and buffers. Every member holds the same bits after
every step."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.adapt.groups import decide_grouping, default_group_size, forward_seed
from elastic.adapt.plan import plan_batch
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig, DataConfig
from elastic.errors import CollectiveError
from elastic.trainer.buffers import BufferSync
from elastic.trainer.replica import Replica, StepRecord, random_layer
from tests import fidelity
from tests.threads import run_ranks

B = 24
G = 6  # B / 4 starting workers
SEED = 3


class _SerialReplica(Replica):
    """Python threads share torch's default generator; a lock around the compute phase (no
    collective in it with flat reduces), the model's construction and the restore of a state
    gives each rank's forwards the generator alone, as a process of its own would have it."""

    compute_lock = threading.Lock()

    def _compute(self, context):
        with self.compute_lock:
            return super()._compute(context)

    def load_state(self, state, origin="checkpoint"):  # sets the generator's state
        with self.compute_lock:
            super().load_state(state, origin)


def _elastic(tmp_path, job, schedule, group: int = G, micro: int | None = None,
             overlap: bool = False, exact: bool = False, loader_workers: int = 0,
             device: str = "cpu"):
    """Runs `schedule`, a list of (world size, steps, weights), each segment a new generation
    whose replicas start from the previous segment's rank-0 state (as after a kill or a
    resize). Returns the last state dict (on the CPU), the same bits on every rank after
    every step. `device` 'cuda': GPU workers sharing the GPU, on the host plane."""
    gpu = device != "cpu"
    where = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    config = FitConfig(scaling=ScalingConfig(num_workers=4, min_workers=1, use_gpu=gpu,
                                             gpus_per_worker=0.25 if gpu else 1.0),
                       collective=CollectiveConfig(backend="gloo", overlap=overlap,
                                                   bucket_bytes=1024, first_bucket_bytes=1024),
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False,
                                         exact=exact),
                       run_dir=str(tmp_path), max_steps=100, seed=SEED,
                       data=DataConfig(loader_workers=loader_workers))
    building = _SerialReplica.compute_lock  # models are built under the process-wide seed too
    state: bytes | None = None
    history = []
    server = RendezvousServer()
    try:
        for world, steps, weights in schedule:
            plan = plan_batch(B, world, micro or group, weights, unit=group)

            def body(comm, plan=plan, steps=steps, state=state):
                if gpu:
                    torch.cuda.set_device(where)
                with building:
                    replica = _SerialReplica(job, config, str(tmp_path), where)
                replica.comm = comm
                try:
                    if state is not None and comm.rank == 0:
                        replica.load_state_bytes(state)
                    replica.sync_from(0)
                    states = []
                    for _ in range(steps):
                        assert isinstance(replica.run_step(plan, []), StepRecord)
                        states.append({k: v.cpu().clone()
                                       for k, v in replica.model.state_dict().items()})
                finally:
                    replica.close()
                return replica, states

            results = run_ranks(server, world, body)
            for step_states in zip(*(states for _, states in results), strict=True):
                for other in step_states[1:]:  # the same bits on every member
                    assert other.keys() == step_states[0].keys()
                    assert all(torch.equal(other[k], step_states[0][k]) for k in other)
            history.append(results[0][1])
            state = results[0][0].state_bytes()
    finally:
        server.close()
    return history[-1][-1]


SCHEDULES = {
    "uninterrupted": [(4, 6, None)],
    "rebalanced": [(3, 6, [3.0, 1.0, 2.0])],
    "kill": [(4, 2, None), (3, 4, None)],
    "resize": [(2, 3, None), (3, 1, [1.0, 2.0, 1.0]), (4, 2, None)],
    "idle_rank": [(5, 6, None)],  # 4 groups over 5 ranks: one rank has no share
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", fidelity.JOBS)
def test_elastic_runs_end_with_the_weights_and_buffers_of_one_plain_process(tmp_path, kind, schedule):
    job = fidelity.JOBS[kind]()
    final = _elastic(tmp_path, job, SCHEDULES[schedule])
    expected = fidelity.reference(job, SEED, B, G, 6)
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        if value.dtype == torch.int64:  # num_batches_tracked: every group counted once
            assert torch.equal(final[key], value), key
        else:
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", fidelity.JOBS)
def test_buckets_that_overlap_the_backward_pass_carry_the_buffers_too(tmp_path, kind):
    job = fidelity.JOBS[kind]()
    final = _elastic(tmp_path, job, SCHEDULES["kill"], overlap=True)
    expected = fidelity.reference(job, SEED, B, G, 6)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("micro", [24, 5])
def test_a_losssum_model_with_groups_off_matches_for_any_share_and_micro_batch(tmp_path, micro):
    job = fidelity.lm_job()
    final = _elastic(tmp_path, job, [(2, 2, [2.0, 1.0]), (3, 4, [1.0, 3.0, 2.0])], group=1,
                     micro=micro)
    expected = fidelity.reference(job, SEED, B, G, 6)
    torch.testing.assert_close(final, expected, rtol=1e-5, atol=1e-5)


def test_batchnorm_under_activation_checkpointing_counts_each_forward_once(tmp_path):
    """Checkpointing runs the layers again in backward; the statistics are read before it, so
    the run holds what one process without checkpointing would (same parameters too)."""
    final = _elastic(tmp_path, fidelity.checkpointed_job(), SCHEDULES["kill"])
    expected = fidelity.reference(fidelity.checkpointed_job(checkpointed=False), SEED, B, G, 6)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


class _BrokenComm:
    """One rank whose allreduce fails, as when a peer dies mid-reduce."""

    rank, world_size = 0, 1

    @property
    def control(self):
        return self

    def shared_buffers(self, sizes):
        return None  # no shared memory to lend: the flat buffers are allocated

    def allreduce(self, tensor):
        raise CollectiveError("peer lost in the reduce", rank=0)


def test_a_step_that_fails_in_its_reduce_leaves_every_buffer_as_it_was(tmp_path):
    """The reduce raises out of the step; the BatchNorm statistics and other buffers must not
    keep any of it (a peer restore would spread them)."""
    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=2, seed=SEED,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(fidelity.cnn_job(), config, str(tmp_path))
    replica.model.register_buffer("seen", torch.zeros(1))
    replica.model.register_forward_hook(lambda m, i, o: m.seen.add_(1))
    replica.buffers = BufferSync(replica.model)
    replica._solo = None  # the reducer of several ranks: its allreduce raises
    replica.comm = _BrokenComm()
    before = {k: v.clone() for k, v in replica.model.state_dict().items()}
    with pytest.raises(CollectiveError):
        replica.run_step(plan_batch(B, 1, G, None, unit=G), [])
    assert replica.global_step == 0
    for key, value in replica.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_reference_tells_the_models_apart_from_a_split_dependent_run(tmp_path):
    """The oracle can fail: groups of 12 instead of 6 change BatchNorm's math, and the run no
    longer matches (the old per-micro-batch behaviour differed by 6e-2)."""
    job = fidelity.cnn_job()
    final = _elastic(tmp_path, job, [(2, 6, None)], group=12)
    expected = fidelity.reference(job, SEED, B, G, 6)
    worst = max(float((final[k].double() - expected[k].double()).abs().max()) for k in expected)
    assert worst > 1e-3


@pytest.mark.timeout(180)
@pytest.mark.parametrize("micro", [24, 8, 5])
def test_a_sample_mean_model_with_groups_off_matches_for_any_micro_batch(tmp_path, micro):
    from tests.jobs import reference_weights, regression_job

    final = _elastic(tmp_path, regression_job(), [(2, 2, None), (3, 2, [1.0, 2.0, 2.0])], group=1,
                     micro=micro)
    expected = reference_weights(SEED, B, 4)
    torch.testing.assert_close(final, expected, rtol=1e-9, atol=1e-10)


# --- the pure parts --------------------------------------------------------------------------


def test_forward_seeds_are_keyed_by_seed_step_and_position_only():
    seeds = {forward_seed(s, step, first) for s in (0, 1) for step in range(50) for first in range(0, 64, 8)}
    assert len(seeds) == 2 * 50 * 8
    assert all(0 <= x < 2**63 for x in seeds)
    assert forward_seed(1, 2, 3) == forward_seed(1, 2, 3)
    with pytest.raises(ValueError):
        forward_seed(0, -1, 0)


@pytest.mark.parametrize(("batch", "workers", "policy", "cap", "expected"), [
    (24, 4, "fixed", None, 6),
    (100, 3, "fixed", None, 25),  # 33 does not divide 100
    (48, 3, "fixed", 8, 8),
    (48, 3, "fixed", 5, 4),
    (48, 3, "scale_with_workers", None, 16),
    (5, 8, "fixed", None, 1),
])
def test_the_default_group_is_ddps_per_rank_batch_or_the_largest_divisor_below(
        batch, workers, policy, cap, expected):
    assert default_group_size(batch, workers, policy, cap) == expected


def test_groups_turn_on_for_batchnorm_or_dropout_and_pin_the_split_when_turned_off():
    auto = decide_grouping("auto", None, 24, 4, "fixed", batchnorm=2, dropout=0)
    assert (auto.on, auto.size, auto.pinned) == (True, 6, False)
    assert "2 BatchNorm layers" in auto.reason
    plain = decide_grouping("auto", None, 24, 4, "fixed", batchnorm=0, dropout=0)
    assert (plain.on, plain.size, plain.pinned) == (False, 1, False)
    off = decide_grouping("off", None, 24, 4, "fixed", batchnorm=0, dropout=1)
    assert (off.on, off.size, off.pinned) == (False, 1, True)
    assert "follows the split" in off.reason
    forced = decide_grouping("on", 12, 24, 4, "fixed", batchnorm=0, dropout=0)
    assert (forced.on, forced.size) == (True, 12)


def test_a_default_group_forced_far_below_each_workers_batch_is_refused_naming_the_setting():
    # Before: a global batch of 101 over 4 workers ran groups of 1 sample (BatchNorm1d then
    # raised in the user's forward; BatchNorm2d normalised each sample alone, silently).
    from elastic.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        decide_grouping("auto", None, 101, 4, "fixed", batchnorm=1, dropout=0)
    assert str(refused.value) == (
        "batch.global_batch_size = 101 has no divisor near its 25 samples per worker "
        "(scaling.num_workers = 4): the default group would be 1 sample(s), and BatchNorm "
        "would normalise over that few (DDP: over 25). Set batch.group_size to a divisor of "
        "the global batch, or a global batch that scaling.num_workers divides")
    with pytest.raises(ConfigError, match=r"would be 2 sample\(s\).*\(such as 53\)"):
        decide_grouping("on", None, 106, 4, "fixed", batchnorm=2, dropout=0)
    with pytest.raises(ConfigError, match=r"within batch.max_micro_batch = 64.*each worker's "
                                          r"batch, or .*, or raise batch.max_micro_batch$"):
        decide_grouping("auto", None, 404, 4, "scale_with_workers", batchnorm=1, dropout=0,
                        max_micro_batch=64)
    assert decide_grouping("auto", None, 126, 4, "fixed", batchnorm=1, dropout=0).size == 21
    assert decide_grouping("auto", 1, 101, 4, "fixed", batchnorm=1, dropout=0).size == 1  # asked
    # Without BatchNorm a small group is only slower: dropout's math holds at any size.
    assert decide_grouping("auto", None, 101, 4, "fixed", batchnorm=0, dropout=1).size == 1
    assert decide_grouping("auto", None, 101, 4, "fixed", 0, 0, exact=True).size == 1


class _KeepsItsDropout(torch.nn.Module):
    """Calls `F.dropout(x, self.attention_dropout)` itself, as Hugging Face attention does."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.attention_dropout = p


class DropPath(torch.nn.Module):
    """Stochastic depth as timm keeps it."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob


class StochasticDepth(torch.nn.Module):
    """Stochastic depth as torchvision keeps it."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.mode = p, "row"


class Dropish(torch.nn.Module):
    """A `*Drop*` class with its probability in `p`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p


@pytest.mark.parametrize(("module", "random"), [
    (torch.nn.Dropout(0.1), True), (torch.nn.Dropout(0.0), False), (torch.nn.AlphaDropout(0.2), True),
    (torch.nn.MultiheadAttention(8, 2, dropout=0.3), True), (torch.nn.MultiheadAttention(8, 2), False),
    (torch.nn.LSTM(4, 4, num_layers=2, dropout=0.3), True), (torch.nn.GRU(4, 4, num_layers=1), False),
    (torch.nn.RReLU(), True), (_KeepsItsDropout(0.1), True), (_KeepsItsDropout(0.0), False),
    (DropPath(0.1), True), (DropPath(0.0), False), (StochasticDepth(0.2), True), (Dropish(0.1), True),
    (torch.nn.Linear(4, 4), False), (torch.nn.BatchNorm1d(4), False),
], ids=lambda v: type(v).__name__ if isinstance(v, torch.nn.Module) else str(v))
def test_layers_that_draw_random_numbers_are_found_beyond_nn_dropout(module, random):
    assert random_layer(module) is random


def test_a_model_whose_randomness_is_in_attention_lstm_and_rrelu_gets_groups_under_auto():
    traits = {"batchnorm": 0, "dropout": sum(map(random_layer, fidelity.RandomLayers().modules()))}
    assert traits["dropout"] == 3
    grouping = decide_grouping("auto", None, 24, 4, "fixed", **traits)
    assert grouping.on and "3 dropout-like layers" in grouping.reason
    plain = decide_grouping("auto", None, 24, 4, "fixed", batchnorm=0, dropout=0)
    assert "batch.groups = 'on'" in plain.reason  # what to do if the randomness is elsewhere


def test_plans_with_groups_give_whole_groups_to_every_rank():
    plan = plan_batch(24, 3, 6, [3.0, 1.0, 2.0], unit=6)
    assert plan.shares == (12, 6, 6) and plan.micro_batches == (6, 6, 6)
    assert plan_batch(24, 5, 6, None, unit=6).shares == (6, 6, 6, 6, 0)
    assert plan_batch(24, 2, 6, None, micro_caps=[3, None], unit=6).micro_batches == (6, 6)
    with pytest.raises(ValueError, match="does not divide"):
        plan_batch(24, 2, None, None, unit=5)


def test_group_settings_that_cannot_work_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"batch\.group_size \(5\) must divide"):
        FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=1,
                  batch=BatchConfig(global_batch_size=24, group_size=5))
    with pytest.raises(ValueError, match="max_micro_batch"):
        FitConfig(scaling=ScalingConfig(num_workers=2),
                  batch=BatchConfig(global_batch_size=24, group_size=6, max_micro_batch=4),
                  max_steps=1)


def test_a_batchnorm_layer_run_twice_in_one_forward_is_a_clear_error():
    bn = torch.nn.BatchNorm1d(3)
    sync = BufferSync(torch.nn.Sequential(bn))
    sync.begin(2)
    sync.before_piece(0)
    bn(bn(torch.randn(4, 3)))
    with pytest.raises(ValueError, match="ran 2 times in one forward"):
        sync.after_piece(0)


def test_a_step_voted_down_leaves_every_buffer_as_it_was():
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    model.register_buffer("seen", torch.zeros(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sync = BufferSync(model)
    sync.begin(1)
    sync.before_piece(0)
    model(torch.randn(4, 3))
    model.seen += 1
    sync.after_piece(0)
    section = sync.section()
    assert section[0] == 1.0  # another buffer changed
    sync.rollback()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_group_cost_benchmark_times_every_group_size():
    """`python -m elastic.bench.groups` (docs/benchmarks.md), at a tiny size."""
    from elastic.bench.groups import measure

    result = measure("mlp95", 8, [8, 4], steps=1)
    assert list(result) == [8, 4] and all(seconds > 0 for seconds in result.values())
