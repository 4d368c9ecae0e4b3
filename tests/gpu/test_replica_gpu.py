"""A replica on a GPU, without Ray: training equal to the CPU reference, the gradients alone on
the data plane, a real CUDA out-of-memory error voted down and redone, the CUDA generator
through a state round trip, host copies and loaded state landing on the device.

The communicator is `tests.gpu.planes.PlaneCheck` (one rank, two planes), so the tests need
one GPU and neither NCCL nor CuPy; those needing two GPUs skip with fewer."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from elastic.adapt.plan import BatchPlan
from elastic.config import CollectiveConfig, DataConfig
from elastic.errors import CollectiveError
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.device import is_out_of_memory, resolve_device, to_host
from elastic.trainer.reducers import SoloReducer
from elastic.trainer.replica import OutOfMemory, Replica, StepRecord
from tests.gpu import deterministic_kernels
from tests.gpu.planes import PlaneCheck
from tests.jobs import make_dataset, make_model, make_optimizer, mse, reference_weights, regression_job

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                    reason="needs two GPUs")

B = 16
STEPS = 6
N_PARAMS = 6 * 8 + 8 + 8 + 1  # tests.jobs.make_model
PLAN = BatchPlan(B, (B,), (4,))  # four micro-batches: gradients accumulate on the GPU
# float64 on both sides, but another device's kernels: a float32 tolerance.
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}


def _cuda(index: int = 0) -> torch.device:
    return torch.device("cuda", index)


def _config(tmp_path, overlap: bool = False, gpu: bool = True, pinned: bool = False) -> FitConfig:
    return FitConfig(
        scaling=ScalingConfig(num_workers=1, use_gpu=gpu),
        collective=CollectiveConfig(backend="nccl" if gpu else "gloo", overlap=overlap,
                                    bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        data=DataConfig(pin_memory=pinned, loader_workers=1 if pinned else 0),
        run_dir=str(tmp_path), max_steps=STEPS, ledger=True)


def _replica(job: TrainJob, config: FitConfig, tmp_path, device: torch.device,
             comm=None, alone: bool = False) -> Replica:
    """A replica built as the worker actor builds it: the device bound first. Unless `alone`,
    it sums through the reducer of several ranks (flat buffers or buckets, on the device),
    not the one a real generation of one rank takes (`SoloReducer`, which `fit` at one
    worker runs)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    replica = Replica(job, config, str(tmp_path), device)
    if not alone:
        replica._solo = None
    replica.comm = comm if comm is not None else PlaneCheck(cuda=device.type == "cuda")
    return replica


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def _train(replica: Replica, steps: int, plan: BatchPlan = PLAN) -> list:
    try:
        return [replica.run_step(plan, []) for _ in range(steps)]
    finally:
        replica.close()


@pytest.mark.parametrize("pinned", [False, True], ids=["in-process", "pinned-loader"])
@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_one_gpu_replica_trains_as_the_cpu_reference(tmp_path, overlap, pinned):
    replica = _replica(regression_job(), _config(tmp_path, overlap, pinned=pinned), tmp_path,
                       _cuda())
    records = _train(replica, STEPS)
    assert all(isinstance(r, StepRecord) for r in records)
    assert all(p.device == _cuda() for p in replica.model.parameters())
    momentum = [t for st in replica.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)]
    assert momentum and all(t.device == _cuda() for t in momentum)  # built after the move
    comm = replica.comm
    # The data plane carried the float64 gradients and nothing else; the control plane the
    # metadata (PlaneCheck asserts the devices on every call).
    assert sum(n for _, _, n in comm.calls) == STEPS * N_PARAMS
    assert {dtype for _, dtype, _ in comm.calls} == {torch.float64}
    assert {dtype for _, dtype, _ in comm.control.calls} == {torch.float64}
    assert len(records[0].indices) == B  # the ledger came back through the control plane
    torch.testing.assert_close(_host(replica.model.state_dict()), reference_weights(0, B, STEPS),
                               **TOLERANCE)


def batchnorm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_batchnorm_statistics_on_a_gpu_match_the_same_steps_on_the_cpu(tmp_path, overlap):
    job = TrainJob(model=batchnorm_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset)
    gpu = _replica(job, _config(tmp_path / "gpu", overlap), tmp_path / "gpu", _cuda())
    cpu = _replica(job, _config(tmp_path / "cpu", overlap, gpu=False), tmp_path / "cpu",
                   torch.device("cpu"))
    _train(gpu, STEPS)
    _train(cpu, STEPS)
    # The running statistics' terms went to the host for the control plane and came back.
    torch.testing.assert_close(_host(gpu.model.state_dict()), _host(cpu.model.state_dict()),
                               **TOLERANCE)


