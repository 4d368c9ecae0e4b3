"""The NCCL transport on CPU, against the simulator of NCCL's execution model
(`CollectiveConfig.nccl_simulator`): every algorithm through `Communicator` with ranks as
threads, the warm-up that connects every peer while the communicator is built, the grouping
that keeps a ring step from deadlocking (and the deadlock without it), the stream waits, the
guard (bad input is a ValueError that leaves the communicator usable), abort on a helper
thread, failure on an NCCL error, and peers that die. The GPU-only pieces (loading cupy's
NCCL, the private CUDA stream) run here against fakes; real NCCL runs in
tests/gpu/test_nccl_gpu.py."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.collective import Communicator, RendezvousServer
from elastic.collective import nccl as nccl_backend
from elastic.collective import nccl_sim as sim
from elastic.config import CollectiveConfig
from elastic.errors import (
    BackendUnavailableError,
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    RendezvousError,
)
from tests.procs import warm_context
from tests.threads import run_ranks

pytestmark = pytest.mark.timeout(120)

ALGORITHMS = ["ring", "tree", "halving_doubling", "native"]


def _config(**kwargs) -> CollectiveConfig:
    kwargs.setdefault("timeout", timedelta(seconds=30))
    return CollectiveConfig(backend="nccl", nccl_simulator=True, **kwargs)


@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


# --- pieces that need no communicator --------------------------------------------------------


def test_unique_id_round_trips_through_the_store_encoding():
    uid = tuple(range(-64, 64))
    assert nccl_backend.decode_unique_id(nccl_backend.encode_unique_id(uid)) == uid
    simulated = sim.get_unique_id()
    assert len(simulated) == 128 and all(-128 <= x <= 127 for x in simulated)
    assert nccl_backend.decode_unique_id(nccl_backend.encode_unique_id(simulated)) == simulated


def test_every_mapped_dtype_has_a_distinct_nccl_name_the_simulator_knows():
    names = list(nccl_backend.NCCL_DTYPES.values())
    assert len(set(names)) == len(names)
    assert torch.float32 in nccl_backend.NCCL_DTYPES
    assert torch.bfloat16 in nccl_backend.NCCL_DTYPES
    for dtype in nccl_backend.NCCL_DTYPES:
        assert sim._DTYPES[nccl_backend.nccl_dtype(sim, dtype)] == dtype


def test_nccl_dtype_refuses_a_type_nccl_lacks():
    class FakeNccl:
        NCCL_FLOAT32 = 7

    assert nccl_backend.nccl_dtype(FakeNccl, torch.float32) == 7
    with pytest.raises(ValueError, match="complex64"):
        nccl_backend.nccl_dtype(FakeNccl, torch.complex64)


@pytest.mark.parametrize(("error", "text"), [
    (KeyError(6), "NCCL result 6 (ncclRemoteError)"),
    (KeyError(7), "NCCL result 7 (ncclInProgress)"),
    (KeyError(42), "NCCL result 42 (unknown to this version)"),
])
def test_result_codes_cupy_cannot_name_are_described_by_number(error, text):
    assert nccl_backend.describe_nccl_error(error) == text


def test_load_nccl_gives_the_simulator_when_simulated():
    assert nccl_backend.load_nccl(simulated=True) is sim


def _fake_cupy_nccl(monkeypatch, **attributes) -> types.ModuleType:
    """Installs a stand-in for `cupy.cuda.nccl` and makes CUDA look available."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    for name, value in attributes.items():
        setattr(nccl, name, value)
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return nccl


def test_load_nccl_refuses_cupy_without_the_nccl_library(monkeypatch):
    """cupy imports without libnccl and says so with `available = False` (its other names,
    get_unique_id among them, are missing then)."""
    _fake_cupy_nccl(monkeypatch, available=False)
    with pytest.raises(BackendUnavailableError, match="could not load the NCCL library"):
        nccl_backend.load_nccl()


def test_load_nccl_refuses_nccl_older_than_2_7(monkeypatch):
    _fake_cupy_nccl(monkeypatch, available=True, get_version=lambda: 2604)
    with pytest.raises(BackendUnavailableError, match=r"NCCL 2\.7 or newer.*2604"):
        nccl_backend.load_nccl()


def test_load_nccl_refuses_an_nccl_that_cannot_tell_its_version(monkeypatch):
    _fake_cupy_nccl(monkeypatch)  # neither `available` nor `get_version`
    with pytest.raises(BackendUnavailableError, match="cannot tell the NCCL version"):
        nccl_backend.load_nccl()


@pytest.mark.parametrize("version", [2708, 21805, 22304])
def test_load_nccl_takes_a_usable_nccl(monkeypatch, version):
    nccl = _fake_cupy_nccl(monkeypatch, available=True, get_version=lambda: version)
    assert nccl_backend.load_nccl() is nccl


def test_a_cuda_transport_sets_nccl_runtime_connect_unless_the_environment_does(monkeypatch):
    """The real-runtime path (here on the simulator's runtime) asks NCCL to connect its
    collectives when the communicator is created; the simulated path leaves the variable
    alone, and a value the user set stays."""
    monkeypatch.setattr(nccl_backend, "load_nccl", lambda simulated=False: sim)
    monkeypatch.setattr(nccl_backend, "_CudaRuntime", lambda: nccl_backend._SimRuntime(sim))
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    _solo_transport().close()
    assert "NCCL_RUNTIME_CONNECT" not in os.environ
    nccl_backend.NcclTransport(0, 1, dist.HashStore(), timedelta(seconds=10)).close()
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "0"
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    nccl_backend.NcclTransport(0, 1, dist.HashStore(), timedelta(seconds=10)).close()
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "1"


