"""The device paths on a GPU that the CPU tests reach only in part: host snapshots of a CUDA
state (tied weights copied once, a state dict's `_metadata`, pinned memory up to its bound),
batches rebuilt on the device or refused with what to do, extra state loaded onto the device,
and a real CUDA out-of-memory error in the apply phase."""

from __future__ import annotations

import io
from collections import OrderedDict

import pytest
import torch
from torch import nn

from elastic import TrainJob
from elastic.errors import CollectiveError
from elastic.trainer.device import is_out_of_memory, move_batch, to_host
from elastic.trainer.replica import Replica, StepRecord
from tests.gpu.planes import PlaneCheck
from tests.gpu.test_replica_gpu import PLAN, _config, _cuda
from tests.jobs import make_dataset, make_model, make_optimizer, mse

pytestmark = pytest.mark.gpu


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("copy", [False, True], ids=["serialised-at-once", "snapshot"])
def test_a_cuda_state_dict_on_the_host_keeps_its_metadata_ties_and_views(copy):
    model = Tied().to(_cuda())
    weights = model.state_dict()
    state = {"model": weights, "row": weights["a.weight"][1], "cpu": torch.ones(2), "n": 3}
    host = to_host(state, copy=copy, pin=True)
    copied = host["model"]
    assert type(copied) is OrderedDict and copied._metadata == weights._metadata
    assert all(not t.is_cuda for t in copied.values())
    assert _shares(copied["a.weight"], copied["b.weight"])  # one copy of the tied storage
    assert copied["a.weight"].is_pinned()
    assert _shares(host["row"], copied["a.weight"]) and host["row"].storage_offset() == 3
    assert (host["cpu"] is state["cpu"]) is not copy
    buffer = io.BytesIO()
    torch.save(host, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh = Tied()
    fresh.load_state_dict(loaded["model"])
    assert torch.equal(fresh.a.weight, model.a.weight.cpu())


def test_a_snapshot_is_pinned_up_to_its_bound_and_pageable_after():
    state = {"a": torch.ones(256, device=_cuda()), "b": torch.ones(256, device=_cuda())}
    host = to_host(state, copy=True, pin=True, pin_limit=1024 + 512)  # room for one
    assert host["a"].is_pinned() and not host["b"].is_pinned()
    assert torch.equal(host["b"].cuda(), state["b"])


class Span(tuple):
    def __new__(cls, x, y):
        return super().__new__(cls, (x, y))


def test_a_batch_that_cannot_be_rebuilt_on_the_gpu_names_the_jobs_move_batch():
    x = torch.ones(2)
    with pytest.raises(TypeError, match=r"TrainJob\.move_batch"):
        move_batch(Span(x, x), _cuda())


class Ema:
    """An EMA of the weights, allocated at its first update."""

    def __init__(self) -> None:
        self.shadow: dict[str, torch.Tensor] | None = None

    def after_step(self, model: nn.Module) -> None:
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        if self.shadow is None:
            self.shadow = {k: v.clone() for k, v in weights.items()}
        for k, v in weights.items():
            self.shadow[k].mul_(0.9).add_(v, alpha=0.1)  # fails across devices

    def state_dict(self):
        return {"shadow": self.shadow}

    def load_state_dict(self, state) -> None:
        self.shadow = state["shadow"]


def test_extra_state_loaded_from_host_memory_lands_on_the_device(tmp_path):
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                   extra_state=lambda model, optimizer: {"ema": Ema()})
    torch.cuda.set_device(_cuda())
    trained = Replica(job, _config(tmp_path / "a"), str(tmp_path / "a"), _cuda())
    trained.comm = PlaneCheck()
    assert isinstance(trained.run_step(PLAN, []), StepRecord)
    host = torch.load(io.BytesIO(trained.state_bytes()), weights_only=True, map_location="cpu")
    fresh = Replica(job, _config(tmp_path / "b"), str(tmp_path / "b"), _cuda())
    fresh.comm = PlaneCheck()
    fresh.load_state(host)  # its EMA is not allocated yet: no template, the device
    assert all(t.device == _cuda() for t in fresh.extra["ema"].shadow.values())
    assert isinstance(fresh.run_step(PLAN, []), StepRecord)  # the EMA update runs on the GPU


