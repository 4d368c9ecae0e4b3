"""A generation of one rank (`SoloReducer`): its gradients stay where the backward passes left
them, nothing crosses either plane, the weights are those of the reducers of several ranks
and of a plain loop; the replica switches reducers as the world size changes; and the step's
own work beside the model's does not grow with the number of layers (on a GPU each tensor
operation is a kernel launch: work per layer is what made a ResNet-50 step CPU-bound)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from elastic.adapt.plan import BatchPlan
from elastic.bench.step import run_step_bench
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.errors import ConfigError
from elastic.trainer.buffers import BufferSync
from elastic.trainer.reducers import SoloReducer, grads_finite
from elastic.trainer.replica import NonFinite, Replica, StepRecord, UserFailure
from tests import fidelity
from tests.gpu.planes import PlaneCheck
from tests.jobs import reference_weights, regression_job
from tests.reads import READS, HostReads
from tests.threads import run_ranks

B = 16


def _config(tmp_path, overlap: bool, world: int = 1, **batch) -> FitConfig:
    return FitConfig(
        scaling=ScalingConfig(num_workers=world, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False, **batch),
        run_dir=str(tmp_path), max_steps=8, ledger=True)


def _run(replica: Replica, steps: int, plan: BatchPlan) -> list:
    try:
        return [replica.run_step(plan, []) for _ in range(steps)]
    finally:
        replica.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_one_rank_sums_nothing_and_trains_as_the_reducers_of_several_ranks(tmp_path, overlap):
    plan = BatchPlan(B, (B,), (8,))
    solo = Replica(regression_job(), _config(tmp_path / "solo", overlap), str(tmp_path / "solo"))
    solo.comm = alone = PlaneCheck(cuda=False)
    several = Replica(regression_job(), _config(tmp_path / "several", overlap),
                      str(tmp_path / "several"))
    several._solo = None  # the reducer a generation of several ranks uses, at one rank
    several.comm = PlaneCheck(cuda=False)
    records = _run(solo, 4, plan)
    assert all(isinstance(r, StepRecord) for r in records)
    assert isinstance(solo.reducer, SoloReducer)
    # Nothing was summed over either plane, and no bucket was ever begun.
    assert alone.calls == [] and alone.control.calls == []
    if overlap:
        assert not solo._several.buckets.begun
    assert [r.indices for r in records] == [r.indices for r in _run(several, 4, plan)]
    for name, value in solo.model.state_dict().items():
        assert torch.equal(value, several.model.state_dict()[name]), name
    torch.testing.assert_close(solo.model.state_dict(), reference_weights(0, B, 4),
                               rtol=1e-9, atol=1e-10)


def test_one_rank_votes_a_step_with_a_gradient_that_is_not_finite_down(tmp_path):
    replica = Replica(regression_job(), _config(tmp_path, True), str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    first = replica.model[0].weight

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad.clone().index_fill_(0, torch.tensor([0]), float("nan"))

    handle = first.register_hook(poison)
    before = {k: v.clone() for k, v in replica.model.state_dict().items()}
    try:
        outcome = replica.run_step(BatchPlan(B, (B,), (B,)), [])
    finally:
        handle.remove()
        replica.close()
    assert isinstance(outcome, NonFinite)
    assert all(torch.equal(v, before[k]) for k, v in replica.model.state_dict().items())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_finiteness_of_gradients_is_read_from_every_gradient(value, dtype):
    params = [nn.Parameter(torch.zeros(3, dtype=dtype)), nn.Parameter(torch.zeros(2, 2)),
              nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(0))]
    largest = {torch.float16: 6e4, torch.bfloat16: 3e38, torch.float32: 3e38,
               torch.float64: 1e300}[dtype]  # large, finite: no sum, square or cast may overflow
    params[0].grad = torch.full((3,), largest, dtype=dtype)
    params[1].grad = torch.ones(2, 2)
    params[3].grad = torch.zeros(0)  # an empty gradient has no largest value
    assert grads_finite(params)  # params[2] has no gradient
    params[1].grad[1, 0] = value
    assert not grads_finite(params)


class _Generations:
    """Rank 0's and rank 1's replicas through generations of threads: `pair` runs a step of
    two ranks (rank 1 restored from rank 0), `alone` one of rank 0 by itself."""

    PAIR, ALONE = BatchPlan(B, (9, 7), (5, 4)), BatchPlan(B, (B,), (8,))

    def __init__(self, tmp_path) -> None:
        self.config, self.run_dir = _config(tmp_path, True, world=2), str(tmp_path)
        self.replicas: dict[int, Replica] = {}
        self.server = RendezvousServer()
        self._building = threading.Lock()

    def _body(self, comm):
        with self._building:
            replica = self.replicas.setdefault(comm.rank, Replica(regression_job(), self.config,
                                                                  self.run_dir))
        replica.comm = comm
        replica.sync_from(0)
        return replica.run_step(self.PAIR, [])

    def pair(self) -> list:
        return run_ranks(self.server, 2, self._body)

    def alone(self):
        first = self.replicas[0]
        first.comm = PlaneCheck(cuda=False)
        return first.run_step(self.ALONE, [])

    def close(self) -> None:
        self.server.close()
        for replica in self.replicas.values():
            replica.close()


def _hooks(replica: Replica) -> list[int]:
    return [len(p._post_accumulate_grad_hooks or ()) for p in replica.model.parameters()]


def test_the_reducer_follows_the_world_size_of_each_generation(tmp_path):
    """Two ranks, then rank 0 alone (its buckets freed, their hooks removed), then two again
    from rank 0's state: the weights of one plain process over the same global batches."""
    generations = _Generations(tmp_path)
    try:
        assert all(isinstance(r, StepRecord) for r in generations.pair())
        first = generations.replicas[0]
        assert not any(isinstance(r.reducer, SoloReducer) for r in generations.replicas.values())
        assert first._several.buckets.begun and set(_hooks(first)) == {1}
        assert isinstance(generations.alone(), StepRecord)
        assert isinstance(first.reducer, SoloReducer)
        assert not first._several.buckets.begun  # its last buffers were freed
        assert set(_hooks(first)) == {0}
        assert all(isinstance(r, StepRecord) for r in generations.pair())
        assert not any(isinstance(r.reducer, SoloReducer) for r in generations.replicas.values())
        assert set(_hooks(first)) == {1}
    finally:
        generations.close()
    for replica in generations.replicas.values():
        assert replica.global_step == 3
        torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 3),
                                   rtol=1e-9, atol=1e-10)