def test_the_cuda_runtime_makes_private_streams_and_reuses_only_idle_ones(monkeypatch):
    """Against fakes of cupy and torch.cuda.ExternalStream: each stream is a non-blocking cupy
    stream made on the transport's device and wrapped for torch; none is ever dropped; a
    retired stream is taken again only once idle, and only on its device."""
    made: list[object] = []
    devices: list[int] = []

    class CupyStream:
        def __init__(self, non_blocking: bool = False) -> None:
            assert non_blocking
            self.ptr = 0x1000 + len(made)
            made.append(self)

    @contextlib.contextmanager
    def device(index: int):
        devices.append(index)
        yield

    class ExternalStream:
        def __init__(self, ptr: int, device: torch.device | None = None) -> None:
            self.ptr, self.device, self.idle = ptr, device, True

        def query(self) -> bool:
            return self.idle

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Stream=CupyStream, Device=device)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "ExternalStream", ExternalStream)
    monkeypatch.setattr(nccl_backend, "_ALL_STREAMS", [])
    monkeypatch.setattr(nccl_backend, "_IDLE_STREAMS", {})

    def runtime(index: int) -> nccl_backend._CudaRuntime:
        rt = object.__new__(nccl_backend._CudaRuntime)
        rt.device = torch.device("cuda", index)
        return rt

    rt, other = runtime(1), runtime(0)
    a = rt.new_stream()
    assert (a.ptr, a.device, devices) == (made[0].ptr, torch.device("cuda", 1), [1])  # type: ignore[attr-defined]
    b = rt.new_stream()
    assert b is not a
    a.idle = False
    rt.retire_stream(a)
    c = rt.new_stream()
    assert c is not a  # still busy: not taken
    a.idle = True
    assert rt.new_stream() is a
    rt.retire_stream(b)
    assert other.new_stream() is not b  # another device
    assert rt.new_stream() is b
    assert len(made) == 4 and [raw for raw, _ in nccl_backend._ALL_STREAMS] == made


def test_the_cuda_runtimes_wait_is_cut_short_by_the_wake():
    """A wait of an hour returns once the wake is set (the join is only a hang guard)."""
    rt = object.__new__(nccl_backend._CudaRuntime)
    wake = threading.Event()
    waiter = threading.Thread(target=rt.wait_event, args=(object(), 3600.0, wake), daemon=True)
    waiter.start()
    wake.set()
    waiter.join(30)
    assert not waiter.is_alive()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_nccl_without_cuda_fails_with_a_message_naming_the_fix():
    server = RendezvousServer()  # its own: generation 0 of the module's server is run_ranks'
    try:
        with pytest.raises(BackendUnavailableError, match="backend='gloo'"):
            Communicator(0, 1, server.endpoint, 0, CollectiveConfig(backend="nccl"),
                         secret=server.secret)
    finally:
        server.close()


# --- every collective, every algorithm ------------------------------------------------------


def _inputs(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers, so that float sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + length)
    return torch.randint(-50, 50, (length,), generator=g).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_is_exact_at_every_world_size(server, algorithm, world):
    lengths = [0, 1, world - 1, 1001, 4099]
    cases = [(n, dtype, op) for n in lengths for dtype, op in
             [(torch.float32, "sum"), (torch.int64, "sum"), (torch.float64, "max"),
              (torch.float32, "avg")]]

    def body(comm: Communicator) -> list[torch.Tensor]:
        assert comm.transport == "nccl"
        out = []
        for n, dtype, op in cases:
            t = _inputs(comm.rank, n, dtype)
            assert comm.allreduce(t, op, algorithm) is t
            out.append(t)
        return out

    # Small segments so that the ring posts many transfers per step (one group per step).
    results = run_ranks(server, world, body, _config(segment_bytes=1024), timeout=60)
    for i, (n, dtype, op) in enumerate(cases):
        stacked = torch.stack([_inputs(r, n, dtype).to(torch.float64) for r in range(world)])
        expected = {"sum": stacked.sum(0), "max": stacked.max(0).values,
                    "avg": stacked.sum(0).to(dtype) / world}[op].to(dtype)
        for r in range(world):
            assert torch.equal(results[r][i], expected), (n, dtype, op, r)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_reduce_scatter_allgather_broadcast_send_recv_and_barrier(server, world):
    def body(comm: Communicator) -> dict:
        r, n = comm.rank, comm.world_size
        out: dict = {}
        out["reduce_scatter"] = comm.reduce_scatter(torch.arange(2 * n + 1, dtype=torch.float32) * (r + 1))
        out["allgather"] = comm.allgather(torch.full((3,), r, dtype=torch.int32))
        out["broadcast"] = comm.broadcast(torch.full((5,), float(r)), src=n - 1)
        out["broadcast_empty"] = comm.broadcast(torch.empty(0), src=0)
        if r == 0:
            comm.send(torch.arange(6, dtype=torch.float64), dst=n - 1, tag=3)
        if r == n - 1:
            out["recv"] = comm.recv(torch.zeros(6, dtype=torch.float64), src=0, tag=3)
        comm.barrier()
        return out

    results = run_ranks(server, world, body, _config())
    total = torch.arange(2 * world + 1, dtype=torch.float32) * sum(range(1, world + 1))
    for r, out in enumerate(results):
        assert torch.equal(out["reduce_scatter"], total.tensor_split(world)[r])
        assert torch.equal(out["allgather"], torch.arange(world, dtype=torch.int32)[:, None].expand(world, 3))
        assert torch.equal(out["broadcast"], torch.full((5,), float(world - 1)))
    assert torch.equal(results[-1]["recv"], torch.arange(6, dtype=torch.float64))


