"""Exact mode (`batch.exact`): the final state dict is the same bits (`torch.equal`) for any
world size, shares, kills and resizes, and as one plain process summing the same groups in
fixed point (`tests/fidelity.py: exact_reference`, written from the README's rules without the
project's code). Ranks run as threads of the test process (the harness of
`test_split_independence`); real kills on Ray are in `tests/fault/test_exact_faults.py`."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.adapt.groups import decide_grouping
from elastic.adapt.plan import BatchPlan, plan_batch
from elastic.collective import Communicator, RendezvousServer
from elastic.config import CheckpointConfig, CollectiveConfig
from elastic.errors import ConfigError
from elastic.trainer import device
from elastic.trainer import exact as ex
from elastic.trainer.exact import ExactSum
from elastic.trainer.replica import OutOfMemory, Replica, StepRecord, UserFailure
from elastic.trainer.step import Rescale, Vote, verdict
from tests import fidelity
from tests.reads import HostReads
from tests.threads import run_ranks
from tests.unit.test_split_independence import SEED, B, G, _elastic, _SerialReplica


@pytest.fixture(autouse=True)
def _restore_torch():
    """Exact mode fixes torch's threads and turns deterministic kernels on, process-wide."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(False)


# --- the fixed-point sum ----------------------------------------------------------------------


def _groups(n: int, size: int, seed: int) -> list[torch.Tensor]:
    """Float32 values over twelve orders of magnitude, signs mixed: where float sums differ by
    order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) * 10.0 ** torch.randint(-6, 2, (size,), generator=g)
            for _ in range(n)]


def _sum_over_ranks(groups: list[torch.Tensor], split: list[list[int]],
                    exponents: list[int] | None = None) -> list[ExactSum]:
    """Each inner list of `split` is one rank's groups (in that order); payloads summed as the
    allreduce would. Returns every rank's sums."""
    sums = []
    for mine in split:
        s = ExactSum([groups[0].numel()], len(groups))
        if exponents is not None:
            s.exponents = list(exponents)
        s.begin()
        for j in mine:
            s.add(0, groups[j])
        sums.append(s)
    total = torch.stack([s.payload(zero=False) for s in sums]).sum(0)
    for s in sums:
        s.finish(total)
    return sums


def _splits(n: int) -> list[list[list[int]]]:
    order = list(range(n))
    shuffled = order[:]
    random.Random(0).shuffle(shuffled)
    return [[order], [order[::-1]], [order[:3], order[3:]], [shuffled[:1], shuffled[1:5], shuffled[5:]],
            [[j] for j in shuffled]]


def test_the_sum_is_the_same_bits_however_the_groups_are_split_and_ordered():
    groups = _groups(8, 1000, seed=1)
    results = [_sum_over_ranks(groups, split)[0].value(0) for split in _splits(8)]
    assert all(torch.equal(r, results[0]) for r in results[1:])
    exact64 = torch.stack([g.double() for g in groups]).sum(0)
    # Finer than float32: the error is far below a float32 ulp of the largest group value.
    assert float((results[0] - exact64).abs().max()) < 1e-9
    # (while float32 sums in two orders differ: what exact mode is for)
    forward = sum(groups[1:], groups[0].clone())
    backward = sum(groups[-2::-1], groups[-1].clone())
    assert not torch.equal(forward, backward)


def test_values_too_large_for_the_scale_vote_a_rescale_that_fits_whatever_the_split():
    groups = _groups(8, 100, seed=2)
    groups[5] = groups[5] * 1e6  # far above 2**HEADROOM at the initial scale
    exponents = []
    for split in _splits(8):
        ranks = _sum_over_ranks(groups, split)
        owner = next(i for i, mine in enumerate(split) if 5 in mine)
        assert [r.overflowed for r in ranks] == [i == owner for i in range(len(split))]
        ranks[0].rescale()
        exponents.append(ranks[0].exponents[0])
    assert len(set(exponents)) == 1 and exponents[0] > ex.initial_exponent(8)
    redone = [_sum_over_ranks(groups, split, exponents)[0] for split in _splits(8)]
    assert not any(r.overflowed for r in redone)
    assert all(torch.equal(r.value(0), redone[0].value(0)) for r in redone)