# --- the step's own work: a constant number of operations -----------------------------------


def test_one_ranks_step_adds_the_same_operations_to_a_model_of_any_depth():
    """Counted by `elastic bench step` (tensor operations, views aside: kernel launches on a
    GPU) for a CNN of 2 and 8 convolution + BatchNorm blocks, beside a plain step's."""
    rows = [r for r in run_step_bench([2, 8], steps=1, warmup=1) if r.runner != "plain PyTorch"]
    # The step's bookkeeping (data, BatchNorm statistics, finiteness, metadata) in a fixed
    # number of operations, whatever the depth.
    assert rows[0].beyond_plain == rows[1].beyond_plain, rows
    assert 0 < rows[1].beyond_plain < 60, rows


# --- what a plain loop would do, at one rank -------------------------------------------------


@pytest.mark.parametrize("make_job", [fidelity.cnn_job, fidelity.lm_job, fidelity.unused_job],
                         ids=["batchnorm", "loss-sum", "unused-parameters"])
def test_one_rank_trains_as_a_plain_loop(tmp_path, make_job):
    """BatchNorm statistics over two micro-batches, a `LossSum` (the count divides the
    gradients), and a head that some micro-batches do not reach (AdamW must not step it)."""
    config = FitConfig(scaling=ScalingConfig(num_workers=1), seed=3, max_steps=8,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(make_job(), config, str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    records = _run(replica, 4, BatchPlan(B, (B,), (8,)))
    assert all(isinstance(r, StepRecord) for r in records)
    assert isinstance(replica.reducer, SoloReducer)
    torch.testing.assert_close(replica.model.state_dict(),
                               fidelity.reference(make_job(), 3, B, 8, 4))


class _FrozenNorm(nn.Module):
    """Keeps its BatchNorm in eval mode through train() (mmdet's norm_eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4)
        self.modes: list[bool] = []

    def train(self, mode: bool = True) -> _FrozenNorm:
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.bn.training)
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


def test_a_model_that_overrides_train_is_asked_every_step(tmp_path):
    job = TrainJob(model=_FrozenNorm, optimizer=fidelity.sgd, loss=fidelity.classify,
                   dataset=fidelity.images)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=8,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(job, config, str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    stats = replica.model.bn.running_mean.clone()
    assert all(isinstance(r, StepRecord) for r in _run(replica, 3, BatchPlan(B, (B,), (B,))))
    assert replica.model.modes == [False] * 3  # frozen in every step's forward
    assert torch.equal(replica.model.bn.running_mean, stats)


class _FrozenStats(_FrozenNorm):
    """A frozen BatchNorm with statistics of its own (fine-tuning a pretrained network): its
    forward normalises with them, so they must be in place during every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.bn.running_mean.fill_(2.0)
            self.bn.running_var.fill_(4.0)


@pytest.mark.parametrize("group", [B, 8], ids=["one-piece", "two-pieces"])
def test_a_frozen_batchnorm_normalises_with_its_own_statistics_as_in_a_plain_loop(tmp_path,
                                                                                  group):
    job = TrainJob(model=_FrozenStats, optimizer=fidelity.sgd, loss=fidelity.classify,
                   dataset=fidelity.images)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), seed=3, max_steps=8,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(job, config, str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    records = _run(replica, 3, BatchPlan(B, (B,), (group,)))
    assert all(isinstance(r, StepRecord) for r in records)
    expected = fidelity.reference(job, 3, B, group, 3)
    assert torch.equal(replica.model.bn.running_mean, torch.full((4,), 2.0))
    torch.testing.assert_close(replica.model.state_dict(), expected)


class _EvalFrozenStats(nn.Module):
    """_FrozenStats frozen the usual way, by its factory putting the layer in eval mode (no
    train() override)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 4)
        with torch.no_grad():
            self.bn.running_mean.fill_(2.0)
            self.bn.running_var.fill_(4.0)
        self.bn.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


def _one_rank(tmp_path, model, loss=fidelity.classify) -> Replica:
    """A one-rank replica of `model` on `fidelity.images` (seed 3, global batch B)."""
    job = TrainJob(model=model, optimizer=fidelity.sgd, loss=loss, dataset=fidelity.images)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), seed=3, max_steps=8,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(job, config, str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    return replica


def test_a_batchnorm_its_factory_put_in_eval_mode_stays_frozen_as_in_a_plain_loop(tmp_path):
    # Before: every step called model.train(), which put the layer back in training mode, so
    # it normalised with batch statistics and overwrote its own (docs: "a layer in eval mode
    # keeps its statistics").
    replica = _one_rank(tmp_path, _EvalFrozenStats)
    assert all(isinstance(r, StepRecord) for r in _run(replica, 3, BatchPlan(B, (B,), (8,))))
    assert replica.model.training and not replica.model.bn.training
    assert torch.equal(replica.model.bn.running_mean, torch.full((4,), 2.0))
    # The plain loop of the same layer frozen through train() (fidelity.reference calls it).
    frozen = TrainJob(model=_FrozenStats, optimizer=fidelity.sgd, loss=fidelity.classify,
                      dataset=fidelity.images)
    expected = fidelity.reference(frozen, 3, B, 8, 3)
    torch.testing.assert_close(replica.model.state_dict(), expected)
    # A model its factory returns in eval mode (from_pretrained) trains in training mode.
    inference = _one_rank(tmp_path / "inference", lambda: _EvalFrozenStats().eval())
    assert inference.model.training and inference.model.bn.training


def test_a_parameter_frozen_at_build_that_starts_training_later_is_refused_naming_it(tmp_path):
    # Gradual unfreezing by requires_grad: before, its gradient was never summed over the
    # workers nor cleared, and the workers' weights parted silently.
    def backbone_frozen():
        model = _EvalFrozenStats()
        model.conv.requires_grad_(False)
        return model

    replica = _one_rank(tmp_path, backbone_frozen)
    assert all(isinstance(r, StepRecord) for r in _run(replica, 1, BatchPlan(B, (B,), (8,))))
    replica.model.conv.weight.requires_grad_(True)  # thawed between steps (a hook, the loss)
    with pytest.raises(ConfigError, match=r"parameter 'conv.weight' was frozen when the model "
                                          r"was built .* learning rate of 0"):
        _run(replica, 1, BatchPlan(B, (B,), (8,)))


class _ManyMetrics:
    """The loss, with 1500 per-class metrics named after the micro-batch's call: about 70 KB
    of names a step over its two micro-batches, more than the ranks exchange (each
    micro-batch's alone is less)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: nn.Module, batch):
        self.calls += 1
        return fidelity.classify(model, batch), {
            f"call_{self.calls}_class_{i:04d}_precision": 1.0 for i in range(1500)}


def test_more_metric_names_than_the_ranks_exchange_are_the_users_error_at_once(tmp_path):
    # Before: every rank's exchange refused them as a CollectiveError, a recovery with nobody
    # lost, and the redone step failed alike.
    replica = _one_rank(tmp_path, fidelity.cnn, loss=_ManyMetrics())
    [outcome] = _run(replica, 1, BatchPlan(B, (B,), (8,)))
    assert isinstance(outcome, UserFailure)
    assert "TrainJob.loss returned 3000 metric names" in outcome.traceback
    assert "more than the 65536 allowed" in outcome.traceback


def test_only_layers_in_training_mode_are_zeroed_before_a_forward_pass():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    with torch.no_grad():
        for bn in (model[1], model[2]):
            bn.running_mean.fill_(2.0)
            bn.running_var.fill_(4.0)
    model.train()
    model[1].eval()
    x = torch.randn(6, 3)
    sync = BufferSync(model)
    sync.begin(1)
    sync.before_piece(0)
    assert torch.equal(model[1].running_mean, torch.full((4,), 2.0))
    assert torch.equal(model[1].running_var, torch.full((4,), 4.0))
    assert torch.equal(model[2].running_mean, torch.zeros(4))  # its term is read off it
    model(x)
    sync.after_piece(0)
    sync.section()
    assert torch.equal(model[1].running_mean, torch.full((4,), 2.0))
    assert int(model[1].num_batches_tracked) == 0


def test_batchnorm_statistics_swapped_under_the_snapshot_are_read_where_they_now_are():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    sync = BufferSync(model)
    sync.begin(1)
    sync.rollback()
    model[1].running_mean.data = torch.full((4,), 7.0)  # new storage, same tensor object
    model[1].num_batches_tracked.data = torch.tensor(5)
    sync.begin(1)
    sync.before_piece(0)
    model(torch.randn(2, 3, 2, 2))
    sync.rollback()  # back to the snapshot: the swapped values, not the old storage's
    assert torch.equal(model[1].running_mean, torch.full((4,), 7.0))
    assert int(model[1].num_batches_tracked) == 5


def test_a_parameter_frozen_while_one_rank_ran_alone_does_not_stop_the_buckets(tmp_path):
    """The buckets hook the parameters again when a generation of several ranks begins: one
    frozen meanwhile (requires_grad=False) takes no hook, and the steps go on."""
    generations = _Generations(tmp_path)
    try:
        generations.pair()
        assert isinstance(generations.alone(), StepRecord)
        for replica in generations.replicas.values():
            replica.model[0].bias.requires_grad_(False)
        assert all(isinstance(r, StepRecord) for r in generations.pair())
        first = generations.replicas[0]
        assert _hooks(first) == [0 if p is first.model[0].bias else 1
                                 for p in first.model.parameters()]
    finally:
        generations.close()
    assert _hooks(first) == [0] * 4  # closed: its reducer released, the hooks removed


# --- BatchNorm counters on a GPU: read once per step, with the step's other values ------------


def _momentum_cnn() -> nn.Module:
    """Every BatchNorm layer with the same momentum (ResNet-50's): on a GPU their counters
    stay on the device through the step."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))


class _Twice(nn.Module):
    """Runs its BatchNorm layer twice in one forward pass (which elastic refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), \
            nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.bn(self.conv(x))).mean((2, 3)))


# and torch.equal, which the buffers' bookkeeping calls (a read on a GPU too)
_READS = READS | {"equal"}


def _gpu_way(monkeypatch, on: bool) -> None:
    from elastic.trainer import device

    monkeypatch.setattr(device, "batched_read", lambda where: on)


def _bn_replica(tmp_path, model) -> Replica:
    job = TrainJob(model=model, optimizer=fidelity.sgd, loss=fidelity.classify,
                   dataset=fidelity.images)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), seed=3, max_steps=8,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(job, config, str(tmp_path))
    replica.comm = PlaneCheck(cuda=False)
    return replica