def test_non_contiguous_tensors_are_reduced_through_a_contiguous_copy(server):
    def body(comm: Communicator) -> torch.Tensor:
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (comm.rank + 1)
        return comm.allreduce(t, "sum", "ring")

    results = run_ranks(server, 2, body, _config())
    assert torch.equal(results[0], torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * 3)


# --- connecting eagerly ----------------------------------------------------------------------


class _PeerSpy(sim.NcclCommunicator):
    """Records (rank, call, peer, count) for every send, receive and allreduce."""

    log: list[tuple] = []

    def send(self, buf, count, datatype, peer, stream):
        _PeerSpy.log.append((self._rank, "send", peer, count))
        super().send(buf, count, datatype, peer, stream)

    def recv(self, buf, count, datatype, peer, stream):
        _PeerSpy.log.append((self._rank, "recv", peer, count))
        super().recv(buf, count, datatype, peer, stream)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        _PeerSpy.log.append((self._rank, "allReduce", count))
        super().allReduce(sendbuf, recvbuf, count, datatype, op, stream)


@pytest.mark.parametrize("world", [1, 3])
def test_every_peer_is_connected_while_the_communicator_is_built(server, monkeypatch, world):
    """Before the communicator is handed out, each rank ran one group of a 1-byte send and
    receive with every peer and a 1-element allreduce, and its stream finished them."""
    _PeerSpy.log = []
    monkeypatch.setattr(sim, "NcclCommunicator", _PeerSpy)

    def body(comm: Communicator) -> tuple:
        transport = comm._transport
        seen = [entry for entry in _PeerSpy.log if entry[0] == comm.rank]
        return seen, bool(transport._last.event.query()), transport._comm.busy

    results = run_ranks(server, world, body, _config())
    for rank, (seen, finished, busy) in enumerate(results):
        peers = [p for p in range(world) if p != rank]
        expected = [e for p in peers for e in ((rank, "send", p, 1), (rank, "recv", p, 1))]
        assert seen == [*expected, (rank, "allReduce", 1)]
        assert finished and not busy


def test_a_peer_that_never_reaches_the_warm_up_fails_the_construction_in_time(spy, monkeypatch):
    """Rank 1 is held before the warm-up until rank 0 has aborted NCCL: rank 0 cannot have
    finished by meeting it, so it gave up at its timeout. Rank 1, let go once its communicator
    saw rank 0 leave, finds its peer gone. Both raise RendezvousError."""
    real = nccl_backend.NcclTransport._connect_eagerly
    real_abort = _Spy.abort
    rank_zero_aborted = threading.Event()

    def abort(self):
        real_abort(self)
        if self._rank == 0:
            rank_zero_aborted.set()

    def late(self, deadline, timeout):
        if self.rank == 1:
            assert rank_zero_aborted.wait(30), "rank 0 never aborted NCCL"
            assert sim.wait_error(self._comm, 30), "rank 1 never saw rank 0 leave"
        real(self, deadline, timeout)

    monkeypatch.setattr(_Spy, "abort", abort)
    monkeypatch.setattr(nccl_backend.NcclTransport, "_connect_eagerly", late)
    store = dist.HashStore()
    outcome: dict[int, BaseException | None] = {}

    def build(rank: int) -> None:
        try:
            nccl_backend.NcclTransport(rank, 2, store, timedelta(seconds=1), simulated=True)
            outcome[rank] = None
        except BaseException as e:
            outcome[rank] = e

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    error0 = outcome[0]
    assert isinstance(error0, RendezvousError) and "did not connect every peer" in str(error0)
    error1 = outcome[1]
    assert isinstance(error1, RendezvousError) and "ncclRemoteError" in str(error1)
    assert (0, "abort") in spy.calls and (0, "destroy") not in spy.calls


# --- grouping --------------------------------------------------------------------------------


class _OneGroupPerCall(nccl_backend.NcclTransport):
    """The old transport: every exchange (and so every receive of recv_reduce) is issued as a
    group of its own at once."""

    def exchange(self, sends, recvs, tag):
        pending = super().exchange(sends, recvs, tag)
        with self._lock:
            if self._open is not None:
                self._issue(self._open)
        return pending


@pytest.mark.parametrize("world", [2, 3])
def test_one_group_per_call_deadlocks_the_ring_against_the_simulator(server, monkeypatch, world):
    """Each rank posts a ring step's receive before its send; issued as two groups on one
    stream, the receive waits for a send that is queued behind it on the peer."""
    monkeypatch.setattr(nccl_backend, "NcclTransport", _OneGroupPerCall)
    failures: list[BaseException] = []

    def body(comm: Communicator) -> None:
        try:
            comm.allreduce(torch.ones(100), "sum", "ring")
        except CollectiveError as e:
            failures.append(e)

    run_ranks(server, world, body, _config(timeout=timedelta(seconds=1)))
    assert len(failures) == world
    assert any(isinstance(e, CollectiveTimeoutError) for e in failures)


