"""The worker's device, checked on the CPU: which GPU Ray's assignment names, batches moved
through every container, host copies of a state, the random state a replica commits, which
errors mean out of memory, and an out-of-memory error in the step's own allocations ending as
this rank's vote instead of an exception. The same paths on a GPU: tests/gpu."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, namedtuple
from types import SimpleNamespace

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.errors import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
)
from elastic.trainer import replica as replica_module
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.device import (
    is_out_of_memory,
    local_gpu_index,
    move_batch,
    resolve_device,
    rng_state,
    set_rng_state,
    to_host,
)
from elastic.trainer.replica import OutOfMemory, Replica, StepRecord
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
    replica.comm = _SingleRank()
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


# --- out of memory in the step's allocations: a vote ----------------------------------------


class _SingleRank:
    """One rank with two planes: sums over one rank change nothing."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.control = SimpleNamespace(rank=0, world_size=1, allreduce=lambda t: t,
                                       broadcast=lambda t, src: t)
        self.aborted = False

    def allreduce(self, tensor):
        return tensor

    def abort(self):
        self.aborted = True


def _config(tmp_path, world: int, overlap: bool) -> FitConfig:
    return FitConfig(
        scaling=ScalingConfig(num_workers=world, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=4, ledger=True)


def _out_of_memory_once(monkeypatch, overlap: bool, rank: int, times: int = 1) -> threading.local:
    """Makes the step's gradient allocation (buckets or flat buffers) raise out of memory
    `times` times on `rank` (the rank of the calling thread: `local.rank`)."""
    local = threading.local()
    left = [times]

    def failing(real):
        def allocate(*args, **kwargs):
            if getattr(local, "rank", None) == rank and left[0] > 0:
                left[0] -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return real(*args, **kwargs)
        return allocate

    if overlap:
        monkeypatch.setattr(GradientBuckets, "_allocate", failing(GradientBuckets._allocate))
    else:
        monkeypatch.setattr(replica_module, "flatten_grads", failing(replica_module.flatten_grads))
    return local


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_out_of_memory_in_the_gradient_buffers_votes_the_step_down_and_it_is_redone(
        tmp_path, monkeypatch, overlap):
    local = _out_of_memory_once(monkeypatch, overlap, rank=1)
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
    local = _out_of_memory_once(monkeypatch, overlap, rank=0, times=2)
    local.rank = 0
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap), str(tmp_path))
    replica.comm = comm = _SingleRank()
    with pytest.raises(CollectiveError) as raised:
        replica.run_step(BatchPlan(B, (B,), (8,)), [])
    assert is_out_of_memory(raised.value)  # the worker reports it as out of memory
    assert comm.aborted  # its peers are not left waiting for collectives it cannot join
    assert replica.global_step == 0


def test_a_step_on_two_planes_keeps_the_metadata_off_the_gradient_buffers(tmp_path):
    replica = Replica(regression_job(), _config(tmp_path, 1, overlap=False), str(tmp_path))
    replica.comm = _SingleRank()
    records = [replica.run_step(BatchPlan(B, (B,), (8,)), []) for _ in range(3)]
    assert all(isinstance(r, StepRecord) for r in records)
    assert len(records[0].indices) == B  # the ledger came back through the control plane
    torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 3),
                               rtol=1e-9, atol=1e-10)