def test_a_non_finite_value_is_flagged_not_summed():
    s = ExactSum([3], 4)
    s.begin()
    s.add(0, torch.tensor([1.0, float("nan"), 2.0]))
    assert s.nonfinite and not s.overflowed


def test_exponents_follow_the_largest_values_of_the_last_applied_step():
    groups = [torch.full((4,), 3.0), torch.full((4,), -5.0)]
    s = _sum_over_ranks(groups, [[0, 1]])[0]
    bits = ex.value_bits(2)
    before = s.exponents[0]
    s.advance()
    largest_ints = round(3.0 * 2.0 ** -before) + round(5.0 * 2.0 ** -before)
    assert s.exponents[0] == before + largest_ints.bit_length() + ex.HEADROOM - bits
    # the next step fits values up to 2**HEADROOM times this one's, and not far beyond
    fits = ExactSum([4], 2)
    fits.exponents = list(s.exponents)
    fits.begin()
    fits.add(0, torch.full((4,), 5.0 * 2 ** ex.HEADROOM))
    assert not fits.overflowed
    fits.add(0, torch.full((4,), 8.0 * 2 ** (ex.HEADROOM + 2)))
    assert fits.overflowed
    s.begin()  # a step without values leaves the exponent where it is
    s.finish(s.payload(zero=False))
    after = list(s.exponents)
    s.advance()
    assert s.exponents == after


def test_the_state_round_trips_and_refuses_another_shape():
    s = ExactSum([3, 1], 4)
    s.exponents = [-20, 7]
    t = ExactSum([3, 1], 4)
    t.load_state_dict(s.state_dict())
    assert t.exponents == [-20, 7]
    with pytest.raises(ValueError, match="2 slots for 4 groups"):
        ExactSum([3, 1, 1], 4).load_state_dict(s.state_dict())


def test_a_rescale_outranks_non_finite_values_but_not_user_errors_or_out_of_memory():
    ok, bad, rescale = float(Vote.OK), float(Vote.NONFINITE), float(Vote.RESCALE)
    assert verdict(3, [ok, rescale, bad], "skip", None) == Rescale(step=3, ranks=(1,))
    assert verdict(3, [float(Vote.USER_ERROR), rescale], "skip", "tb") == UserFailure(
        step=3, ranks=(0,), traceback="tb")
    assert verdict(3, [float(Vote.OUT_OF_MEMORY), rescale], "skip", None) == OutOfMemory(
        step=3, ranks=(0,))


# --- configuration ----------------------------------------------------------------------------


def test_exact_mode_needs_groups_and_the_fixed_policy():
    scaling = ScalingConfig(num_workers=2)
    with pytest.raises(ValueError, match=r"batch\.groups 'off'"):
        FitConfig(scaling=scaling, max_steps=1,
                  batch=BatchConfig(global_batch_size=8, exact=True, groups="off"))
    with pytest.raises(ValueError, match=r"batch\.policy 'fixed'"):
        FitConfig(scaling=scaling, max_steps=1,
                  batch=BatchConfig(global_batch_size=8, exact=True, policy="scale_with_workers"))


def test_exact_mode_turns_groups_on_for_any_model():
    plain = decide_grouping("auto", None, 24, 4, "fixed", 0, 0, exact=True)
    assert (plain.on, plain.size) == (True, 6) and "batch.exact" in plain.reason


# --- whole runs -------------------------------------------------------------------------------

@pytest.fixture
def gpu_way(monkeypatch):
    """The GPU's way of `ExactSum.add_many` (`elastic.trainer.exact.fused_on`) and of reading
    the step's losses (`elastic.trainer.device.batched_read`), on the CPU."""
    monkeypatch.setattr(ex, "fused_on", lambda device: True)
    monkeypatch.setattr(device, "batched_read", lambda device: True)