def test_a_ring_step_is_issued_as_one_group(server, monkeypatch):
    """What the transport hands NCCL: per ring step, the step's receive and its send between
    one groupStart and groupEnd."""
    groups: dict[int, list[list[str]]] = {0: [], 1: []}
    real_start, real_end = sim.groupStart, sim.groupEnd
    local = threading.local()

    class Recording(sim.NcclCommunicator):
        def send(self, *args):
            local.ops.append((self._rank, "send"))
            super().send(*args)

        def recv(self, *args):
            local.ops.append((self._rank, "recv"))
            super().recv(*args)

    def group_start():
        local.ops = []
        real_start()

    def group_end():
        real_end()
        if local.ops:
            groups[local.ops[0][0]].append(sorted(kind for _, kind in local.ops))

    monkeypatch.setattr(sim, "NcclCommunicator", Recording)
    monkeypatch.setattr(sim, "groupStart", group_start)
    monkeypatch.setattr(sim, "groupEnd", group_end)
    results = run_ranks(server, 2, lambda c: c.allreduce(torch.ones(10) * (c.rank + 1), "sum", "ring"),
                        _config())
    assert all(torch.equal(t, torch.full((10,), 3.0)) for t in results)
    # The warm-up's group (a byte each way), then one reduce-scatter step and one allgather
    # step, each one group of a receive and a send.
    for rank in (0, 1):
        assert groups[rank] == [["recv", "send"], ["recv", "send"], ["recv", "send"]]


# --- streams ---------------------------------------------------------------------------------


@pytest.fixture
def producer_gates(monkeypatch):
    """Gates of late producer kernels, by the stream they are queued on: a gate opens when an
    event is recorded on its stream, which is how another stream is made to wait for it
    (`Stream.wait_stream` records one); until then the kernel cannot finish. All open at
    teardown."""
    gates: dict[sim.Stream, threading.Event] = {}
    real_record = sim.Event.record

    def record(self, stream=None):
        real_record(self, stream)
        gate = gates.get(stream if stream is not None else sim.current_stream())
        if gate is not None:
            gate.set()

    monkeypatch.setattr(sim.Event, "record", record)
    yield gates
    for gate in list(gates.values()):
        gate.set()


def _late_producer(comm: Communicator, algorithm: str,
                   gates: dict[sim.Stream, threading.Event]) -> torch.Tensor:
    """The tensor is written by a kernel on the caller's stream that cannot finish before
    another stream is made to wait for that stream: only the communication stream's wait
    makes the result right."""
    t = torch.zeros(64)
    rank = comm.rank
    gate = gates[sim.current_stream()] = threading.Event()
    sim.launch(lambda: (gate.wait(), t.fill_(rank + 1)))
    return comm.allreduce(t, "sum", algorithm)


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_the_communication_stream_waits_for_the_producer_stream(server, producer_gates, algorithm):
    results = run_ranks(server, 2, lambda c: _late_producer(c, algorithm, producer_gates), _config())
    assert all(torch.equal(t, torch.full((64,), 3.0)) for t in results)


def test_without_the_producer_wait_the_late_kernel_is_missed(server, producer_gates, monkeypatch):
    """The control for the test above: when the communication stream does not wait, the
    allreduce reads the tensor before the producer wrote it (nothing opened its gate)."""
    monkeypatch.setattr(sim.Stream, "wait_stream", lambda self, other: None)
    results = run_ranks(server, 2, lambda c: _late_producer(c, "native", producer_gates), _config())
    assert len(producer_gates) == 2 and not any(g.is_set() for g in producer_gates.values())
    assert all(torch.equal(t, torch.zeros(64)) for t in results)


def test_the_callers_stream_is_ordered_after_the_operation(server):
    def body(comm: Communicator) -> list[float]:
        t = torch.ones(8)
        comm.allreduce(t, "sum", "native")
        seen: list[float] = []
        sim.launch(lambda: seen.append(float(t.sum())))
        sim.current_stream().synchronize()
        return seen

    assert run_ranks(server, 2, body, _config()) == [[16.0], [16.0]]


# --- the guard -------------------------------------------------------------------------------


class _Spy(sim.NcclCommunicator):
    """Records every call on the handle, per process."""

    calls: list[tuple[int, str]] = []

    def _record(self, name: str) -> None:
        _Spy.calls.append((self._rank, name))

    def send(self, *args):
        self._record("send")
        super().send(*args)

    def recv(self, *args):
        self._record("recv")
        super().recv(*args)

    def allReduce(self, *args):
        self._record("allReduce")
        super().allReduce(*args)

    def bcast(self, *args):
        self._record("bcast")
        super().bcast(*args)

    def abort(self):
        self._record("abort")
        super().abort()

    def destroy(self):
        self._record("destroy")
        super().destroy()


@pytest.fixture
def spy(monkeypatch):
    _Spy.calls = []
    monkeypatch.setattr(sim, "NcclCommunicator", _Spy)
    return _Spy


def _after_warmup(spy: type[_Spy], rank: int) -> list[str]:
    """The calls a rank made on its handle after the warm-up (its sends and receives, then
    one allReduce, while the communicator was built)."""
    names = [name for r, name in spy.calls if r == rank]
    return names[names.index("allReduce") + 1:]


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "send", "ring"])
def test_a_tensor_on_another_device_is_a_value_error_before_any_nccl_call(server, spy, call):
    """Every rank passes the same tensors and raises alike: the communicator is not failed, and
    the next collective works."""
    errors: list[BaseException] = []

    def body(comm: Communicator) -> torch.Tensor:
        wrong = torch.ones(4, device="meta")
        before = _after_warmup(spy, comm.rank)
        try:
            if call == "allreduce":
                comm.allreduce(wrong, "sum", "native")
            elif call == "broadcast":
                comm.broadcast(wrong, 0)
            elif call == "send":
                comm.send(wrong, dst=1 - comm.rank)
            else:
                comm.allreduce(wrong, "sum", "ring")
        except ValueError as e:
            errors.append(e)
        assert _after_warmup(spy, comm.rank) == before  # nothing reached NCCL
        assert not comm.aborted and comm._transport._state == "open"
        return comm.allreduce(torch.ones(4), "sum", "native")

    results = run_ranks(server, 2, body, _config())
    assert len(errors) == 2
    for e in errors:
        assert not isinstance(e, CollectiveError)
        assert "CUDA tensors only" in str(e) and "meta" in str(e)
    assert all(torch.equal(t, torch.full((4,), 2.0)) for t in results)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.uint32])