def _trains_as_a_plain_loop(tmp_path, model) -> None:
    """Three steps of four micro-batches of 4 at one rank end on a plain loop's weights and
    statistics."""
    replica = _bn_replica(tmp_path, model)
    try:
        records = [replica.run_step(BatchPlan(B, (B,), (4,)), []) for _ in range(3)]
    finally:
        replica.close()
    assert all(isinstance(r, StepRecord) for r in records)
    job = TrainJob(model=model, optimizer=fidelity.sgd, loss=fidelity.classify,
                   dataset=fidelity.images)
    torch.testing.assert_close(replica.model.state_dict(), fidelity.reference(job, 3, B, 4, 3))


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
def test_batchnorm_counters_are_not_read_between_forward_and_backward_on_a_gpu(
        tmp_path, monkeypatch, gpu_way):
    """On a GPU (`device.batched_read`, forced here on the CPU) the layers' counters are
    checked in the step's one read: a step of 4 micro-batches reads the host's list of each
    micro-batch's samples (host memory on a GPU too) and nothing else more than a step of 1.
    Before, each micro-batch's counters were read between its forward and its backward (the
    host could not queue the backward before the forward had run), and once as the step
    began; the CPU's way still reads them so (nothing to wait for there)."""
    _gpu_way(monkeypatch, gpu_way)
    replica = _bn_replica(tmp_path, _momentum_cnn)
    reads = []
    try:
        for micro in (B, 4, B, 4):
            with HostReads(_READS) as counted:
                assert isinstance(replica.run_step(BatchPlan(B, (B,), (micro,)), []), StepRecord)
            reads.append(counted.count)
    finally:
        replica.close()
    assert reads[0] == reads[2] and reads[1] == reads[3]
    # per further micro-batch: its sample list; the CPU's way also its counters and its loss
    assert reads[1] - reads[0] == (3 if gpu_way else 3 * 3)