@pytest.fixture(params=[True, False], ids=["gpu_way", "cpu_way"])
def either_way(request, monkeypatch) -> bool:
    """The test twice: the GPU's ways (`gpu_way`) run on the CPU, then the CPU's; returns
    whether it is the GPU's."""
    monkeypatch.setattr(ex, "fused_on", lambda device: request.param)
    monkeypatch.setattr(device, "batched_read", lambda device: request.param)
    return request.param


def test_one_group_of_many_slots_is_read_once_and_sums_by_the_fixed_point_rule(either_way):
    """`add_many` (what a group's gradients, BatchNorm terms and loss go through): the GPU's
    way reads the values' peaks once per group, however many slots; both ways give per slot
    the sum of the README's rule (`tests/fidelity.py`), float32, float64 and bfloat16 values
    alike."""
    fused = either_way
    groups, sizes = 4, [7, 1, 30, 0, 5, 12]
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32, torch.float32,
              torch.float64]
    values = [[v.to(dtype) for v in _groups(groups, n, seed=10 + k)]
              for k, (n, dtype) in enumerate(zip(sizes, dtypes, strict=True))]
    s = ExactSum(sizes, groups)
    s.begin()
    for j in range(groups):
        with HostReads() as reads:
            s.add_many([(k, values[k][j]) for k in range(len(sizes))])
        assert reads.count == (1 if fused else sum(1 for n in sizes if n))
    assert not (s.nonfinite or s.overflowed) and s.added == set(range(len(sizes)))
    s.finish(s.payload(zero=False))
    for k in range(len(sizes)):
        total, exponent, largest = fidelity._fixed_point_sum(values[k], s.exponents[k], groups)
        assert exponent == s.exponents[k]
        assert torch.equal(s.value(k), total), k
        assert s._tail(0)[k] == largest
    # Read again on a device (here the host), all or some in any order: the same bits, and
    # the summed integers left as they were.
    before = [s.value(k) for k in range(len(sizes))]
    for slots in (range(len(sizes)), [4, 1], [2]):
        for k, value in zip(slots, s.values(slots, torch.device("cpu")), strict=True):
            assert torch.equal(value, before[k]), k
    assert all(torch.equal(s.value(k), before[k]) for k in range(len(sizes)))


def test_a_gpus_fused_peaks_are_the_hosts_nan_and_infinity_included():
    """What a GPU reads (`_peaks_fused`, run here on CPU tensors) is what the host reads
    (`_peak_cpu`): each tensor's largest magnitude in its place, whatever the dtypes' order."""
    nan, inf = float("nan"), float("inf")
    xs = [torch.tensor([1.0, -3.0]), torch.tensor([2.0, -7.5], dtype=torch.float64),
          torch.tensor([0.5, nan, 9.0]), torch.tensor([-inf, 1.0], dtype=torch.float64),
          torch.tensor([-0.25]), torch.tensor([4.0, nan], dtype=torch.float64)]
    host, fused = [ex._peak_cpu(x) for x in xs], ex._peaks_fused(xs)
    assert host[:2] == fused[:2] == [3.0, 7.5]
    assert math.isnan(host[2]) and math.isnan(fused[2]) and math.isnan(host[5]) and math.isnan(fused[5])
    assert host[3] == fused[3] == inf and host[4] == fused[4] == 0.25


def _deep_exact_replica(tmp_path, depth: int) -> Replica:
    from elastic.bench.step import _Deep, _Images, _loss, _sgd
    from elastic.job import TrainJob

    job = TrainJob(model=_Deep(depth, 4), optimizer=_sgd, loss=_loss, dataset=_Images(64, 4))
    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=10,
                       batch=BatchConfig(global_batch_size=8, group_size=2, exact=True,
                                         autotune=False, rebalance=False),
                       run_dir=str(tmp_path / f"depth{depth}"))
    return Replica(job, config, config.run_dir)