def test_a_dtype_nccl_cannot_reduce_is_a_value_error_before_any_nccl_call(server, spy, dtype):
    errors: list[BaseException] = []

    def body(comm: Communicator) -> torch.Tensor:
        before = _after_warmup(spy, comm.rank)
        try:
            comm.allreduce(torch.ones(4, dtype=dtype), "sum", "native")
        except ValueError as e:
            errors.append(e)
        assert _after_warmup(spy, comm.rank) == before
        return comm.allreduce(torch.ones(4), "sum", "native")

    results = run_ranks(server, 2, body, _config())
    assert len(errors) == 2 and all(str(dtype) in str(e) for e in errors)
    assert all(torch.equal(t, torch.full((4,), 2.0)) for t in results)


def test_bad_input_is_refused_by_the_transport_with_value_errors():
    transport = _solo_transport()
    try:
        with pytest.raises(ValueError, match="contiguous"):
            transport.exchange([(torch.ones(4, 4).t(), 0)], [], 0)
        with pytest.raises(ValueError, match="cannot reduce with op 'avg'"):
            transport.allreduce(torch.ones(4), "avg")
        with pytest.raises(ValueError, match="peer must be"):
            transport.broadcast(torch.ones(4), 1)
        assert transport._state == "open"
        pending = transport.allreduce(torch.full((3,), 2.0), "sum")
        assert pending[0].wait(10)
        pending[0].check()
    finally:
        transport.close()


# --- failure, abort, close -------------------------------------------------------------------


def test_a_timeout_aborts_nccl_and_close_then_never_destroys(server, spy):
    outcome: dict[int, BaseException | None] = {}

    def body(comm: Communicator) -> None:
        if comm.rank == 0:
            try:
                comm.recv(torch.zeros(4), src=1)  # rank 1 never sends
            except CollectiveError as e:
                outcome[0] = e
        else:  # closes only once its communicator saw rank 0's abort
            assert sim.wait_error(comm._transport._comm, 30), "rank 0 never aborted NCCL"

    run_ranks(server, 2, body, _config(timeout=timedelta(seconds=0.5)))
    assert isinstance(outcome[0], CollectiveTimeoutError)
    rank0 = _after_warmup(spy, 0)
    assert rank0 == ["recv", "abort"]  # aborted on the timeout; close did not destroy
    rank1 = _after_warmup(spy, 1)
    assert "destroy" not in rank1  # its peer aborted: a remote error, so close aborts too


def test_close_after_clean_use_aborts_and_never_destroys(server, spy):
    """ncclCommDestroy synchronises with the peers in recent NCCL and hangs when one has left:
    a close aborts, which is local."""
    run_ranks(server, 2, lambda c: c.allreduce(torch.ones(3), "sum", "native"), _config())
    for rank in (0, 1):
        assert _after_warmup(spy, rank) == ["allReduce", "abort"]


def test_a_clean_close_returns_when_a_peer_has_left_without_closing(server, spy):
    """Rank 1 leaves the generation without closing (as a rank that leaves at a resize, or a
    process that died between chunks); rank 0's close after clean use returns."""
    left = threading.Event()
    closed = threading.Event()

    def body(comm: Communicator) -> None:
        comm.allreduce(torch.ones(3), "sum", "native")
        if comm.rank == 1:
            left.set()
            assert closed.wait(60)  # gone as far as rank 0 knows: it never closes before
            return
        assert left.wait(60)
        assert comm.close(timeout=30)  # would wait for rank 1 in a collective destroy
        closed.set()

    run_ranks(server, 2, body, _config())
    assert _after_warmup(spy, 0) == ["allReduce", "abort"]


def test_abort_while_waiting_wakes_the_caller_and_aborts_nccl(server, spy, monkeypatch):
    """Rank 0 waits for a receive rank 1 never sends; once that receive was handed to NCCL,
    another thread aborts rank 0: the caller raises CollectiveAbortedError, not the timeout
    error it would raise after waiting it out. Rank 1 stays until then."""
    real_recv = _Spy.recv
    posted = threading.Event()

    def recv(self, *args):
        real_recv(self, *args)
        if self._rank == 0 and args[1] == 16:  # the test's receive, not the warm-up's byte
            posted.set()

    monkeypatch.setattr(_Spy, "recv", recv)
    errors: dict[int, BaseException] = {}
    rank_zero_done = threading.Event()

    def body(comm: Communicator) -> None:
        if comm.rank == 0:
            aborter = threading.Thread(target=lambda: posted.wait(30) and comm.abort())
            aborter.start()
            try:
                comm.recv(torch.zeros(4), src=1)
            except CollectiveError as e:
                errors[0] = e
            finally:
                rank_zero_done.set()
                aborter.join(30)
        else:
            assert rank_zero_done.wait(60)

    run_ranks(server, 2, body, _config())
    assert posted.is_set()
    assert isinstance(errors[0], CollectiveAbortedError), errors[0]
    assert (0, "abort") in spy.calls and (0, "destroy") not in spy.calls


def test_an_injected_in_progress_code_becomes_a_collective_error_naming_it(server):
    errors: list[BaseException] = []

    def body(comm: Communicator) -> None:
        if comm.rank == 0:
            comm._transport._comm.inject_error(7)
        try:
            comm.allreduce(torch.ones(4), "sum", "native")
        except CollectiveError as e:
            errors.append(e)

    run_ranks(server, 2, body, _config())
    messages = " | ".join(str(e) for e in errors)
    assert "NCCL result 7 (ncclInProgress)" in messages, messages