@pytest.mark.parametrize("model", [_momentum_cnn, fidelity.cnn, _FrozenStats],
                         ids=["momentum", "cumulative-average", "frozen"])
def test_batchnorm_statistics_on_a_gpu_are_a_plain_loops(tmp_path, monkeypatch, model):
    """The GPU's way (forced on the CPU) keeps the statistics of one plain process: layers
    that share a momentum keep their counters on the device (a frozen one among them adds no
    term); a cumulative average (momentum None) takes the host's way."""
    _gpu_way(monkeypatch, True)
    _trains_as_a_plain_loop(tmp_path, model)


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
def test_a_batchnorm_layer_run_twice_is_the_steps_user_error_either_way(tmp_path, monkeypatch,
                                                                        gpu_way):
    _gpu_way(monkeypatch, gpu_way)
    replica = _bn_replica(tmp_path, _Twice)
    before = {k: v.clone() for k, v in replica.model.state_dict().items()}
    try:
        outcome = replica.run_step(BatchPlan(B, (B,), (4,)), [])
    finally:
        replica.close()
    assert isinstance(outcome, UserFailure)
    assert "BatchNorm layer 'bn' ran 2 times in one forward pass" in outcome.traceback
    torch.testing.assert_close(replica.model.state_dict(), before, rtol=0, atol=0)