def test_one_gpu_rank_alone_sums_nothing_and_trains_as_the_cpu_replica(tmp_path):
    """A generation of one rank (`SoloReducer`): the gradients stay on the GPU where the
    backward pass put them, nothing crosses either plane, and the BatchNorm statistics and
    weights are those of a CPU replica summing through buckets."""
    job = TrainJob(model=batchnorm_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset)
    gpu = _replica(job, _config(tmp_path / "gpu", True), tmp_path / "gpu", _cuda(), alone=True)
    cpu = _replica(job, _config(tmp_path / "cpu", True, gpu=False), tmp_path / "cpu",
                   torch.device("cpu"))
    records = _train(gpu, STEPS)
    _train(cpu, STEPS)
    assert all(isinstance(r, StepRecord) for r in records)
    assert isinstance(gpu.reducer, SoloReducer)
    assert gpu.comm.calls == [] and gpu.comm.control.calls == []
    assert all(p.device == _cuda() for p in gpu.model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in gpu.model.parameters())
    torch.testing.assert_close(_host(gpu.model.state_dict()), _host(cpu.model.state_dict()),
                               **TOLERANCE)


class OutOfMemoryOnce:
    """A loss whose first call asks the GPU for more memory than it has (a real CUDA
    out-of-memory error from the caching allocator)."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        if not self.fired:
            self.fired = True
            device = batch[0].device
            total = torch.cuda.get_device_properties(device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=device)
        return mse(model, batch)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_a_real_cuda_out_of_memory_error_is_voted_down_and_the_step_redone_smaller(tmp_path,
                                                                                  overlap):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=OutOfMemoryOnce(),
                   dataset=make_dataset)
    replica = _replica(job, _config(tmp_path, overlap), tmp_path, _cuda())
    first = replica.run_step(PLAN, [])
    assert first == OutOfMemory(step=0, ranks=(0,))
    assert replica.global_step == 0 and all(p.grad is None for p in replica.model.parameters())
    # The controller halves the rank's micro-batch (OomBackoff); the step is redone.
    records = _train(replica, STEPS, BatchPlan(B, (B,), (2,)))
    assert [r.step for r in records] == list(range(STEPS))
    torch.testing.assert_close(_host(replica.model.state_dict()), reference_weights(0, B, STEPS),
                               **TOLERANCE)


def test_a_real_cuda_out_of_memory_error_is_classified_as_out_of_memory():
    total = torch.cuda.get_device_properties(_cuda()).total_memory
    with pytest.raises(torch.OutOfMemoryError) as raised:
        torch.empty(2 * total, dtype=torch.uint8, device=_cuda())
    assert is_out_of_memory(raised.value)
    try:
        raise CollectiveError("collective failed on rank 0") from raised.value
    except CollectiveError as e:
        assert is_out_of_memory(e)


def dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 1)).double()


def test_dropout_on_a_gpu_reproduces_after_the_state_round_trip(tmp_path):
    job = TrainJob(model=dropout_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset)
    replica = _replica(job, _config(tmp_path), tmp_path, _cuda())
    torch.cuda.manual_seed(11)
    state = replica.state()
    assert not state["cuda_rng"].is_cuda and state["cuda_rng"].dtype == torch.uint8
    x = torch.randn(64, 6, dtype=torch.float64, device=_cuda())  # before: it draws too
    saved = replica.state_bytes()  # as a peer restore sends it
    replica.model.train()
    first = replica.model(x)
    assert not torch.equal(replica.model(x), first)  # the generator moved on
    replica.load_state_bytes(saved)
    torch.testing.assert_close(replica.model(x), first, rtol=0, atol=0)
    # The same state on a CPU worker: the CPU generator restored, the CUDA one ignored.
    cpu = _replica(job, _config(tmp_path / "cpu", gpu=False), tmp_path / "cpu", torch.device("cpu"))
    cpu.load_state_bytes(saved)
    assert torch.equal(torch.get_rng_state(), state["rng"])


def test_host_copies_of_a_gpu_state_are_pinned_snapshots_or_plain_copies():
    weight = torch.ones(4, device=_cuda())
    state = {"model": {"w": weight, "tied": weight}, "cpu": torch.zeros(2), "n": 3}
    snapshot = to_host(state, copy=True, pin=True)
    w = snapshot["model"]["w"]
    assert not w.is_cuda and w.is_pinned() and snapshot["model"]["tied"] is w
    assert snapshot["cpu"] is not state["cpu"]
    weight.add_(1.0)
    assert torch.equal(w, torch.ones(4))  # a snapshot: the live state moved on
    plain = to_host(state)
    assert not plain["model"]["w"].is_cuda and plain["cpu"] is state["cpu"]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_a_state_loaded_from_host_memory_lands_on_the_device_and_training_goes_on_alike(
        tmp_path, overlap):
    job = TrainJob(model=make_model, optimizer=adam, loss=mse, dataset=make_dataset)
    trained = _replica(job, _config(tmp_path / "a", overlap), tmp_path / "a", _cuda())
    _train(trained, 3)
    host = torch.load(io.BytesIO(trained.state_bytes()), weights_only=True, map_location="cpu")
    fresh = _replica(job, _config(tmp_path / "b", overlap), tmp_path / "b", _cuda())
    fresh.load_state(host)
    for st in fresh.optimizer.state.values():  # Adam's moments follow their parameter
        assert st["exp_avg"].device == _cuda() and st["exp_avg_sq"].device == _cuda()
    assert all(p.device == _cuda() for p in fresh.model.parameters())
    _train(trained, 2)
    _train(fresh, 2)
    torch.testing.assert_close(_host(fresh.model.state_dict()), _host(trained.model.state_dict()),
                               **TOLERANCE)


@needs_two_gpus
def test_a_replica_on_the_second_gpu_keeps_everything_there_and_its_threads_bound(tmp_path):
    device = resolve_device(True, ["1"], "0,1", cuda_available=True)
    assert device == _cuda(1)
    replica = _replica(regression_job(), _config(tmp_path, overlap=True), tmp_path, device)
    buckets = replica.reducer.buckets
    assert isinstance(buckets, GradientBuckets)
    # The communication thread binds the parameters' device (a new thread starts on device 0).
    assert buckets._pool.submit(torch.cuda.current_device).result() == 1
    records = _train(replica, STEPS)
    assert all(isinstance(r, StepRecord) for r in records)
    assert all(p.device == device for p in replica.model.parameters())
    torch.testing.assert_close(_host(replica.model.state_dict()), reference_weights(0, B, STEPS),
                               **TOLERANCE)


class HostPlane:
    """One rank's host plane (backend 'gloo' with GPU workers): a single plane, host tensors
    only; records what it carried and whether the gradients arrived in pinned memory."""

    rank, world_size = 0, 1
    transport = "gloo"

    def __init__(self) -> None:
        self.control = self
        self.calls: list[tuple[str, torch.dtype, int, bool]] = []

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert not tensor.is_cuda, "a CUDA tensor on a host plane"
        self.calls.append(("allreduce", tensor.dtype, tensor.numel(), tensor.is_pinned()))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        assert not tensor.is_cuda, "a CUDA tensor on a host plane"
        return tensor

    def barrier(self) -> None:
        pass

    def shared_buffers(self, sizes):
        return None

    def abort(self) -> None:
        pass


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_a_gpu_replica_on_a_host_plane_stages_its_gradients_in_pinned_memory(tmp_path, overlap):
    config = FitConfig(
        scaling=ScalingConfig(num_workers=1, use_gpu=True, gpus_per_worker=0.5),
        collective=CollectiveConfig(backend="gloo", overlap=overlap),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=STEPS, ledger=True)
    replica = _replica(regression_job(), config, tmp_path, _cuda(), comm=HostPlane())
    records = _train(replica, STEPS)
    assert all(isinstance(r, StepRecord) for r in records)
    # One allreduce per step (one bucket holds this model): the float64 gradients with the
    # metadata in their room, in page-locked memory of the staging's own (no region lent).
    grads = [c for c in replica.comm.calls if c[2] >= N_PARAMS]
    assert len(grads) == STEPS and all(pinned for *_, pinned in grads)
    assert all(p.device == _cuda() for p in replica.model.parameters())
    torch.testing.assert_close(_host(replica.model.state_dict()),
                               reference_weights(0, B, STEPS, device="cuda"), **TOLERANCE)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_two_gpu_ranks_sharing_the_gpu_sum_in_their_registered_regions(tmp_path, overlap):
    # Two ranks as threads on the one GPU over real shared memory: each rank's region is
    # page-locked with cudaHostRegister, the gradients are copied into it from the GPU and
    # summed where they lie, and both end with the plain GPU loop's weights.
    import threading

    from elastic.collective import RendezvousServer, direct
    from tests.threads import run_ranks

    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, use_gpu=True, gpus_per_worker=0.5),
        collective=CollectiveConfig(backend="gloo", overlap=overlap, bucket_bytes=1024,
                                    first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=STEPS, ledger=True)
    plan = BatchPlan(B, (9, 7), (4, 3))
    building = threading.Lock()
    with building:
        lend = Replica(regression_job(), config, str(tmp_path), _cuda()).registered_bytes()
    assert lend > 0
    registered, inner = [], direct._registered

    def spy(comm, *args, **kwargs):
        registered.append(comm.rank)
        return inner(comm, *args, **kwargs)

    def body(comm):
        torch.cuda.set_device(_cuda())
        with building:
            replica = Replica(regression_job(), config, str(tmp_path), _cuda())
        replica.comm = comm
        replica.sync_from(0)
        records = [replica.run_step(plan, []) for _ in range(STEPS)]
        staging = replica.reducer.buckets._staging if overlap else replica.reducer.staging
        pinned = staging.registered
        replica.reducer.release()
        replica.close()
        return records, _host(replica.model.state_dict()), pinned, staging.registered

    direct._registered = spy
    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body, shared_bytes=lend)
    finally:
        direct._registered = inner
        server.close()
    reference = reference_weights(0, B, STEPS, device="cuda")
    for records, weights, pinned, after in results:
        assert all(isinstance(r, StepRecord) for r in records)
        assert pinned and not after  # page-locked while used, unlocked once released
        torch.testing.assert_close(weights, reference, **TOLERANCE)
    assert sorted(set(registered)) == [0, 1]


def test_exact_mode_on_gpu_ranks_sharing_the_gpu_ends_with_the_plain_gpu_process_bits(tmp_path):
    # GPU ranks as threads sharing the GPU on the host plane, four down to one through kills
    # and resizes, a CNN with BatchNorm: torch.equal with one plain process on the GPU that
    # sums the same groups in fixed point (tests/fidelity.py, from the README's rules).
    from tests.unit.test_exact import exact_matches_the_plain_process

    with deterministic_kernels():
        exact_matches_the_plain_process(tmp_path, "cuda")


def test_exact_sums_made_on_the_gpu_are_the_hosts_bits():
    """`ExactSum.add_many` on CUDA tensors (the fused peaks, the rounding and the sums on the
    GPU, one copy to the host per step), some beside CPU tensors in the same calls, against
    the same values all on the CPU: the same payload bits and flags, kept slots included, for
    float32, float64 and bfloat16 values, exponents outside float32's range, a NaN, an
    infinity, an overflow and a tensor of several kernel chunks."""
    from elastic.trainer.exact import ExactSum

    g = torch.Generator().manual_seed(3)
    # slot: (elements, dtype, magnitude, exponent): slots 0 and 1 at exponents whose
    # 2**-exponent no float32 holds, slot 0 longer than one kernel chunk.
    slots = [(70_000, torch.float32, 1e-30, -140), (5, torch.float64, 1e45, 130),
             (33, torch.bfloat16, 1.0, -20), (12, torch.float32, 1.0, -20),
             (1, torch.float32, 1.0, -20), (9, torch.float64, 1.0, -20)]
    sizes = [n for n, *_ in slots]
    groups = 4
    values = [[(torch.randn(n, generator=g, dtype=torch.float64) * scale
                * 10.0 ** torch.randint(-3, 1, (n,), generator=g)).to(dtype)
               for n, dtype, scale, _ in slots] for _ in range(groups)]
    values[1][3][4] = float("nan")
    values[2][4][0] = float("inf")
    values[3][5] *= 1e12  # beyond the slot's scale: an overflow
    results = []
    for device in ("cpu", "cuda"):
        # On the GPU run the odd slots stay on the CPU: one call mixes both ways, as a step
        # does with a LossSum count on the host beside the loss on the GPU.
        where = [device if k % 2 == 0 else "cpu" for k in range(len(sizes))]
        for zero in (False, True):  # True: a rank that voted the step down keeps 2 and 3
            s = ExactSum(sizes, groups)
            s.exponents = [e for *_, e in slots]
            s.begin(1)
            for group in values:
                s.add_many([(k, v.to(where[k])) for k, v in enumerate(group)])
            payload = s.payload(zero=zero, meta=torch.tensor([7.0], dtype=torch.float64),
                                keep=(2, 3)).clone()
            s.finish(payload)
            on_device = torch.cat(s.values(range(len(sizes)), torch.device(device))).cpu()
            results.append((payload, on_device, s.nonfinite, s.overflowed, sorted(s.added)))
    host, _, gpu, gpu_zero = results
    assert gpu[2:] == host[2:] and host[2] and host[3]
    for got, want in zip(gpu[:2] + gpu_zero[:2], host[:2] + results[1][:2], strict=True):
        assert torch.equal(got, want)
    for k in (0, 1, 2):  # summed, not rounded away nor left out
        assert host[0][s.offsets[k] : s.offsets[k + 1]].abs().sum() > 0, k
    assert not results[1][0][: s.offsets[2]].any()  # zeroed but for the kept slots 2 and 3
    assert torch.equal(results[1][0][s.offsets[2] : s.offsets[4]], host[0][s.offsets[2] : s.offsets[4]])
