"""The worker's device, checked on the CPU: which GPU Ray's assignment names, batches moved
through every container, host copies of a state, the random state a replica commits, which
errors mean out of memory, and an out-of-memory error in the step's own allocations ending as
this rank's vote instead of an exception. The same paths on a GPU: tests/gpu."""

from __future__ import annotations

import dataclasses
import io
import threading
import weakref
from collections import OrderedDict, namedtuple
from types import MappingProxyType, SimpleNamespace

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from elastic.actors import worker as worker_module
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.control.port import ChunkVotedDown
from elastic.errors import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    GenerationOutOfMemoryError,
    HalfUpdatedError,
    RendezvousError,
)
from elastic.trainer import compute as compute_module
from elastic.trainer import reducers as reducers_module
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.device import (
    _HostCopy,
    is_out_of_memory,
    local_gpu_index,
    move_batch,
    out_of_memory_forming,
    resolve_device,
    rng_state,
    set_rng_state,
    to_device_like,
    to_host,
)
from elastic.trainer.replica import OutOfMemory, Replica, StepRecord, UserFailure
from tests.jobs import make_dataset, make_model, make_optimizer, mse, reference_weights, regression_job
from tests.threads import run_ranks

B = 16

# --- which device ----------------------------------------------------------------------------


@pytest.mark.parametrize(("gpu_ids", "visible", "index"), [
    ([3], "2,3", 1),  # Ray set CUDA_VISIBLE_DEVICES to the node's GPUs it may use
    (["3"], "3", 0),  # ids are strings in newer Ray versions
    ([5, 6], "4, 5,6", 1),  # several assigned: the first
    ([2], None, 2),  # Ray told not to set CUDA_VISIBLE_DEVICES: the id is the local index
    ([2], "NoDevFiles", 2),
    ([], "0,1", 0),  # nothing assigned (outside a Ray worker)
    ([7], "0,1", 0),  # not listed: the first visible device
])
def test_the_local_index_is_the_first_assigned_ids_place_in_the_visible_devices(gpu_ids, visible,
                                                                                 index):
    assert local_gpu_index(gpu_ids, visible) == index


def test_a_cpu_worker_computes_on_the_cpu_whatever_ray_assigned():
    assert resolve_device(False, [1], "0,1", cuda_available=True) == torch.device("cpu")


def test_a_gpu_worker_computes_on_its_assigned_gpu():
    assert resolve_device(True, ["1"], "0,1", cuda_available=True) == torch.device("cuda", 1)


def test_a_gpu_worker_without_cuda_is_refused_with_what_to_change():
    with pytest.raises(ConfigError, match=r"scaling\.use_gpu"):
        resolve_device(True, [0], "0", cuda_available=False)


# --- batches on the device -------------------------------------------------------------------

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Frozen:
    tokens: torch.Tensor
    name: str
    extra: dict


def test_every_tensor_of_a_nested_batch_is_moved_and_every_container_keeps_its_type():
    t = torch.ones(2)
    batch = {"pair": Pair(t, [t, 3]), "frozen": Frozen(t, "a", {"m": (t,)}),
             "ordered": OrderedDict(k=t), "text": "hello"}
    moved = move_batch(batch, torch.device("meta"))  # a device every torch build has
    assert type(moved["pair"]) is Pair and isinstance(moved["pair"].y, list)
    assert type(moved["frozen"]) is Frozen and type(moved["ordered"]) is OrderedDict
    tensors = [moved["pair"].x, moved["pair"].y[0], moved["frozen"].tokens,
               moved["frozen"].extra["m"][0], moved["ordered"]["k"]]
    assert {x.device.type for x in tensors} == {"meta"}
    assert (moved["pair"].y[1], moved["frozen"].name, moved["text"]) == (3, "a", "hello")
    assert batch["pair"].x.device.type == "cpu"  # the batch itself is left as it was


def test_on_the_cpu_moving_a_batch_copies_nothing():
    x, y = torch.ones(3), torch.zeros(3)
    moved = move_batch((x, y), torch.device("cpu"))
    assert moved[0] is x and moved[1] is y


def _keyed_loss(model, batch):
    return mse(model, (batch["x"], batch["y"]))  # the batch as the job's move_batch made it