class _Buffers(nn.Module):
    """Buffers beside BatchNorm: position ids and frequencies a forward only reads (Hugging
    Face's), and a counter one forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        for i in range(4):
            self.register_buffer(f"positions{i}", torch.arange(6))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, count: bool) -> torch.Tensor:
        if count:
            self.seen += 1
        return self.lin(x) + self.positions0[:3]


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
def test_other_buffers_are_compared_in_one_read_on_a_gpu(monkeypatch, gpu_way):
    _gpu_way(monkeypatch, gpu_way)
    model = _Buffers()
    sync = BufferSync(model)
    flags, reads = [], []
    for count in (False, True):
        sync.begin(1)
        sync.before_piece(0)
        model(torch.randn(2, 3), count)
        sync.after_piece(0)
        with HostReads(_READS) as counted:
            flags.append(float(sync.section()[0]))
        reads.append(counted.count)
        sync.rollback()
    assert flags == [0.0, 1.0]  # the forward that counted changed a buffer
    # one read for the five buffers on a GPU (a torch.equal each waited for the device)
    assert reads == ([2, 2] if gpu_way else [6, 6])


# --- gradients laid out as their parameters ----------------------------------------------------


def _channels_last_cnn() -> nn.Module:
    return fidelity.cnn().to(memory_format=torch.channels_last)


class _StridesSeen(torch.optim.SGD):
    """SGD that notes, at each step, whether every gradient has its parameter's strides."""

    seen: list[bool] = []

    def step(self, closure=None):
        _StridesSeen.seen.append(all(p.grad.stride() == p.stride() for g in self.param_groups
                                     for p in g["params"] if p.grad is not None))
        return super().step(closure)