@pytest.mark.timeout(120)
def test_an_exact_step_reads_values_a_fixed_number_of_times_whatever_the_depth(tmp_path,
                                                                             gpu_way):
    """On a GPU each read of a tensor's values by the host waits for the device: a step whose
    reads grow with the layers (two per parameter and BatchNorm statistic per group, before)
    is as slow as its number of layers, whatever the GPU. The GPU's way, run on the CPU."""
    torch.set_num_threads(1)
    counts = []
    server = RendezvousServer()
    try:
        for depth in (2, 6):
            replica = _deep_exact_replica(tmp_path, depth)
            replica.comm = comm = Communicator(0, 1, server.endpoint, depth, CollectiveConfig(),
                                               secret=server.secret)
            plan = BatchPlan(8, (8,), (2,))
            try:
                assert isinstance(replica.run_step(plan, []), StepRecord)
                with HostReads() as reads:
                    assert isinstance(replica.run_step(plan, []), StepRecord)
                counts.append(reads.count)
            finally:
                replica.close()
                comm.close()
    finally:
        server.close()
    assert counts[0] == counts[1], counts


JOBS = {"mlp": fidelity.mlp_job, **fidelity.JOBS}
SCHEDULES = {
    "4_workers": [(4, 6, None)],
    "2_workers": [(2, 6, None)],
    "3_workers": [(3, 6, None)],
    "kills_and_resize": [(4, 1, None), (3, 2, None), (2, 1, None), (4, 1, None), (1, 1, None)],
    "rebalanced": [(4, 3, [1.0, 3.0, 2.0, 1.0]), (3, 3, [3.0, 1.0, 1.0])],
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", JOBS)
def test_every_schedule_ends_with_the_bits_of_one_plain_process(tmp_path, kind, schedule):
    torch.set_num_threads(1)
    expected = fidelity.exact_reference(JOBS[kind](), SEED, B, G, 6)
    final = _elastic(tmp_path, JOBS[kind](), SCHEDULES[schedule], exact=True)
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key
    # and the math is the float reference's, to float32 rounding
    floats = fidelity.reference(JOBS[kind](), SEED, B, G, 6)
    for key, value in floats.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-6, msg=key)


# Kills and resizes down to one rank, for the GPU tier's run of the same test on GPU ranks.
DEVICE_SCHEDULE = [(4, 1, None), (3, 2, None), (2, 1, None), (1, 2, None)]


def exact_matches_the_plain_process(tmp_path, device: str) -> None:
    """Ranks on `device` through `DEVICE_SCHEDULE` end with the bits of one plain process on
    it (`tests/gpu/test_replica_gpu.py` runs this on a GPU)."""
    expected = fidelity.exact_reference(fidelity.cnn_job(), SEED, B, G, 6, device=device)
    final = _elastic(tmp_path, fidelity.cnn_job(), DEVICE_SCHEDULE, exact=True,
                     device=device)
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), key


@pytest.mark.timeout(120)
def test_the_gpu_tiers_exact_schedule_ends_with_the_plain_bits_on_the_cpu(tmp_path, either_way):
    torch.set_num_threads(1)
    exact_matches_the_plain_process(tmp_path, "cpu")


@pytest.mark.timeout(120)
def test_without_exact_mode_the_bits_follow_the_split(tmp_path):
    """What the tests above would catch: the default sums in float, in the split's order."""
    torch.set_num_threads(1)
    expected = fidelity.exact_reference(fidelity.cnn_job(), SEED, B, G, 6)
    final = _elastic(tmp_path, fidelity.cnn_job(), SCHEDULES["3_workers"])
    assert any(not torch.equal(final[k], v) for k, v in expected.items())


def _config(tmp_path, **checkpoint) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=10, seed=SEED,
                     batch=BatchConfig(global_batch_size=B, exact=True, autotune=False,
                                       group_size=G),
                     run_dir=str(tmp_path),
                     checkpoint=CheckpointConfig(path=str(tmp_path / "ck"), **checkpoint)
                     if checkpoint is not None else None)