def test_a_jobs_move_batch_replaces_the_default_and_runs_on_cpu_workers_too(tmp_path):
    seen: list[torch.device] = []

    def keyed(batch, device):
        seen.append(device)
        return {"x": batch[0].to(device), "y": batch[1].to(device)}

    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=_keyed_loss,
                   dataset=make_dataset, move_batch=keyed)
    replica = Replica(job, _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    outcome = replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert isinstance(outcome, StepRecord)
    assert seen == [torch.device("cpu")] * 2  # once per micro-batch


def test_a_move_batch_that_is_not_callable_is_refused():
    with pytest.raises(ConfigError, match="move_batch"):
        TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                 move_batch="cuda")


# --- host copies -----------------------------------------------------------------------------


def test_host_copies_leave_cpu_tensors_alone_unless_asked_to_copy():
    weight = torch.ones(3)
    state = {"model": {"w": weight, "tied": weight}, "step": [1, (2, weight)], "name": "x"}
    same = to_host(state)
    assert same["model"]["w"] is weight and same["step"][1][1] is weight
    copied = to_host(state, copy=True, pin=True)  # pin: ignored without CUDA
    assert copied["model"]["w"] is not weight and torch.equal(copied["model"]["w"], weight)
    assert copied["model"]["tied"] is copied["model"]["w"]  # copied once
    weight.add_(1.0)  # the live state moves on; the copy does not
    assert torch.equal(copied["model"]["w"], torch.ones(3))
    assert copied["step"] == [1, (2, copied["model"]["w"])] and copied["name"] == "x"


# --- random state ----------------------------------------------------------------------------


def test_a_cpu_worker_commits_the_cpu_generator_under_its_old_name():
    assert set(rng_state(torch.device("cpu"))) == {"rng"}


def test_a_gpu_workers_random_state_restores_its_cpu_part_on_a_cpu_worker():
    torch.manual_seed(5)
    saved = {**rng_state(torch.device("cpu")), "cuda_rng": torch.zeros(16, dtype=torch.uint8)}
    expected = torch.rand(3)
    torch.manual_seed(6)
    set_rng_state(saved, torch.device("cpu"))  # the CUDA part is ignored, not applied
    assert torch.equal(torch.rand(3), expected)


def test_the_replicas_random_state_round_trips_and_an_old_state_with_rng_only_loads(tmp_path):
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=False), str(tmp_path))
    state = replica.state()
    assert "rng" in state and "cuda_rng" not in state
    expected = torch.rand(4)
    replica.load_state(state)
    assert torch.equal(torch.rand(4), expected)
    old = {k: v for k, v in state.items() if k != "cuda_rng"}
    replica.load_state(old)
    assert torch.equal(torch.rand(4), expected)


# --- which errors mean out of memory ---------------------------------------------------------


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(("error", "oom"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (_caused(CollectiveError("collective failed on rank 1"), torch.OutOfMemoryError("x")), True),
    (CollectiveError("collective failed on rank 1 of generation 3: NCCL result 1 "
                     "(ncclUnhandledCudaError): Cuda failure 'out of memory'"), True),
    (_caused(CollectiveError("collective failed on rank 0"),
             RuntimeError("NCCL_ERROR_SYSTEM_ERROR: cudaErrorMemoryAllocation")), True),
    (CollectiveError("collective failed on rank 1: Connection reset by peer"), False),
    (CollectiveError("NCCL reported an asynchronous error: NCCL result 6 (ncclRemoteError)"), False),
    (CollectiveTimeoutError("collective did not finish within 0:01:00"), False),
    # The consequence of an earlier failure repeats its text; it is not where memory ran out.
    (CollectiveAbortedError("communicator is broken by an earlier failure: out of memory"), False),
    (ValueError("out of memory"), False),  # user code: not a collective's failure
])
def test_out_of_memory_is_told_apart_from_a_lost_peer(error, oom):
    assert is_out_of_memory(error) is oom