def test_a_rank_that_aborts_mid_allreduce_fails_the_others_without_waiting_out_the_timeout(
        server, monkeypatch):
    """Rank 2 aborts its NCCL once ranks 0 and 1 have enqueued their allreduce: they fail with
    the remote error, not with the timeout error they would raise after waiting it out."""
    enqueued = {0: threading.Event(), 1: threading.Event()}

    class Watched(sim.NcclCommunicator):
        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            super().allReduce(sendbuf, recvbuf, count, datatype, op, stream)
            if count == 1000:  # the test's allreduce, not the warm-up's
                enqueued[self._rank].set()

    monkeypatch.setattr(sim, "NcclCommunicator", Watched)
    failures: dict[int, BaseException] = {}

    def body(comm: Communicator) -> None:
        if comm.rank == 2:
            assert enqueued[0].wait(30) and enqueued[1].wait(30)
            comm._transport.abort()  # this rank's NCCL goes away as a crash would take it
            return
        try:
            comm.allreduce(torch.ones(1000), "sum", "native")
        except CollectiveError as e:
            failures[comm.rank] = e

    run_ranks(server, 3, body, _config())
    assert set(failures) == {0, 1}
    for e in failures.values():
        assert not isinstance(e, CollectiveTimeoutError)
        assert "ncclRemoteError" in str(e)


class _ExclusiveComm:
    """A stand-in for CuPy's communicator that logs every call and fails when two threads are
    inside it at once, or when anything is called after abort freed the handle. Its first
    check_async_error keeps the caller inside until `release` is set (`held` says it is)."""

    def __init__(self, progress: threading.Condition) -> None:
        self._inside = threading.Lock()
        self._progress = progress  # notified on every call
        self._hold = True
        self.held, self.release = threading.Event(), threading.Event()
        self.freed = False
        self.log: list[str] = []
        self.violations: list[str] = []

    def _note(self, entry: str, violation: bool = False) -> None:
        with self._progress:
            (self.violations if violation else self.log).append(entry)
            self._progress.notify_all()

    def _enter(self, name: str) -> None:
        self._note(name)
        if not self._inside.acquire(blocking=False):
            self._note(f"{name} entered concurrently", violation=True)
            return
        try:
            if self.freed:
                self._note(f"{name} after abort", violation=True)
            if name == "check_async_error" and self._hold:
                self._hold = False
                self.held.set()
                self.release.wait()
        finally:
            self._inside.release()

    def check_async_error(self) -> None:
        self._enter("check_async_error")

    def abort(self) -> None:
        self._enter("abort")
        self.freed = True

    def destroy(self) -> None:
        self._enter("destroy")
        self.freed = True

    def send(self, *args) -> None:
        self._enter("send")

    def recv(self, *args) -> None:
        self._enter("recv")


