"""The NCCL transport on real GPUs (cupy's NCCL): what tests/unit/test_nccl_backend.py checks
against the simulator, on CUDA tensors.

Ranks are threads of the test process, one GPU each. NCCL refuses two ranks of one
communicator on the same GPU, so the multi-rank tests need two GPUs and skip with one; with
one GPU, the tests of a single rank exchange with themselves (a send to oneself and the
matching receive in one group are legal NCCL) and run the native collectives at world size 1
through the transport directly (`Communicator` returns before any NCCL call at world size 1).
Bad input is a ValueError that leaves the communicator usable; the warm-up that connects every
peer, the private communication stream and the abort on a helper thread are checked too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.collective import Communicator, RendezvousServer
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveAbortedError, CollectiveError, CollectiveTimeoutError

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if torch.cuda.is_available():  # without CUDA the whole tier is skipped as such (conftest)
    pytest.importorskip("cupy", reason="backend 'nccl' needs CuPy: pip install 'elastic[gpu]' "
                        "(CUDA 12) or 'elastic[gpu-cu13]' (CUDA 13)")

ALGORITHMS = ["ring", "tree", "halving_doubling", "native"]


def _devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two_gpus = pytest.mark.skipif(
    _devices() < 2,
    reason="NCCL needs one GPU per rank (two ranks of one communicator on one GPU are refused "
    "as a duplicate GPU); this host has fewer than two",
)

_generations = iter(range(10**6))


def _config(**kwargs: Any) -> CollectiveConfig:
    kwargs.setdefault("timeout", timedelta(seconds=60))
    return CollectiveConfig(backend="nccl", **kwargs)


def _run(world: int, fn: Callable[[Communicator], Any], config: CollectiveConfig | None = None,
         timeout: float = 120.0) -> list[Any]:
    """Calls `fn(comm)` on every rank, rank r a thread on GPU r (set before the communicator is
    built: its builder thread takes the caller's device); re-raises the first rank's error."""
    server = RendezvousServer()
    generation = next(_generations)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    done = threading.Barrier(world)  # closing aborts NCCL: once every rank is done with it

    def target(rank: int) -> None:
        try:
            torch.cuda.set_device(rank)
            try:
                comm = Communicator(rank, world, server.endpoint, generation,
                                    config or _config(), secret=server.secret)
            except BaseException:
                done.abort()
                raise
            try:
                results[rank] = fn(comm)
                torch.cuda.synchronize()
            except BaseException:
                done.abort()  # a failed rank closes at once: its peers are not kept waiting
                raise
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    done.wait(timeout)
                assert comm.close(timeout=60), f"rank {rank}: the NCCL release did not end"
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
            assert not t.is_alive(), f"a rank did not finish within {timeout}s: {errors}"
    finally:
        server.close()
    for e in errors:
        if e is not None:
            raise e
    return results


def _world() -> int:
    return min(_devices(), 4)


# --- several GPUs ----------------------------------------------------------------------------


def _inputs(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + length)
    return torch.randint(-50, 50, (length,), generator=g).to(dtype)


@needs_two_gpus
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_is_exact_across_gpus(algorithm):
    world = _world()
    cases = [(n, dtype, op) for n in [1, world - 1, 1001, 1 << 16] for dtype, op in
             [(torch.float32, "sum"), (torch.int64, "sum"), (torch.float64, "max"),
              (torch.float32, "avg")]]

    def body(comm: Communicator) -> list[torch.Tensor]:
        assert comm.transport == "nccl"
        out = []
        for n, dtype, op in cases:
            t = _inputs(comm.rank, n, dtype).cuda()
            comm.allreduce(t, op, algorithm)
            out.append(t.cpu())
        return out

    results = _run(world, body, _config(segment_bytes=4096))
    for i, (n, dtype, op) in enumerate(cases):
        stacked = torch.stack([_inputs(r, n, dtype).to(torch.float64) for r in range(world)])
        expected = {"sum": stacked.sum(0), "max": stacked.max(0).values,
                    "avg": stacked.sum(0).to(dtype) / world}[op].to(dtype)
        for r in range(world):
            assert torch.equal(results[r][i], expected), (n, dtype, op, r)


@needs_two_gpus
def test_reduce_scatter_allgather_broadcast_send_recv_and_barrier_across_gpus():
    world = _world()

    def body(comm: Communicator) -> dict:
        r, n = comm.rank, comm.world_size
        out = {
            "reduce_scatter": comm.reduce_scatter(
                torch.arange(2 * n + 1, dtype=torch.float32, device="cuda") * (r + 1)).cpu(),
            "allgather": comm.allgather(torch.full((3,), r, dtype=torch.int32, device="cuda")).cpu(),
            "broadcast": comm.broadcast(torch.full((5,), float(r), device="cuda"), src=n - 1).cpu(),
        }
        if r == 0:
            comm.send(torch.arange(6, dtype=torch.float64, device="cuda"), dst=n - 1)
        if r == n - 1:
            out["recv"] = comm.recv(torch.zeros(6, dtype=torch.float64, device="cuda"), src=0).cpu()
        comm.barrier()
        return out

    results = _run(world, body)
    total = torch.arange(2 * world + 1, dtype=torch.float32) * sum(range(1, world + 1))
    for r, out in enumerate(results):
        assert torch.equal(out["reduce_scatter"], total.tensor_split(world)[r])
        assert torch.equal(out["allgather"], torch.arange(world, dtype=torch.int32)[:, None].expand(world, 3))
        assert torch.equal(out["broadcast"], torch.full((5,), float(world - 1)))
    assert torch.equal(results[-1]["recv"], torch.arange(6, dtype=torch.float64))


@needs_two_gpus
@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_a_late_producer_stream_is_waited_for(algorithm):
    """The tensor is written by a kernel queued behind a long sleep on the caller's stream:
    right only if the communication stream waits for it."""

    def body(comm: Communicator) -> torch.Tensor:
        t = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(int(2e8))  # a few tenths of a second of GPU time
        t.fill_(comm.rank + 1)
        comm.allreduce(t, "sum", algorithm)
        return t.cpu()  # on the caller's stream: after the allreduce

    world = _world()
    results = _run(world, body)
    expected = world * (world + 1) / 2
    assert all(torch.all(t == expected) for t in results)


@needs_two_gpus
def test_a_host_tensor_is_refused_before_any_nccl_call():
    """A ValueError on every rank alike: the communicator is not failed, the next allreduce
    works."""

    def body(comm: Communicator) -> tuple[str, torch.Tensor]:
        with pytest.raises(ValueError, match="CUDA tensors only") as raised:
            comm.allreduce(torch.ones(4), "sum", "native")
        with pytest.raises(ValueError, match="complex64"):
            comm.allreduce(torch.ones(4, dtype=torch.complex64, device="cuda"), "sum", "native")
        t = comm.allreduce(torch.ones(4, device="cuda"), "sum", "native")
        return str(raised.value), t.cpu()

    for message, t in _run(2, body):
        assert "cpu" in message
        assert torch.equal(t, torch.full((4,), 2.0))


@needs_two_gpus
def test_every_peer_is_connected_before_the_communicator_is_returned():
    """The warm-up ran and its stream finished while the communicator was built; NCCL was
    asked to connect its collectives then too."""

    def body(comm: Communicator) -> bool:
        transport = comm._transport
        return transport._last is not None and bool(transport._last.event.query())

    assert _run(_world(), body) == [True] * _world()
    assert os.environ.get("NCCL_RUNTIME_CONNECT") is not None


@needs_two_gpus
def test_abort_wakes_a_waiting_rank_and_close_then_ends():
    woken = threading.Event()

    def body(comm: Communicator) -> type:
        if comm.rank == 0:
            threading.Timer(0.5, comm.abort).start()
            try:
                with pytest.raises(CollectiveAbortedError) as raised:
                    comm.recv(torch.zeros(4, device="cuda"), src=1)  # rank 1 never sends
            finally:
                woken.set()
            return type(raised.value)
        assert woken.wait(60)  # rank 0 was woken by its abort: now this one leaves too
        comm.abort()  # as the controller aborts every survivor
        return CollectiveAbortedError

    assert _run(2, body) == [CollectiveAbortedError] * 2


@needs_two_gpus
def test_a_timeout_aborts_nccl_so_that_close_ends():
    timed_out = threading.Event()

    def body(comm: Communicator) -> None:
        if comm.rank == 0:
            try:
                with pytest.raises(CollectiveTimeoutError):
                    comm.recv(torch.zeros(4, device="cuda"), src=1)
            finally:
                timed_out.set()
        else:
            assert timed_out.wait(60)  # rank 1 stays until rank 0's wait has timed out
            comm.abort()

    _run(2, body, _config(timeout=timedelta(seconds=1)))


# --- one GPU: a single rank through the transport ---------------------------------------------


def _solo():
    from elastic.collective.nccl import NcclTransport

    torch.cuda.set_device(0)
    return NcclTransport(0, 1, dist.HashStore(), timedelta(seconds=30))


def _finish(pending) -> None:
    deadline = time.monotonic() + 30
    for p in pending:
        while not p.is_done():
            assert time.monotonic() < deadline, "an NCCL operation did not finish"
            p.wait(0.1)
        p.check()


def test_a_send_to_oneself_and_its_receive_posted_apart_run_as_one_group():
    """Posted as two calls, issued as one group when first waited on; as two groups (receive
    first) NCCL would wait forever."""
    transport = _solo()
    try:
        a = torch.arange(1001, dtype=torch.float32, device="cuda")
        b = torch.zeros_like(a)
        pending = transport.exchange([], [(b, 0)], 0) + transport.exchange([(a, 0)], [], 0)
        _finish(pending)
        assert torch.equal(b, a)
    finally:
        transport.close()


def test_a_late_producer_stream_is_waited_for_on_one_gpu():
    transport = _solo()
    try:
        a = torch.zeros(1 << 20, device="cuda")
        b = torch.zeros_like(a)
        torch.cuda._sleep(int(2e8))
        a.fill_(7.0)
        _finish(transport.exchange([(a, 0)], [(b, 0)], 0))
        assert bool(torch.all(b == 7.0))  # read on the caller's stream, after the group
        t = torch.full((33,), 3.0, device="cuda")
        _finish(transport.allreduce(t, "sum"))
        _finish(transport.broadcast(t, 0))
        assert bool(torch.all(t == 3.0))
    finally:
        transport.close()


def test_tensors_off_the_transports_device_are_refused_on_one_gpu():
    transport = _solo()
    try:
        with pytest.raises(ValueError, match="CUDA tensors only"):
            transport.allreduce(torch.ones(4), "sum")
        with pytest.raises(ValueError, match="contiguous"):
            transport.exchange([(torch.ones(4, 4, device="cuda").t(), 0)], [], 0)
        with pytest.raises(ValueError, match="bool"):
            transport.allreduce(torch.ones(4, dtype=torch.bool, device="cuda"), "sum")
        if _devices() > 1:
            with pytest.raises(ValueError, match="cuda:1"):
                transport.exchange([(torch.ones(4, device="cuda:1"), 0)], [], 0)
        _finish(transport.allreduce(torch.ones(4, device="cuda"), "sum"))  # still usable
    finally:
        transport.close()


def test_the_communication_stream_is_private_and_outlives_its_transport():
    """Not one of torch's pooled streams (`torch.cuda.Stream()` hands those out round-robin);
    a later transport takes the released one's stream once it is idle."""
    transport = _solo()
    stream = transport._stream
    transport.close()
    pooled = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    assert stream.cuda_stream not in pooled
    assert stream.query()
    again = _solo()
    try:
        assert again._stream is stream
        _finish(again.allreduce(torch.ones(8, device="cuda"), "sum"))
    finally:
        again.close()


def test_abort_then_close_on_one_gpu():
    """An abort while a group is queued behind a long kernel: the waiter is released at once,
    the check says aborted, and close (which must not destroy now) ends."""
    transport = _solo()
    a = torch.ones(4, device="cuda")
    b = torch.zeros(4, device="cuda")
    torch.cuda._sleep(int(3e9))  # seconds of GPU time before the group may run
    pending = transport.exchange([(a, 0)], [(b, 0)], 0)
    assert not pending[0].wait(0.3)
    started = time.monotonic()
    transport.abort()  # ncclCommAbort runs on a helper thread
    assert time.monotonic() - started < 0.1
    assert pending[0].wait(1.0)
    with pytest.raises(CollectiveError, match="aborted"):
        pending[0].check()
    done = threading.Event()
    threading.Thread(target=lambda: (transport.close(), done.set()), daemon=True).start()
    assert done.wait(30), "close after abort did not end"
    torch.cuda.synchronize()