@pytest.mark.parametrize(("error", "line"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has ..."),
     "CUDA out of memory. Tried to allocate 2.00 GiB."),
    # The communicator's builder error, re-wrapped with advice that does not apply: the
    # allocation failure behind it is what is named.
    (_caused(RendezvousError("rank 1 could not connect: raise CollectiveConfig."
                             "rendezvous_timeout if workers start slowly"),
             _caused(CollectiveError("NCCL could not create the communicator: "
                                     "ncclUnhandledCudaError (out of memory: 3 MiB free)"),
                     RuntimeError("NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error"))),
     "NCCL could not create the communicator: ncclUnhandledCudaError (out of memory: 3 MiB "
     "free)"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 8589934592 bytes."),
     "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
     "tried to allocate 8589934592 bytes."),
    (CollectiveAbortedError("communicator is broken by an earlier failure: out of memory"), None),
    (CollectiveError("collective failed on rank 1: Connection reset by peer"), None),
    (ValueError("out of memory"), None),
])
def test_out_of_memory_while_a_generation_forms_is_typed_and_says_what_to_change(error, line):
    typed = out_of_memory_forming(error, rank=2, generation=7, doing="restoring",
                                  device=torch.device("cpu"), worker_id=11)
    if line is None:
        assert typed is None
        return
    assert isinstance(typed, GenerationOutOfMemoryError)
    assert (typed.rank, typed.generation, typed.doing) == (2, 7, "restoring")
    assert str(typed).startswith(
        f"rank 2 (worker 11) ran out of memory while generation 7 formed (restoring): {line}. ")
    assert "sharding.stage" in str(typed) and "scaling.gpus_per_worker" in str(typed)


# --- out of memory in the step's allocations: a vote ----------------------------------------