class _WatchedLock:
    """A stand-in for the transport's lock (a reentrant lock) that reports every thread that
    has to wait for it, before it waits."""

    def __init__(self, on_wait: Callable[[threading.Thread], None]) -> None:
        self._lock = threading.RLock()
        self._on_wait = on_wait

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self._on_wait(threading.current_thread())
        return self._lock.acquire(True, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> _WatchedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _solo_transport() -> nccl_backend.NcclTransport:
    return nccl_backend.NcclTransport(0, 1, dist.HashStore(), timedelta(seconds=10), simulated=True)


def test_abort_is_serialised_with_polling_on_the_communicator_handle():
    """A poller is held inside a call on the handle: a second poller and the helper that
    aborts NCCL wait for the transport's lock meanwhile; once the first leaves, the abort runs
    alone and nothing touches the handle after it (the second poller finds it aborted)."""
    transport = _solo_transport()
    real = transport._comm
    progress = threading.Condition()
    fake = transport._comm = _ExclusiveComm(progress)
    waiting: list[threading.Thread] = []

    def on_wait(thread: threading.Thread) -> None:
        with progress:
            waiting.append(thread)
            progress.notify_all()

    transport._lock = _WatchedLock(on_wait)  # type: ignore[assignment]
    blocker = sim.Stream()
    # The group cannot run before `gate` is set: its handle stays pending while polled.
    gate = threading.Event()
    sim.launch(gate.wait, blocker)
    with sim.stream(blocker):
        pending = transport.exchange([(torch.ones(4), 0)], [(torch.zeros(4), 0)], 0)
    answers: dict[str, bool] = {}

    def poll(name: str) -> None:
        answers[name] = pending[0].is_done()

    first = threading.Thread(target=poll, args=("first",), daemon=True)
    second = threading.Thread(target=poll, args=("second",), daemon=True)
    try:
        first.start()
        assert fake.held.wait(10)  # issued the group, then held inside check_async_error
        second.start()
        with progress:
            assert progress.wait_for(lambda: second in waiting or fake.violations, 10)
        transport.abort()
        releaser = transport._releaser
        with progress:
            assert progress.wait_for(lambda: releaser in waiting or fake.violations
                                     or "abort" in fake.log, 10)
        assert fake.log == ["send", "recv", "check_async_error"] and fake.violations == []
    finally:
        fake.release.set()
    for t in (first, second, releaser):
        t.join(10)
        assert not t.is_alive()
    assert fake.violations == []
    assert fake.log == ["send", "recv", "check_async_error", "abort"]
    assert answers == {"first": False, "second": True}  # pending, then aborted
    assert pending[0].is_done()
    with pytest.raises(CollectiveError, match="aborted"):
        pending[0].check()
    gate.set()
    transport.close()
    real.abort()
    assert fake.log == ["send", "recv", "check_async_error", "abort"]


def _joining(thread: threading.Thread) -> threading.Event:
    """An event set when some thread starts to join `thread`."""
    joining, real_join = threading.Event(), thread.join

    def join(timeout: float | None = None) -> None:
        joining.set()
        real_join(timeout)

    thread.join = join  # type: ignore[method-assign]
    return joining


def _close_in_thread(transport: nccl_backend.NcclTransport) -> tuple[threading.Thread, threading.Event]:
    """Starts `transport.close()` on a thread; returns it and an event set once close() either
    joins the releasing helper or returned."""
    progress = _joining(transport._releaser)  # type: ignore[arg-type]

    def close() -> None:
        try:
            transport.close()
        finally:
            progress.set()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    return closer, progress


def test_abort_returns_at_once_while_another_thread_is_inside_an_nccl_call():
    """A thread holds the handle's lock (as one blocked in an NCCL call would) until the test
    lets it go: abort() sets the state and wakes waiters without waiting for it, handles
    answer without the lock, the helper aborts NCCL once the lock is free, and close() waits
    for that helper. (The joins are hang guards: what they wait for needs no lock.)"""
    transport = _solo_transport()
    blocker = sim.Stream()
    gate = threading.Event()
    sim.launch(gate.wait, blocker)
    with sim.stream(blocker):
        pending = transport.allreduce(torch.ones(4), "sum")  # issued, queued behind the gate
    inside, leave = threading.Event(), threading.Event()

    def stuck() -> None:
        with transport._lock:
            inside.set()
            leave.wait()

    holder = threading.Thread(target=stuck, daemon=True)
    holder.start()
    assert inside.wait(10)
    answered: list[str] = []

    def calls() -> None:
        transport.abort()
        assert pending[0].is_done() and pending[0].wait(1.0)
        with pytest.raises(CollectiveError, match="aborted"):
            pending[0].check()
        with pytest.raises(CollectiveError, match="aborted"):
            transport.allreduce(torch.ones(4), "sum")
        answered.append("all")

    try:
        caller = threading.Thread(target=calls, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive() and answered == ["all"]  # all while the lock is held
        assert not transport._comm._gone  # the helper waits for the lock
        closer, progress = _close_in_thread(transport)
        assert progress.wait(10)
        assert closer.is_alive()  # close joins the helper, which cannot finish yet
    finally:
        leave.set()
    closer.join(10)
    assert not closer.is_alive()
    assert transport._comm._gone and transport._comm._aborted
    gate.set()
    holder.join(10)


def test_a_blocking_nccl_abort_holds_up_only_close():
    """ncclCommAbort may wait for kernels: here it waits until the test lets it go. It runs on
    the helper thread, so abort() and fail() return meanwhile and only close() waits for it."""
    transport = _solo_transport()
    real = transport._comm
    entered, release = threading.Event(), threading.Event()

    class SlowAbort:
        def check_async_error(self) -> None:
            pass

        def abort(self) -> None:
            entered.set()
            release.wait()
            real.abort()

    transport._comm = SlowAbort()
    try:
        caller = threading.Thread(target=lambda: (transport.abort(), transport.fail()), daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive()  # returned while ncclCommAbort cannot
        assert entered.wait(10)  # the helper is inside it
        closer, progress = _close_in_thread(transport)
        assert progress.wait(10)
        assert closer.is_alive() and not real._gone  # close joins the helper
    finally:
        release.set()
    closer.join(10)
    assert not closer.is_alive() and real._gone


class _RefusingComm:
    """A handle whose send raises what CuPy raises for ncclInvalidUsage."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def send(self, *args) -> None:
        self.calls.append("send")
        raise sim.NcclError(sim.ncclInvalidUsage)

    def recv(self, *args) -> None:
        self.calls.append("recv")

    def allReduce(self, *args) -> None:
        self.calls.append("allReduce")

    def bcast(self, *args) -> None:
        self.calls.append("bcast")

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.calls.append("abort")

    def destroy(self) -> None:
        self.calls.append("destroy")


@pytest.mark.parametrize("flushed_by", ["collective", "poll"])
def test_a_group_nccl_refuses_fails_the_transport_and_nothing_is_enqueued_after_it(flushed_by):
    """The posted group is flushed by a native collective, or by polling its handle; its send
    is refused: the transport is failed and aborted, and the collective (or any later call)
    is never enqueued, so no rank runs an operation its peers may not."""
    transport = _solo_transport()
    real = transport._comm
    fake = transport._comm = _RefusingComm()
    pending = transport.exchange([(torch.ones(4), 0)], [(torch.zeros(4), 0)], 0)
    if flushed_by == "collective":
        with pytest.raises(CollectiveError, match="NCCL refused the operation: NCCL_ERROR_INVALID_USAGE"):
            transport.allreduce(torch.ones(4), "sum")
    else:
        assert pending[0].is_done()
    with pytest.raises(CollectiveError, match="NCCL refused the operation"):
        pending[0].check()
    with pytest.raises(CollectiveError, match="failed"):
        transport.broadcast(torch.ones(4), 0)
    with pytest.raises(CollectiveError, match="failed"):
        transport.exchange([(torch.ones(4), 0)], [], 0)
    transport.close()
    assert fake.calls == ["send", "abort"]  # nothing after the refused send; abort, not destroy
    real.abort()


class _QueryFailsRuntime(nccl_backend._SimRuntime):
    """The simulator's runtime, counting how deep inside `bound()` each event query runs;
    every query raises as a CUDA error would."""

    def __init__(self, module) -> None:
        super().__init__(module)
        self.depth = 0
        self.queries: list[int] = []

    @contextlib.contextmanager
    def bound(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def new_event(self):
        runtime, real = self, super().new_event()

        class Event:
            def record(self, stream) -> None:
                real.record(stream)

            def synchronize(self, timeout=None) -> bool:
                return real.synchronize(timeout)

            def query(self) -> bool:
                runtime.queries.append(runtime.depth)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return Event()


def test_an_error_querying_an_event_fails_the_operation_and_aborts_nccl():
    transport = _solo_transport()
    runtime = transport._rt = _QueryFailsRuntime(sim)
    pending = transport.allreduce(torch.ones(4), "sum")
    assert pending[0].wait(5)
    with pytest.raises(CollectiveError, match="illegal memory access"):
        pending[0].check()
    assert transport._state == "failed"
    transport.close()
    assert transport._comm._aborted  # aborted, not destroyed
    assert runtime.queries and all(depth > 0 for depth in runtime.queries)  # with the device set


def _dying_rank(endpoint: str, secret: bytes, conn) -> None:
    from elastic.collective import Endpoint

    comm = Communicator(1, 2, Endpoint.parse(endpoint), 0, _config(), secret=secret)
    conn.send("connected")
    comm.allreduce(torch.ones(10), "sum", "native")
    conn.send("reduced")
    time.sleep(600)  # killed by the test


def test_a_peer_killed_with_sigkill_fails_the_survivor_with_a_collective_error(monkeypatch):
    """Rank 1 (a process) is killed once rank 0's second allreduce, which it never joins, was
    enqueued: rank 0 fails with the remote error, not the timeout error."""
    enqueued: list[int] = []
    second_enqueued = threading.Event()

    class Watched(sim.NcclCommunicator):
        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
            super().allReduce(sendbuf, recvbuf, count, datatype, op, stream)
            if count == 10:  # the test's allreduces, not the warm-up's
                enqueued.append(count)
                if len(enqueued) == 2:
                    second_enqueued.set()

    monkeypatch.setattr(sim, "NcclCommunicator", Watched)  # in this process: rank 0's
    server = RendezvousServer()
    ctx = warm_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dying_rank, args=(str(server.endpoint), server.secret, child),
                       daemon=True)
    proc.start()
    try:
        comm = Communicator(0, 2, server.endpoint, 0, _config(), secret=server.secret)
        assert parent.poll(60) and parent.recv() == "connected"
        assert torch.equal(comm.allreduce(torch.ones(10), "sum", "native"), torch.full((10,), 2.0))
        assert parent.poll(30) and parent.recv() == "reduced"
        # The second allreduce waits for a rank that is killed meanwhile.
        killer = threading.Thread(
            target=lambda: second_enqueued.wait(30) and os.kill(proc.pid, signal.SIGKILL), daemon=True)
        killer.start()
        with pytest.raises(CollectiveError, match="ncclRemoteError") as raised:
            comm.allreduce(torch.ones(10), "sum", "native")
        assert second_enqueued.is_set()
        assert not isinstance(raised.value, CollectiveTimeoutError)
        comm.close()
    finally:
        proc.kill()
        proc.join(10)
        server.close()


# --- out of memory inside NCCL ----------------------------------------------------------------

# What CuPy 14.2 raised on an H100 (NCCL 2.28.9, CUDA 13.0) for ncclCommInitRank with the
# device's memory taken (2 MiB free): NcclError, status 1, this text and nothing about memory
# (scripts/gpu_probe.py, 2026-11-27).
RECORDED_OOM_TEXT = ("NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error (run with "
                     "NCCL_DEBUG=INFO for details)")


class _RecordedNcclError(RuntimeError):
    status = 1


@pytest.mark.parametrize(("free", "out_of_memory"), [(2 << 20, True), (40 << 30, False)])
def test_an_unhandled_cuda_error_is_out_of_memory_when_the_device_has_no_memory_left(
        free, out_of_memory):
    from elastic.trainer.device import is_out_of_memory

    total = 80 << 30
    line = nccl_backend.describe_nccl_error(_RecordedNcclError(RECORDED_OOM_TEXT),
                                            lambda: (free, total))
    assert line.startswith(RECORDED_OOM_TEXT)
    assert is_out_of_memory(CollectiveError(f"NCCL refused the operation: {line}")) is out_of_memory
    # Without the device's word, the recorded text alone is not read as out of memory.
    assert not is_out_of_memory(CollectiveError(RECORDED_OOM_TEXT))


def test_a_device_that_cannot_say_leaves_the_line_as_it_was():
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access")

    assert nccl_backend.describe_nccl_error(_RecordedNcclError(RECORDED_OOM_TEXT),
                                            broken) == RECORDED_OOM_TEXT
    remote = KeyError(6)  # a code CuPy cannot name: never asked about memory
    assert nccl_backend.describe_nccl_error(remote, lambda: (0, 1)) == "NCCL result 6 (ncclRemoteError)"


def test_an_unhandled_cuda_error_in_a_collective_on_a_full_device_is_classified_as_out_of_memory(
        server, monkeypatch):
    from elastic.trainer.device import is_out_of_memory

    monkeypatch.setattr(sim, "device_memory", (1 << 20, 80 << 30), raising=False)
    errors: list[BaseException] = []

    def body(comm: Communicator) -> None:
        nccl = comm._transport._comm
        if comm.rank == 0:
            nccl.inject_error(1)
        try:
            comm.allreduce(torch.ones(4), "sum", "native")
        except CollectiveError as e:
            errors.append(e)

    run_ranks(server, 2, body, _config())
    assert errors and any(is_out_of_memory(e) for e in errors), [str(e) for e in errors]
