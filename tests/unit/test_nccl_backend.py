"""What of the NCCL backend can be checked without a GPU; the rest runs under the gpu mark."""

import threading

import pytest
import torch

from elastic.collective import Communicator, RendezvousServer
from elastic.collective import nccl as nccl_backend
from elastic.config import CollectiveConfig
from elastic.errors import BackendUnavailableError


def test_unique_id_round_trips_through_the_store_encoding():
    uid = tuple(range(-64, 64))
    assert nccl_backend.decode_unique_id(nccl_backend.encode_unique_id(uid)) == uid


def test_every_mapped_dtype_has_a_distinct_nccl_name():
    names = list(nccl_backend.NCCL_DTYPES.values())
    assert len(set(names)) == len(names)
    assert torch.float32 in nccl_backend.NCCL_DTYPES
    assert torch.bfloat16 in nccl_backend.NCCL_DTYPES


class _Event:
    def __init__(self, done_after: int) -> None:
        self.polls, self.done_after = 0, done_after

    def query(self) -> bool:
        self.polls += 1
        return self.polls > self.done_after


class _Comm:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def check_async_error(self) -> None:
        if self.error is not None:
            raise self.error


def test_a_pending_nccl_operation_can_be_waited_on_and_times_out():
    """`Communicator.wait` calls `wait` whenever an operation is not done at the first poll."""
    pending = nccl_backend._CudaPending(_Event(done_after=3), _Comm())
    assert pending.wait(5.0) is True
    pending.check()
    never = nccl_backend._CudaPending(_Event(done_after=10**9), _Comm())
    assert never.wait(0.01) is False


@pytest.mark.parametrize(("code", "name"), [(6, "ncclRemoteError"), (7, "ncclInProgress")])
def test_result_codes_cupy_cannot_name_become_a_collective_error_naming_them(code, name):
    from elastic.errors import CollectiveError

    pending = nccl_backend._CudaPending(_Event(done_after=10**9), _Comm(KeyError(code)))
    assert pending.wait(1.0) is True  # an async error ends the wait
    with pytest.raises(CollectiveError, match=f"NCCL result {code} \\({name}\\)"):
        pending.check()


def test_nccl_dtype_refuses_a_type_nccl_lacks():
    class FakeNccl:
        NCCL_FLOAT32 = 7

    assert nccl_backend.nccl_dtype(FakeNccl, torch.float32) == 7
    with pytest.raises(ValueError, match="complex64"):
        nccl_backend.nccl_dtype(FakeNccl, torch.complex64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_nccl_without_cuda_fails_with_a_message_naming_the_fix():
    server = RendezvousServer()
    try:
        with pytest.raises(BackendUnavailableError, match="backend='gloo'"):
            Communicator(0, 1, server.endpoint, 0, CollectiveConfig(backend="nccl"),
                         secret=server.secret)
    finally:
        server.close()


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling", "native"])
def test_nccl_allreduce_on_one_gpu_per_thread(algorithm):
    devices = torch.cuda.device_count()
    world = min(devices, 4) if devices > 1 else 1
    server = RendezvousServer()
    results = {}

    def rank(r):
        torch.cuda.set_device(r % devices)
        comm = Communicator(r, world, server.endpoint, 0, CollectiveConfig(backend="nccl"),
                            secret=server.secret)
        t = torch.full((1 << 16,), float(r + 1), device="cuda")
        comm.allreduce(t, "sum", algorithm)
        torch.cuda.synchronize()
        results[r] = t.cpu()
        comm.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    server.close()
    expected = world * (world + 1) / 2
    for r in range(world):
        assert torch.all(results[r] == expected)