def _steps(replicas, plan, steps: int):
    server = RendezvousServer()
    try:
        def body(comm):
            replica = replicas[comm.rank]
            replica.comm = comm
            return [replica.run_step(plan, []) for _ in range(steps)]
        return run_ranks(server, len(replicas), body)
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_a_large_gradient_redoes_the_step_at_a_wider_scale_and_still_matches(tmp_path, either_way):
    torch.set_num_threads(1)
    job = fidelity.mlp_job(loss_scale=1e5)
    config = _config(tmp_path, **{}).model_copy(update={"checkpoint": None})
    replicas = [_SerialReplica(job, config, str(tmp_path)) for _ in range(2)]
    records = _steps(replicas, plan_batch(B, 2, G, unit=G), 6)
    assert all(isinstance(r, StepRecord) for rank in records for r in rank)
    assert records[0][0].rescaled >= 1  # the initial scale fits values below 2**8
    assert all(r.rescaled == 0 for r in records[0][1:])  # then the scale follows the gradients
    expected = fidelity.exact_reference(job, SEED, B, G, 6)
    for key, value in expected.items():
        assert torch.equal(replicas[1].model.state_dict()[key], value), key


@pytest.fixture
def precision_settings():
    """Restores torch's TF32 and reduced-precision settings after the test."""
    b = torch.backends
    saved = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision,
             b.cudnn.rnn.fp32_precision, b.fp32_precision, torch.get_float32_matmul_precision(),
             b.cuda.matmul.allow_bf16_reduced_precision_reduction)
    yield
    (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision,
     b.fp32_precision) = saved[:4]
    torch.set_float32_matmul_precision(saved[4])
    b.cuda.matmul.allow_bf16_reduced_precision_reduction = saved[5]