class _SingleRank:
    """One rank with two planes: sums over one rank change nothing."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.control = SimpleNamespace(rank=0, world_size=1, allreduce=lambda t: t,
                                       broadcast=lambda t, src: t)
        self.aborted = False

    def shared_buffers(self, sizes):
        return None  # no shared memory to lend: the flat buffers are allocated

    def allreduce(self, tensor):
        return tensor

    def start_allreduce(self, tensor):
        return None  # the host sums each bucket (`allreduce`)

    def abort(self):
        self.aborted = True


def _several(replica: Replica) -> _SingleRank:
    """A one-rank communicator for `replica`, which sums through its reducer of several ranks
    (flat buffers or buckets, what these tests are about) instead of leaving the gradients
    where they are, as a real generation of one rank does (`SoloReducer`)."""
    replica._solo = None
    return _SingleRank()


def _config(tmp_path, world: int, overlap: bool) -> FitConfig:
    return FitConfig(
        scaling=ScalingConfig(num_workers=world, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=4, ledger=True)


def _out_of_memory_once(monkeypatch, overlap: bool, rank: int, times: int = 1,
                        error: type[BaseException] = torch.OutOfMemoryError) -> threading.local:
    """Makes the step's gradient allocation (buckets or flat buffers) raise out of memory (or
    `error`) `times` times on `rank` (the rank of the calling thread: `local.rank`). The flat
    buffers are allocated once more after the allocator's cache is released: `times` counts
    that attempt too."""
    local = threading.local()
    left = [times]

    def failing(real):
        def allocate(*args, **kwargs):
            if getattr(local, "rank", None) == rank and left[0] > 0:
                left[0] -= 1
                raise error("CUDA out of memory (injected by the test)"
                            if error is torch.OutOfMemoryError else "injected by the test")
            return real(*args, **kwargs)
        return allocate

    if overlap:
        monkeypatch.setattr(GradientBuckets, "_allocate", failing(GradientBuckets._allocate))
    else:
        monkeypatch.setattr(reducers_module, "flatten_grads", failing(reducers_module.flatten_grads))
    return local


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_out_of_memory_in_the_gradient_buffers_votes_the_step_down_and_it_is_redone(
        tmp_path, monkeypatch, overlap):
    # The flat buffers: their first attempt and the one after the cache is released.
    local = _out_of_memory_once(monkeypatch, overlap, rank=1, times=1 if overlap else 2)
    config = _config(tmp_path, 2, overlap)
    plan = BatchPlan(B, (9, 7), (4, 3))
    building = threading.Lock()

    def body(comm):
        with building:
            replica = Replica(regression_job(), config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        replica.run_step(plan, [])  # step 0 as usual
        local.rank = comm.rank  # from here on rank 1 runs out of memory once
        outcomes = [replica.run_step(plan, []) for _ in range(2)]
        return outcomes, replica

    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body)
    finally:
        server.close()
    for outcomes, replica in results:
        # Every rank reads the same vote: rank 1 ran out of memory; the controller backs its
        # micro-batch off (as for an error in forward or backward) and the step is redone.
        assert outcomes[0] == OutOfMemory(step=1, ranks=(1,))
        assert isinstance(outcomes[1], StepRecord) and outcomes[1].step == 1
        assert all(p.grad is None for p in replica.model.parameters())
        torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 2),
                                   rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_a_rank_out_of_memory_even_with_its_gradients_freed_leaves_the_generation(
        tmp_path, monkeypatch, overlap):
    local = _out_of_memory_once(monkeypatch, overlap, rank=0, times=2 if overlap else 3)
    local.rank = 0
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap), str(tmp_path))
    replica.comm = comm = _several(replica)
    with pytest.raises(CollectiveError) as raised:
        replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert is_out_of_memory(raised.value)  # the worker reports it as out of memory
    assert comm.aborted  # its peers are not left waiting for collectives it cannot join
    assert replica.global_step == 0


def test_a_step_on_two_planes_keeps_the_metadata_off_the_gradient_buffers(tmp_path):
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    records = [replica.run_step(BatchPlan(B, (B,), (8,)), []) for _ in range(3)]
    assert all(isinstance(r, StepRecord) for r in records)
    assert len(records[0].indices) == B  # the ledger came back through the control plane
    torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 3),
                               rtol=1e-9, atol=1e-10)


# --- batches on a CPU worker: passed through -------------------------------------------------


class Span(tuple):
    """A tuple subclass whose constructor takes its fields one by one (not an iterable)."""

    def __new__(cls, x, y):
        return super().__new__(cls, (x, y))


class Tagged(list):
    """A list subclass with an attribute."""

    tag = "class"


def _tagged(*items) -> Tagged:
    out = Tagged(items)
    out.tag = "instance"
    return out


def test_a_cpu_replica_passes_its_batches_through_untouched(tmp_path):
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=False), str(tmp_path))
    x = torch.ones(2)
    for batch in (Span(x, x), _tagged(x, 2), MappingProxyType({"x": x})):
        assert replica.move(batch, replica.device) is batch


def _span_collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return Span(x, _tagged(y))


def _span_loss(model, batch):
    assert type(batch) is Span and batch[1].tag == "instance"
    return mse(model, (batch[0], batch[1][0]))


def test_a_cpu_replica_trains_on_batches_that_no_default_move_could_rebuild(tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=_span_loss,
                   dataset=make_dataset, collate_fn=_span_collate)
    replica = Replica(job, _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    records = [replica.run_step(BatchPlan(B, (B,), (8,)), []) for _ in range(2)]
    assert all(isinstance(r, StepRecord) for r in records)
    torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 2),
                               rtol=1e-9, atol=1e-10)


def test_moving_a_batch_rebuilds_only_what_holds_a_moved_tensor_and_keeps_its_type():
    x = torch.ones(2)
    untouched = {"names": ["a", "b"], "span": Span(1, 2), "proxy": MappingProxyType({"n": 1})}
    moved = move_batch({**untouched, "t": _tagged(x), "m": MappingProxyType({"x": x})},
                       torch.device("meta"))
    assert all(moved[k] is v for k, v in untouched.items())  # nothing in them moved
    assert type(moved["t"]) is Tagged and moved["t"].tag == "instance"
    assert moved["t"][0].device.type == "meta"
    assert type(moved["m"]) is MappingProxyType and moved["m"]["x"].device.type == "meta"


def test_a_batch_that_cannot_be_rebuilt_on_the_device_names_the_jobs_move_batch():
    x = torch.ones(2)
    with pytest.raises(TypeError, match=r"TrainJob\.move_batch"):
        move_batch({"span": Span(x, x)}, torch.device("meta"))


# --- host copies: state dicts, tied weights, pinned memory -----------------------------------


class Tied(torch.nn.Module):
    """Two layers sharing one weight (as an embedding and its output layer do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_host_copy(source: dict, copied: dict) -> None:
    """A state dict's copy: its OrderedDict and `_metadata`, tied weights sharing one copied
    storage, a view rebuilt as the same view of the copy; loadable after serialisation."""
    model = copied["model"]
    assert type(model) is OrderedDict and model._metadata == source["model"]._metadata
    assert _shares(model["a.weight"], model["b.weight"])  # copied once
    assert not _shares(model["a.weight"], source["model"]["a.weight"])
    assert _shares(copied["row"], model["a.weight"])
    assert copied["row"].storage_offset() == 3 and torch.equal(copied["row"], model["a.weight"][1])
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert loaded["model"]._metadata == source["model"]._metadata
    target = Tied()
    target.load_state_dict(loaded["model"])
    assert torch.equal(target.a.weight, source["model"]["a.weight"])


def test_a_snapshot_of_a_state_dict_keeps_its_metadata_and_copies_tied_weights_once():
    model = Tied()
    weights = model.state_dict()
    state = {"model": weights, "row": weights["a.weight"][1]}
    _check_host_copy(state, to_host(state, copy=True, pin=True))  # CPU state: deep-copied
    assert to_host(state) is state  # serialised at once: nothing copied
    # The walk a state with CUDA tensors takes, on CPU tensors.
    _check_host_copy(state, _HostCopy(copy=True, pin=False, pin_limit=0).walk(state))


def test_snapshot_tensors_are_pinned_up_to_the_bound_and_in_pageable_memory_after(monkeypatch):
    pinned: list[int] = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            pinned.append(args[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    walk = _HostCopy(copy=True, pin=True, pin_limit=100)
    sizes = [walk.allocate(n, on_cuda=True).numel() for n in (64, 64, 32)]
    assert sizes == [64, 64, 32] and pinned == [64, 32]  # the second would pass 100 bytes


def test_a_failed_pinned_allocation_falls_back_to_pageable_memory(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, injected)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    walk = _HostCopy(copy=True, pin=True, pin_limit=1 << 30)
    host = walk.allocate(16, on_cuda=True)
    assert host.numel() == 16 and not walk.pin  # and the next are not tried pinned


def test_extra_state_tensors_go_where_the_object_keeps_them_or_to_the_device():
    saved = OrderedDict(ema=torch.ones(2), rng=torch.zeros(3, dtype=torch.uint8),
                        lazy=[torch.ones(1)], n=4)
    saved._metadata = {"": {"version": 2}}
    template = {"ema": torch.zeros(2, device="meta"), "rng": torch.zeros(3, dtype=torch.uint8),
                "lazy": None, "n": 0}
    moved = to_device_like(saved, template, torch.device("meta"))
    assert moved["ema"].device.type == "meta" and moved["lazy"][0].device.type == "meta"
    assert moved["rng"] is saved["rng"] and moved["n"] == 4  # kept on the CPU, as it is now
    assert type(moved) is OrderedDict and moved._metadata == saved._metadata
    assert saved["ema"].device.type == "cpu"  # the loaded state itself is left as it was


# --- the step: what else is out of memory, and what a failed attempt leaves ------------------


def test_the_cpu_allocators_error_is_out_of_memory():
    error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                         "can't allocate memory: you tried to allocate 4611686018427387904 bytes.")
    assert is_out_of_memory(error)
    assert is_out_of_memory(_caused(CollectiveError("collective failed on rank 0"), error))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _cpu_allocator_fails(model, batch):
    torch.empty(1 << 62, dtype=torch.uint8)  # more than any machine has
    return mse(model, batch)


def test_the_cpu_allocators_error_in_the_step_is_an_out_of_memory_vote(tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=_cpu_allocator_fails,
                   dataset=make_dataset)
    replica = Replica(job, _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    assert replica.run_step(BatchPlan(B, (B,), (8,)), []) == OutOfMemory(step=0, ranks=(0,))


class _Watch:
    """A tensor the failed attempt allocated, and whether it was alive when the allocator's
    cache was released."""

    def __init__(self, monkeypatch) -> None:
        self.ref: weakref.ref | None = None
        self.alive_at_release: list[bool] = []
        monkeypatch.setattr(compute_module, "release_cached_memory", self.release)
        monkeypatch.setattr(reducers_module, "release_cached_memory", self.release)

    def allocate(self) -> None:
        big = torch.ones(1 << 16)
        self.ref = weakref.ref(big)
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    def release(self, device) -> None:
        self.alive_at_release.append(self.ref is not None and self.ref() is not None)


def test_the_cache_is_released_once_the_failed_forward_passes_tensors_are_gone(tmp_path,
                                                                                monkeypatch):
    watch = _Watch(monkeypatch)

    def loss(model, batch):
        activations = model(batch[0])  # noqa: F841 (held by this frame when it raises)
        watch.allocate()

    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=loss, dataset=make_dataset)
    replica = Replica(job, _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    assert replica.run_step(BatchPlan(B, (B,), (8,)), []) == OutOfMemory(step=0, ranks=(0,))
    assert watch.alive_at_release and not any(watch.alive_at_release)


def test_the_flat_buffers_are_allocated_again_once_the_failed_attempts_tensors_are_gone(
        tmp_path, monkeypatch):
    watch = _Watch(monkeypatch)
    real = reducers_module.flatten_grads
    calls = [0]

    def flatten(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            watch.allocate()
        return real(*args, **kwargs)

    monkeypatch.setattr(reducers_module, "flatten_grads", flatten)
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _several(replica)
    outcome = replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert watch.alive_at_release == [False]  # released once, out of the except block
    assert isinstance(outcome, StepRecord)  # the second attempt fits: the step commits


def test_an_error_beginning_the_buckets_is_voted_down_and_every_collective_still_issued(
        tmp_path, monkeypatch):
    local = _out_of_memory_once(monkeypatch, True, rank=1, error=ValueError)
    config = _config(tmp_path, 2, overlap=True)
    plan = BatchPlan(B, (9, 7), (4, 3))
    building = threading.Lock()

    def body(comm):
        with building:
            replica = Replica(regression_job(), config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        local.rank = comm.rank
        return [replica.run_step(plan, []) for _ in range(2)], replica

    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body, timeout=30)
    finally:
        server.close()
    for outcomes, replica in results:
        assert isinstance(outcomes[0], UserFailure) and outcomes[0].ranks == (1,)
        assert isinstance(outcomes[1], StepRecord) and outcomes[1].step == 0
        torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 1),
                                   rtol=1e-9, atol=1e-10)


def test_buckets_that_cannot_be_begun_even_after_an_error_leave_the_generation(tmp_path,
                                                                               monkeypatch):
    local = _out_of_memory_once(monkeypatch, True, rank=0, times=2, error=ValueError)
    local.rank = 0
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=True), str(tmp_path))
    replica.comm = comm = _several(replica)
    with pytest.raises(CollectiveError, match="could not allocate") as raised:
        replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert isinstance(raised.value.__cause__, ValueError) and not is_out_of_memory(raised.value)
    assert comm.aborted and replica.global_step == 0