def _strides_sgd(params) -> torch.optim.Optimizer:
    return _StridesSeen(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_summed_gradients_of_channels_last_parameters_keep_their_strides(tmp_path, overlap):
    """A channels-last convolution's gradient comes out of the flat buffers and buckets with
    the parameter's strides, as autograd makes it (before: contiguous, which puts fused and
    foreach optimizers on their slow path on a GPU); the weights are a plain loop's."""
    _StridesSeen.seen = []
    job = TrainJob(model=_channels_last_cnn, optimizer=_strides_sgd, loss=fidelity.classify,
                   dataset=fidelity.images)
    config = FitConfig(scaling=ScalingConfig(num_workers=2, min_workers=1), seed=3, max_steps=8,
                       collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024,
                                                   first_bucket_bytes=1024),
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path))
    replica = Replica(job, config, str(tmp_path))
    replica._solo = None  # the reducers of several ranks, at one
    replica.comm = PlaneCheck(cuda=False)
    assert any(not p.is_contiguous() for p in replica.model.parameters())
    records = _run(replica, 3, BatchPlan(B, (B,), (4,)))
    assert all(isinstance(r, StepRecord) for r in records)
    assert _StridesSeen.seen == [True] * 3
    expected = fidelity.reference(job, 3, B, 4, 3)
    torch.testing.assert_close(replica.model.state_dict(), expected)


class _ThreeNorms(nn.Module):
    """Three BatchNorm layers, those in `frozen` held in eval mode through train()."""

    frozen: tuple[int, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.body = _momentum_cnn()
        self.body.insert(6, nn.BatchNorm2d(4))  # a third layer, before the pooling
        with torch.no_grad():
            for i, bn in enumerate(self.norms()):
                bn.running_mean.fill_(0.5 * i)
                bn.running_var.fill_(1.0 + i)

    def norms(self) -> list[nn.BatchNorm2d]:
        return [m for m in self.body if isinstance(m, nn.BatchNorm2d)]

    def train(self, mode: bool = True) -> _ThreeNorms:
        super().train(mode)
        for i, bn in enumerate(self.norms()):
            if i in self.frozen:
                bn.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
@pytest.mark.parametrize("frozen", [(), (0,), (1, 2), (0, 1, 2)],
                         ids=["none", "first", "last-two", "all"])
def test_some_batchnorm_layers_frozen_keep_a_plain_loops_statistics(tmp_path, monkeypatch,
                                                                     gpu_way, frozen):
    _gpu_way(monkeypatch, gpu_way)
    model = type("Frozen", (_ThreeNorms,), {"frozen": frozen})
    _trains_as_a_plain_loop(tmp_path, model)