def test_on_a_gpu_the_environment_names_the_precision_settings_and_a_change_is_seen(
        monkeypatch, precision_settings):
    """A GPU's bits also depend on TF32 (matrix products, convolutions, RNNs, set the old
    way or per operation), reduced-precision reductions and cuBLAS's workspace setting: an
    exact state written under other values is flagged. A mix of the old and new ways, which
    torch refuses to read back as an old flag, is recorded, not raised."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    saved = ex.environment()
    assert saved["device"] == "NVIDIA H100 80GB HBM3" and saved["cuda"] == "13.0"
    assert saved["cublas_workspace"] == ":4096:8" and "fp32_conv" in saved
    assert ex.environment_changes(saved) == {}
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # conv and RNN now differ: "mixed"
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    changes = ex.environment_changes(saved)
    assert changes["fp32_conv"] == (saved["fp32_conv"], "ieee")
    assert changes["tf32_cudnn"] == (saved["tf32_cudnn"], "mixed")
    assert changes["bf16_reduced_reduction"] == (True, False)
    assert changes["cublas_workspace"] == (":4096:8", ":16:8")
    torch.set_float32_matmul_precision("high")
    assert ex.environment_changes(saved)["matmul_precision"] == ("highest", "high")


def test_a_checkpoint_from_another_environment_or_without_exact_mode_is_refused(tmp_path):
    torch.set_num_threads(1)
    job = fidelity.mlp_job()
    replica = Replica(job, _config(tmp_path), str(tmp_path))
    state = replica.state()
    other = {**state, "exact": {**state["exact"],
                                "environment": {**state["exact"]["environment"], "threads": 64}}}
    with pytest.raises(ConfigError, match=r"threads=64.*allow_environment_change"):
        replica.load_state(other)
    without = {k: v for k, v in state.items() if k != "exact"}
    with pytest.raises(ConfigError, match=r"written without batch\.exact"):
        replica.load_state(without)
    with pytest.raises(ConfigError, match="peer"):  # never from a peer: members compute alike
        Replica(job, _config(tmp_path, allow_environment_change=True),
                str(tmp_path)).load_state(other, origin="peer")
    allowed = Replica(job, _config(tmp_path, allow_environment_change=True), str(tmp_path))
    allowed.load_state(other)
    assert allowed.exact.exponents == state["exact"]["exponents"]
    replica.load_state(state)  # the same environment loads


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 1)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += len(x)
        return self.linear(x)


@pytest.mark.timeout(60)
def test_a_forward_that_changes_another_buffer_is_a_user_error_naming_it(tmp_path):
    torch.set_num_threads(1)
    job = fidelity.mlp_job()
    job = type(job)(model=_Counting, optimizer=job.optimizer, loss=job.loss, dataset=job.dataset)
    config = _config(tmp_path).model_copy(update={"checkpoint": None})
    replicas = [_SerialReplica(job, config, str(tmp_path)) for _ in range(2)]
    outcomes = _steps(replicas, plan_batch(B, 2, G, unit=G), 1)
    failure = outcomes[0][0]
    assert isinstance(failure, UserFailure) and failure.ranks == (0, 1)
    assert "changed buffer 'seen'" in failure.traceback


def test_every_slot_of_a_model_is_covered():
    """Parameters, loss, count and both statistics of every BatchNorm layer."""
    config = FitConfig(scaling=ScalingConfig(num_workers=4), max_steps=1,
                       batch=BatchConfig(global_batch_size=B, exact=True))
    replica = Replica(fidelity.cnn_job(), config, ".")
    params = list(replica.model.parameters())
    assert replica.exact.sizes == [p.numel() for p in params] + [1, 1, 4, 4, 4, 4]
    assert replica.exact.groups == B // G
    assert list(itertools.accumulate(replica.exact.sizes, initial=0)) == replica.exact.offsets


def _poisoned() -> torch.utils.data.TensorDataset:
    data = fidelity.regression()
    x, y = data.tensors
    x = x.clone()
    x[5] = float("nan")  # its group's loss and gradients are NaN
    return torch.utils.data.TensorDataset(x, y)


def _summed_mse(model, batch):
    from elastic import LossSum

    x, y = batch
    return LossSum(((model(x) - y) ** 2).sum(), len(x))


@pytest.mark.timeout(120)
def test_a_non_finite_losssum_group_is_skipped_alike_at_any_world_size(tmp_path, either_way):
    """The count travels whatever the vote, so whether the step's count is 0 does not depend
    on which rank held the NaN group; the skipped step leaves the exponents as they were."""
    torch.set_num_threads(1)
    job = fidelity.mlp_job()
    job = type(job)(model=job.model, optimizer=job.optimizer, loss=_summed_mse, dataset=_poisoned)
    config = _config(tmp_path).model_copy(update={"checkpoint": None})
    config = config.model_copy(update={"failure": config.failure.model_copy(
        update={"nonfinite": "skip"})})
    finals = []
    for world in (1, 2):
        replicas = [_SerialReplica(job, config, str(tmp_path)) for _ in range(world)]
        skipped = 0
        for _ in range(4):  # one epoch: the NaN sample comes once
            before = list(replicas[0].exact.exponents)
            record = _steps(replicas, plan_batch(B, world, G, unit=G), 1)[0][0]
            assert isinstance(record, StepRecord)
            if record.skipped_ranks:
                skipped += 1
                assert replicas[0].exact.exponents == before
        assert skipped == 1
        finals.append(replicas[0].model.state_dict())
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_a_state_for_another_number_of_groups_is_refused_before_anything_loads(tmp_path):
    job = fidelity.mlp_job()
    replica = Replica(job, _config(tmp_path), str(tmp_path))
    state = replica.state()
    other = {**state, "exact": {**state["exact"], "groups": 8},
             "cursor": {**state["cursor"], "global_step": 7}}
    with pytest.raises(ConfigError, match=r"batch\.group_size"):
        replica.load_state(other)
    assert replica.global_step == 0  # nothing of it was taken
    for bad in ({"exponents": [10**6] * replica.exact.slots, "groups": 4},
                {"exponents": "x", "groups": 4}, ["not", "a", "dict"]):
        with pytest.raises(ConfigError, match="malformed"):
            replica.load_state({**other, "exact": bad}, origin="peer")
    assert replica.global_step == 0