# --- out of memory in the apply phase --------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_out_of_memory_in_the_optimizer_step_makes_that_rank_leave_uncommitted(tmp_path,
                                                                              overlap):
    config = _config(tmp_path, 2, overlap)
    plan = BatchPlan(B, (9, 7), (4, 3))
    building = threading.Lock()

    def body(comm):
        with building:
            replica = Replica(regression_job(), config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        assert isinstance(replica.run_step(plan, []), StepRecord)  # step 0 as usual
        if comm.rank == 0:
            return replica.run_step(plan, []), replica, comm.aborted

        def step(*args, **kwargs):  # Adam's state, allocated at its first step, say
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

        replica.optimizer.step = step
        try:
            replica.run_step(plan, [])
        except CollectiveError as e:
            return e, replica, comm.aborted
        return None, replica, comm.aborted

    server = RendezvousServer()
    try:
        (record, peer, _), (error, replica, aborted) = run_ranks(server, 2, body, timeout=30)
    finally:
        server.close()
    assert isinstance(record, StepRecord) and peer.global_step == 2  # the peer committed it
    assert isinstance(error, CollectiveError) and "apply phase" in str(error)
    assert is_out_of_memory(error) and isinstance(error.__cause__, torch.OutOfMemoryError)
    assert aborted  # it left the generation: restored from the peer when it is re-formed
    assert replica.global_step == 1 and replica.cursor.step == 1  # step 1 not committed here
    assert all(p.grad is None for p in replica.model.parameters())
    # Half updated: it offers no state until it takes a committed one (the peer's, here).
    assert replica.torn_at == 1 and replica.restorable_step == -1
    with pytest.raises(HalfUpdatedError, match="optimizer step of step 1"):
        replica.state()
    replica.load_state(peer.state(), origin="peer")
    assert replica.torn_at is None and replica.restorable_step == 2
    for mine, theirs in zip(replica.model.parameters(), peer.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_single_worker_half_updated_by_out_of_memory_offers_no_state(tmp_path):
    """The optimizer updates some parameters, then runs out of memory: the model is neither
    step 1's nor step 2's. With no peer to take step 2 from, the new generation must not take
    this replica's state as step 1's (it would train on from half-updated weights): it offers
    none, and neither a checkpoint nor a peer can be written from it."""
    replica = Replica(regression_job(), _config(tmp_path, 1, False), str(tmp_path))
    replica.comm = comm = _several(replica)
    plan = BatchPlan(B, (B,), (8,))
    assert isinstance(replica.run_step(plan, []), StepRecord)
    before = [p.detach().clone() for p in replica.model.parameters()]
    real_step = replica.optimizer.step

    def half_step(*args, **kwargs):
        real_step()
        with torch.no_grad():  # undo the last parameter's update: half of the step applied
            list(replica.model.parameters())[-1].copy_(before[-1])
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    replica.optimizer.step = half_step
    with pytest.raises(CollectiveError, match="apply phase of step 1"):
        replica.run_step(plan, [])
    assert comm.aborted and replica.global_step == 1
    assert not torch.equal(next(replica.model.parameters()), before[0])  # half updated
    assert replica.restorable_step == -1
    with pytest.raises(HalfUpdatedError):
        replica.state_bytes()


def test_out_of_memory_before_the_optimizer_step_leaves_the_committed_state_offered(tmp_path):
    # Clipping ran out of memory: the model was not touched, the replica still holds step 1.
    replica = Replica(regression_job(), _config(tmp_path, 1, False), str(tmp_path))
    replica.comm = _several(replica)
    plan = BatchPlan(B, (B,), (8,))
    assert isinstance(replica.run_step(plan, []), StepRecord)
    before = {k: v.clone() for k, v in replica.model.state_dict().items()}

    def clip(params, norms=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    replica.training.unscale_and_clip = clip
    with pytest.raises(CollectiveError, match="apply phase of step 1"):
        replica.run_step(plan, [])
    assert replica.torn_at is None and replica.restorable_step == 1
    assert all(torch.equal(v, before[k]) for k, v in replica.model.state_dict().items())
    assert replica.state_bytes()  # offered as step 1's


def test_a_sparse_gradient_is_an_error_of_the_ranks_user_code(tmp_path):
    class Sparse(torch.nn.Module):  # past the layer check: a functional sparse embedding
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(10, 1))

        def forward(self, x):
            rows = (x.abs().sum(1) * 3).long() % 10
            return torch.nn.functional.embedding(rows, self.table, sparse=True)

    job = dataclasses.replace(regression_job(), model=Sparse)
    replica = Replica(job, _config(tmp_path, 1, False), str(tmp_path))
    replica.comm = _several(replica)
    outcome = replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert isinstance(outcome, UserFailure)
    assert "the backward pass left a sparse gradient" in outcome.traceback
    assert replica.global_step == 0


def test_a_half_updated_worker_joins_the_next_generation_offering_no_state(monkeypatch):
    monkeypatch.setattr(worker_module, "Communicator",
                        lambda *args, **kwargs: SimpleNamespace(transport="shm"))
    actor = _actor(SimpleNamespace(comm=None, registered_bytes=lambda: 0, restorable_step=-1,
                                   global_step=5, shards=None))
    # (step, transport, sharded holdings: None without sharding)
    assert actor.connect(0, 2, "127.0.0.1:1", 1, b"secret") == (-1, "shm", None)


# --- the worker actor ------------------------------------------------------------------------


class _OldComm:
    """The last generation's communicator: closed once, never touched after."""

    def __init__(self) -> None:
        self.closes, self.closed = 0, False

    def close(self, timeout=None) -> bool:
        self.closes += 1
        self.closed = True
        return True

    def abort(self) -> None:
        assert not self.closed, "abort on a closed communicator"


def _actor(replica) -> object:
    """A `WorkerActor` without Ray: the attributes its methods read."""
    actor = object.__new__(worker_module.WorkerActor.__ray_metadata__.modified_class)
    actor.worker_id, actor.device, actor.replica = 0, torch.device("cpu"), replica
    actor.config = SimpleNamespace(collective=CollectiveConfig())
    actor._lock, actor._abort, actor._turn = threading.Lock(), threading.Event(), threading.Condition()
    actor._next_ticket, actor._completed, actor._generation, actor._yield_ticket = 0, True, -1, -1
    actor._checkpoint_chaos, actor._restore_chaos, actor._restore_fired = [], [], []
    actor._writer = None  # no checkpoints
    actor._taken_in = threading.Event()  # set by connect: a spare taken into a generation
    return actor


def test_a_worker_whose_new_communicator_fails_no_longer_points_at_the_closed_one(monkeypatch):
    def refuse(*args, **kwargs):
        raise CollectiveError("rendezvous refused (injected by the test)")

    monkeypatch.setattr(worker_module, "Communicator", refuse)
    old = _OldComm()
    actor = _actor(SimpleNamespace(comm=old, registered_bytes=lambda: 0))
    with pytest.raises(CollectiveError):
        actor.connect(0, 2, "127.0.0.1:1", 1, b"secret")
    assert actor.replica.comm is None and old.closes == 1
    actor.abort()  # does not reach the closed communicator
    with pytest.raises(CollectiveError):
        actor.connect(0, 2, "127.0.0.1:1", 2, b"secret")
    assert old.closes == 1  # not closed again


def test_a_worker_out_of_memory_connecting_or_restoring_says_so_typed(monkeypatch):
    def no_room(*args, **kwargs):  # NCCL's communicator, re-wrapped by the rendezvous
        raise RendezvousError("rank 1 could not connect") from torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(worker_module, "Communicator", no_room)
    actor = _actor(SimpleNamespace(comm=None, registered_bytes=lambda: 0))
    with pytest.raises(GenerationOutOfMemoryError) as raised:
        actor.connect(1, 2, "127.0.0.1:1", 4, b"secret")
    assert (raised.value.rank, raised.value.generation, raised.value.doing) == (1, 4, "connecting")
    assert "CUDA out of memory. Tried to allocate 64.00 MiB" in str(raised.value)

    def sync_from(src, leaving):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    lost_peer = CollectiveError("collective failed on rank 0: Connection reset by peer")

    def lost(src, leaving):
        raise lost_peer

    actor = _actor(SimpleNamespace(comm=SimpleNamespace(rank=1), sync_from=sync_from,
                                   global_step=3))
    actor._generation = 5
    actor._compute = SimpleNamespace(run=lambda call: call())  # the step thread: here
    with pytest.raises(GenerationOutOfMemoryError) as raised:
        actor.sync(0)
    assert (raised.value.rank, raised.value.generation, raised.value.doing) == (1, 5, "restoring")
    actor.replica.sync_from = lost  # a lost peer stays what it is
    with pytest.raises(CollectiveError) as raised:
        actor.sync(0)
    assert raised.value is lost_peer


def test_a_worker_out_of_memory_in_a_step_says_its_communicator_is_broken():
    class Failing:
        comm = SimpleNamespace(rank=1)
        global_step = 3
        cursor = SimpleNamespace(to_dict=lambda: {"step": 3})

        def run_step(self, plan, chaos, factor):
            raise CollectiveError("rank 1 ran out of memory in the apply phase of step 3") \
                from torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    outcome = _actor(Failing())._run_chunk(BatchPlan(B, (8, 8), (8, 8)), 2, [], None)
    assert isinstance(outcome, ChunkVotedDown) and outcome.broken
    assert outcome.failure == OutOfMemory(step=3, ranks=(1,)) and outcome.committed_step == 3