def test_a_real_cuda_out_of_memory_error_in_the_optimizer_leaves_the_generation(tmp_path):
    torch.cuda.set_device(_cuda())
    replica = Replica(TrainJob(model=make_model, optimizer=make_optimizer, loss=mse,
                               dataset=make_dataset), _config(tmp_path), str(tmp_path), _cuda())
    replica.comm = comm = PlaneCheck()
    assert isinstance(replica.run_step(PLAN, []), StepRecord)
    total = torch.cuda.get_device_properties(_cuda()).total_memory

    def step(*args, **kwargs):
        torch.empty(2 * total, dtype=torch.uint8, device=_cuda())

    replica.optimizer.step = step
    with pytest.raises(CollectiveError, match="apply phase") as raised:
        replica.run_step(PLAN, [])
    assert is_out_of_memory(raised.value) and comm.aborted
    assert replica.global_step == 1
    assert all(p.grad is None for p in replica.model.parameters())


def _shared_region(size: int):
    """A /dev/shm mapping as the shared-memory transport maps one, and a lender over it (at
    the region's start, 64-byte aligned, as `Communicator.shared_buffers` lends)."""
    import mmap
    import os
    import tempfile

    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, size)
        region = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)
    whole = torch.frombuffer(region, dtype=torch.uint8)

    def lend(sizes):
        return {torch.float32: whole[64 : 64 + 4 * sizes[torch.float32]].view(torch.float32)}

    return lend


def test_a_shared_memory_region_is_page_locked_for_copies_from_the_gpu_and_unlocked_on_release():
    from elastic.trainer.staging import CudaStreams, HostStaging

    lend, n = _shared_region(8 << 20), 1 << 20
    staging = HostStaging(CudaStreams())
    lent = staging.buffers({torch.float32: n}, lend)[torch.float32]
    assert staging.registered and lent.is_pinned()
    source = torch.arange(n, dtype=torch.float32, device=_cuda())
    staging.streams.copy(lent, source)
    staging.streams.synchronize()
    assert torch.equal(lent, source.cpu())
    lent.mul_(2)
    back = staging.streams.to_device(lent, _cuda())
    assert torch.equal(back, source * 2)
    staging.release()
    assert not staging.registered and not lent.is_pinned()


def test_a_region_cuda_refuses_to_page_lock_leaves_no_error_behind_for_the_next_kernel():
    # The same pages registered twice: CUDA refuses the second (already registered), and the
    # error that call left as the thread's last error must not surface in the next kernel.
    from elastic.trainer.staging import CudaStreams, HostStaging

    lend = _shared_region(1 << 20)
    first, second = HostStaging(CudaStreams()), HostStaging(CudaStreams())
    first.buffers({torch.float32: 1000}, lend)
    lent = second.buffers({torch.float32: 1000}, lend)[torch.float32]
    assert first.registered and not second.registered
    x = torch.full((4,), 2.0, device=_cuda()) * 3  # raised the stale error before the fix
    assert x.sum().item() == 24
    staging_copy = torch.arange(1000, dtype=torch.float32, device=_cuda())
    second.streams.copy(lent, staging_copy)  # into memory page-locked by `first`: works
    second.streams.synchronize()
    assert torch.equal(lent, staging_copy.cpu())
    first.release()
    second.release()


def test_loader_batches_are_pinned_ahead_on_a_thread_bound_to_the_workers_gpu():
    """`data.pin_memory`: the pinning thread binds the worker's GPU before it pins (as
    DataLoader's pin-memory thread does), and `take` hands out pinned batches
    equal to the ones read in the worker."""
    import threading

    from torch.utils.data import default_collate

    from elastic.trainer import loader as loader_module
    from elastic.trainer.loader import Piece, Prefetcher, load_piece
    from tests.jobs import regression_job

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    job = regression_job()
    bound, pin = [], loader_module.pin_batch

    def recording_pin(batch):
        bound.append(torch.cuda.current_device())
        return pin(batch)

    loader_module.pin_batch = recording_pin
    loader = Prefetcher(job, 1, "spawn", torch.get_rng_state(), pin_memory=True, device=device)
    try:
        pieces = [Piece(0, 1, (3, 1, 4)), Piece(1, 2, (5, 9))]
        loader.want(pieces)
        for piece in pieces:
            batch, _ = loader.take(piece)
            expected = load_piece(job.dataset(), default_collate, piece.indices, piece.seed)
            assert all(t.is_pinned() and torch.equal(t, e) for t, e in zip(batch, expected,
                                                                            strict=True))
        [thread] = [t for t in threading.enumerate() if t.name.startswith("elastic-pin")]
        assert thread.is_alive() and bound == [device.index] * len(pieces)
    finally:
        loader.close()
        loader_module.pin_batch = pin
