"""The NCCL backend: `cupy.cuda.nccl` on CUDA tensors, on a communication stream of its own.

Rank 0 creates the NCCL unique id and publishes it in the generation's rendezvous store; the
others read it. `NcclCommunicator(...)` blocks until every rank has arrived.

Connecting eagerly: NCCL connects point-to-point peers lazily, inside the `ncclGroupEnd` of
the first group that uses them (a socket exchange that waits for the peer's matching group),
and from NCCL 2.22 it connects collectives lazily too (`NCCL_RUNTIME_CONNECT=1`). A first
group of a generation could then block in host code, where neither the communicator's
deadline nor `abort()` reaches it. So the transport sets `NCCL_RUNTIME_CONNECT=0` (unless the
environment sets it; NCCL reads it once per process, so this holds only if no NCCL
communicator was created in the process before, e.g. by torch.distributed) and its
constructor, which runs in the communicator's rendezvous builder thread (bounded by the
rendezvous deadline, abandoned on abort), runs a warm-up: one group of a 1-byte send and
receive with every peer, then a 1-element allreduce, and waits for the communication stream to
finish them by polling against the rendezvous timeout; on timeout or error it aborts NCCL and
raises `RendezvousError`. The simulator runs the same warm-up.

Grouping: one NCCL communicator runs its work in order on the stream, and a point-to-point
group completes only when its peers' matching groups run. So the sends and receives of one
algorithm step must be one group: if a rank's receive were a group of its own, queued before
its send, every rank of a ring would wait in its receive with its send queued behind it. The
transport therefore only records what `exchange` and `recv_reduce` post; everything posted
since the last issue goes out as ONE group (`groupStart`; every send and receive; `groupEnd`)
when one of its handles is first polled, waited on or checked, or when a native collective
(`allreduce`, `broadcast`: ncclAllReduce, ncclBcast) starts. Algorithms post a step's
transfers and then wait, so each step is one group.

Streams: every operation is enqueued on the transport's own communication stream, a private
non-blocking CUDA stream made with cupy and wrapped in `torch.cuda.ExternalStream` (not
`torch.cuda.Stream()`, which hands out one of 32 pooled streams per device shared with any
other code). Such a stream is never destroyed: every tensor `record_stream`-ed on it makes the
caching allocator record an event on it whenever that tensor is freed, however much later; a
released transport's stream is taken by a later one on the same device once it is idle. The
communication stream first waits for the streams that produce the tensors (the caller's
current stream at each post; the wait, made when the group is issued, covers all work enqueued
there until then, such as the reduction of the previous step's receive into the buffer the
next one reuses). Completion is an event recorded on the communication stream after the
group; a checked handle makes the caller's current stream wait for that event, so later
kernels see the result, and every tensor the group uses is `record_stream`-ed on the
communication stream so that the caching allocator does not reuse its memory early. The device
is captured when the transport is built and set on whichever thread issues, polls, checks or
releases.

Failure: handles are polled (event query plus `ncclCommGetAsyncError`, both with the device
set; an exception from either is the operation's error) against the communicator's abort
flag, so a dead peer never leaves a caller blocked. Every call on the communicator handle
holds one lock, so a polling thread never uses a handle that is being freed. `fail()` (a
timeout or an error of this rank) and `abort()` only set the state and wake waiters, and
return at once; a helper thread takes the lock and calls `ncclCommAbort`, which may wait for
kernels. Once the state is not open, handles answer without taking the lock, so nothing waits
for that helper but `close()`, which joins it (its caller bounds it:
`Communicator.close(timeout)`). An NCCL call that refuses to enqueue fails the transport the
same way: nothing is issued after it (a collective posted behind a failed group is not
enqueued, so ranks never disagree on the order of operations). `close()` aborts too, even
after clean use: `ncclCommDestroy` waits for kernels that may never end after a failure, and
in recent NCCL it synchronises with the peers like a collective, so it hangs when a peer has
already left (vLLM PR #39846), which is how a generation usually ends here (a rank lost, or
leaving at a resize); a hang would end the worker after the release limit, restarting a
survivor. A communicator is closed only when the next generation forms, after every chunk of
its generation returned (each rank's collectives had completed on it), so aborting then cuts
nothing short. `close(destroy=True)` destroys after clean use, for a caller that knows every
rank is alive and past a barrier.

Bad input is refused before any NCCL call with `ValueError`, which the communicator re-raises
without failing (every rank passes the same tensors and raises alike): a tensor not on the
transport's device (a host tensor would be an illegal address that poisons the CUDA context),
not contiguous, or, for the native allreduce, of a dtype or op NCCL cannot reduce.

Two runtimes implement the stream, event and device calls: `torch.cuda` with cupy's NCCL on a
GPU, and `elastic.collective.nccl_sim` (`CollectiveConfig.nccl_simulator`), a CPU simulator of
NCCL's execution model on CPU tensors, so that this code runs, deadlocks included, in tests on
machines without a GPU.

Needs `pip install elastic[gpu]` (cupy-cuda12x, nvidia-nccl-cu12; NCCL 2.7 or newer) and a
CUDA device, unless simulated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp
from elastic.errors import BackendUnavailableError, CollectiveError, RendezvousError

logger = logging.getLogger(__name__)

_UID_KEY = "nccl_unique_id"

# torch dtype -> name of the NCCL data type constant in cupy.cuda.nccl.
NCCL_DTYPES: dict[torch.dtype, str] = {
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
}
NCCL_OPS: dict[str, str] = {"sum": "NCCL_SUM", "max": "NCCL_MAX"}

# ncclSend/ncclRecv appeared in NCCL 2.7 (versions before 2.9 are coded major*1000+minor*100).
MIN_NCCL_VERSION = 2700


def load_nccl(simulated: bool = False) -> Any:
    """`cupy.cuda.nccl`, or the simulator module when `simulated`.

    Raises:
        BackendUnavailableError: cupy or NCCL is not installed (cupy imports without libnccl
            and then says `available = False`), NCCL is older than 2.7, or there is no CUDA
            device.
    """
    if simulated:
        from elastic.collective import nccl_sim

        return nccl_sim
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend 'nccl' needs a CUDA device and none is visible; use "
            "CollectiveConfig.backend='gloo' on CPU"
        )
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise BackendUnavailableError(
            "backend 'nccl' needs cupy and NCCL: pip install 'elastic[gpu]'"
        ) from e
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError(
            "backend 'nccl': cupy is installed but could not load the NCCL library (libnccl); "
            "pip install 'elastic[gpu]' (nvidia-nccl-cu12) or make libnccl.so.2 loadable"
        )
    try:
        version = int(nccl.get_version())
    except Exception as e:
        raise BackendUnavailableError(
            f"backend 'nccl': cupy cannot tell the NCCL version ({describe_nccl_error(e)}); "
            "pip install 'elastic[gpu]'"
        ) from e
    if version < MIN_NCCL_VERSION:
        raise BackendUnavailableError(
            f"backend 'nccl' needs NCCL 2.7 or newer (send and receive), found version code "
            f"{version}; pip install -U nvidia-nccl-cu12"
        )
    return nccl


def nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    """The NCCL data type for a torch dtype.

    Raises:
        ValueError: NCCL has no such type.
    """
    name = NCCL_DTYPES.get(dtype)
    if name is None or not hasattr(nccl, name):
        raise ValueError(f"backend 'nccl' cannot reduce tensors of dtype {dtype} natively; use "
                         "another allreduce algorithm ('ring', 'tree') or another dtype")
    return int(getattr(nccl, name))


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """Serialises an NCCL unique id (cupy gives a tuple of 128 small ints) for the store."""
    return json.dumps([int(x) for x in uid]).encode()


def decode_unique_id(data: bytes) -> tuple[int, ...]:
    """Inverse of `encode_unique_id`."""
    return tuple(int(x) for x in json.loads(data.decode()))


# NCCL result codes by number; CuPy's NcclError knows 0-5 only and raises KeyError for the
# others (6 is what a dead peer produces).
NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
                7: "ncclInProgress"}


# CUDA failures NCCL reports without saying which (out of memory among them): CuPy's NcclError
# for them reads only "NCCL_ERROR_UNHANDLED_CUDA_ERROR: unhandled cuda error (run with
# NCCL_DEBUG=INFO for details)" (status 1), as seen on an H100 with the device's memory taken.
# Not ncclSystemError (2): NCCL reports a peer's broken socket so, and torch's cache often
# holds nearly all of a busy device, so a lost peer would read as out of memory.
_CUDA_FAILURE_CODES = (1,)
# Below this much free device memory (or 1% of it), such a failure is read as out of memory.
LOW_MEMORY_BYTES = 256 << 20


def _nccl_code(error: BaseException) -> int | None:
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        return error.args[0]
    status = getattr(error, "status", None)
    return status if isinstance(status, int) else None


def describe_nccl_error(error: BaseException,
                        free_memory: Callable[[], tuple[int, int] | None] | None = None) -> str:
    """One line for what CuPy raised from an NCCL call, including the codes it cannot name.

    NCCL says only "unhandled cuda error" when CUDA ran out of memory in it, so for that
    code `free_memory` (the device's free and total bytes, None when it
    cannot tell) is asked: with less than `LOW_MEMORY_BYTES` (or 1% of the device) free, the
    line says "out of memory", which `elastic.trainer.device.is_out_of_memory` reads."""
    code = _nccl_code(error)
    if isinstance(error, KeyError) and code is not None:
        line = f"NCCL result {code} ({NCCL_RESULTS.get(code, 'unknown to this version')})"
    else:
        line = str(error) or type(error).__name__
    if code in _CUDA_FAILURE_CODES and free_memory is not None:
        try:
            memory = free_memory()
        except Exception:
            memory = None
        if memory is not None:
            free, total = memory
            if free < max(LOW_MEMORY_BYTES, total // 100):
                line += (f" (out of memory: {free >> 20} MiB of the device's {total >> 20} MiB "
                         "free)")
    return line


# --- the two runtimes ------------------------------------------------------------------------

# The private communication streams made so far, kept for the life of the process: a tensor
# `record_stream`-ed on one makes the caching allocator record an event on that stream when the
# tensor is freed, at any later time, so destroying one would be an error then. Streams of
# released transports wait in `_IDLE_STREAMS` (per device index) for a later transport.
_STREAMS_LOCK = threading.Lock()
_ALL_STREAMS: list[tuple[Any, Any]] = []  # (cupy stream that owns the handle, torch wrapper)
_IDLE_STREAMS: dict[int, list[Any]] = {}


class _CudaRuntime:
    """Streams, events and the device of a real GPU (`torch.cuda`)."""

    # A CUDA event cannot be waited on with a timeout: it is polled this often.
    poll_s = 0.0002

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())

    def bound(self) -> contextlib.AbstractContextManager[Any]:
        """Makes the transport's device current on this thread inside the block."""
        return torch.cuda.device(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        """A private non-blocking stream on the device: an idle one a released transport left,
        else a new one (see `_ALL_STREAMS`)."""
        index = self.device.index if self.device.index is not None else 0
        with _STREAMS_LOCK:
            idle = _IDLE_STREAMS.setdefault(index, [])
            for i, stream in enumerate(idle):
                with contextlib.suppress(Exception):  # a stream that cannot say is not taken
                    if stream.query():
                        return idle.pop(i)
        import cupy

        with cupy.cuda.Device(index):
            raw = cupy.cuda.Stream(non_blocking=True)
        stream = torch.cuda.ExternalStream(raw.ptr, device=self.device)
        with _STREAMS_LOCK:
            _ALL_STREAMS.append((raw, stream))
        return stream

    def retire_stream(self, stream: Any) -> None:
        """Hands a released transport's stream to later transports on the device."""
        index = self.device.index if self.device.index is not None else 0
        with _STREAMS_LOCK:
            _IDLE_STREAMS.setdefault(index, []).append(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def record_stream(self, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        for t in tensors:
            t.record_stream(stream)

    def free_memory(self) -> tuple[int, int] | None:
        """The device's free and total bytes (what CUDA has left beside every allocation,
        torch's cache included)."""
        return torch.cuda.mem_get_info(self.device)

    def wait_event(self, event: Any, timeout: float, wake: threading.Event) -> None:
        """Waits a polling interval (cut short by `wake`); the caller queries the event, with
        the device set and under the transport's lock."""
        wake.wait(timeout)


class _SimRuntime:
    """The simulator's streams and events (`nccl_sim`), on CPU tensors."""

    poll_s = 0.01  # the simulator's events are waited on, not polled: this only bounds a wait
    device = torch.device("cpu")

    def __init__(self, sim: Any) -> None:
        self._sim = sim

    def bound(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return self._sim.current_stream()

    def new_stream(self) -> Any:
        return self._sim.Stream("nccl")

    def retire_stream(self, stream: Any) -> None:
        return

    def new_event(self) -> Any:
        return self._sim.Event()

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def record_stream(self, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._sim.hold(tensors, stream)

    def free_memory(self) -> tuple[int, int] | None:
        """The simulated device's free and total bytes, where a test sets them
        (`nccl_sim.device_memory`)."""
        return getattr(self._sim, "device_memory", None)

    def wait_event(self, event: Any, timeout: float, wake: threading.Event) -> None:
        event.synchronize(timeout)


# --- operations ------------------------------------------------------------------------------


class _Batch:
    """Operations issued as one NCCL group, and what became of them."""

    __slots__ = ("error", "event", "issued", "ops", "producers")

    def __init__(self) -> None:
        # ("send" | "recv", tensor, peer), ("allreduce", tensor, dtype, op), ("bcast", tensor, root)
        self.ops: list[tuple[Any, ...]] = []
        self.producers: list[Any] = []  # the streams that produced the tensors
        self.issued = False
        self.event: Any = None  # recorded on the communication stream after the group
        self.error: str | None = None  # the group could not be issued, or its event not queried


class _NcclPending:
    """One call's share of a batch: the batch is issued when a handle is first looked at."""

    __slots__ = ("_batch", "_transport")

    def __init__(self, transport: NcclTransport, batch: _Batch) -> None:
        self._transport = transport
        self._batch = batch

    def is_done(self) -> bool:
        return self._transport._is_done(self._batch)

    def wait(self, timeout: float) -> bool:
        return self._transport._wait(self._batch, timeout)

    def check(self) -> None:
        self._transport._check(self._batch)


# --- the transport ---------------------------------------------------------------------------

_OPEN, _FAILED, _ABORTED, _CLOSED = "open", "failed", "aborted", "closed"


class NcclTransport(Transport):
    """One rank's NCCL communicator for one generation.

    Args:
        rank: this rank.
        world_size: number of ranks.
        store: the generation's rendezvous store (carries the unique id).
        timeout: how long ranks other than 0 wait for the unique id, and how long the whole
            construction, the warm-up that connects every peer included, may take.
        simulated: run against `elastic.collective.nccl_sim` on CPU tensors instead of cupy
            on CUDA tensors.

    The CUDA device is the calling thread's current device at construction.

    Raises:
        BackendUnavailableError: not simulated, and cupy, NCCL or a CUDA device is missing.
        RendezvousError: the warm-up did not finish within `timeout`, or NCCL failed in it
            (NCCL is aborted then).
    """

    name = "nccl"

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: timedelta,
                 *, simulated: bool = False) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        self._nccl = load_nccl(simulated)
        if not simulated:
            # Collectives connect in ncclCommInitRank, not in the first group (NCCL >= 2.22).
            os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
        self._rt: _CudaRuntime | _SimRuntime = _SimRuntime(self._nccl) if simulated else _CudaRuntime()
        self.rank = rank
        self.world_size = world_size
        self.device: torch.device = self._rt.device
        """The device whose tensors this transport moves (CPU under the simulator)."""
        self._lock = threading.RLock()  # every call on the communicator handle holds it
        # Guards `_state` and `_releaser`; held only for a moment, never across an NCCL call.
        self._flags = threading.Lock()
        self._state = _OPEN
        self._reason: str | None = None  # why the transport failed, when it did
        self._releaser: threading.Thread | None = None  # aborts or destroys the handle, once
        self._stream: Any = None
        self._open: _Batch | None = None  # posted, not issued yet
        self._last: _Batch | None = None  # the last batch issued
        self._wake = threading.Event()  # set on abort or failure: waiters return
        if rank == 0:
            uid = self._nccl.get_unique_id()
            store.set(_UID_KEY, encode_unique_id(uid))
        else:
            store.wait([_UID_KEY], timeout)
            uid = decode_unique_id(store.get(_UID_KEY))
        try:
            with self._rt.bound():
                self._comm: Any = self._nccl.NcclCommunicator(world_size, uid, rank)
        except Exception as e:  # cupy raises NcclError, or KeyError for codes it lacks
            raise CollectiveError("NCCL could not create the communicator: "
                                  f"{describe_nccl_error(e, self._rt.free_memory)}") from e
        try:
            with self._rt.bound():
                self._stream = self._rt.new_stream()
            self._connect_eagerly(deadline, timeout)
        except BaseException as e:
            self._stop(_FAILED, f"the NCCL warm-up did not succeed: {e}")
            raise

    def _connect_eagerly(self, deadline: float, timeout: timedelta) -> None:
        """The warm-up: a group of a 1-byte send and receive with every peer (NCCL connects a
        peer in the first group that uses it) and a 1-element allreduce, waited for until
        `deadline`; so no later group blocks in host code to connect."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        byte = torch.ones(1, dtype=torch.uint8, device=self.device)
        inbox = torch.zeros(max(1, len(peers)), dtype=torch.uint8, device=self.device)
        total = torch.ones(1, dtype=torch.uint8, device=self.device)
        producer = self._rt.current_stream()
        p2p, collective = _Batch(), _Batch()
        for i, peer in enumerate(peers):
            p2p.ops += [("send", byte, peer), ("recv", inbox[i:i + 1], peer)]
        p2p.producers.append(producer)
        collective.ops.append(("allreduce", total, nccl_dtype(self._nccl, torch.uint8),
                               int(self._nccl.NCCL_SUM)))
        collective.producers.append(producer)
        with self._lock:
            if p2p.ops:
                self._issue(p2p)
            self._issue(collective)
        # The allreduce runs after the group on the communication stream: its end is the end.
        while not self._is_done(collective):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"rank {self.rank} of {self.world_size}: NCCL did not connect every peer "
                    f"within {timeout} (a peer did not reach the warm-up, or its network is "
                    "unreachable); NCCL is aborted",
                    rank=self.rank,
                )
            self._rt.wait_event(collective.event, min(left, self._rt.poll_s), self._wake)
        error = p2p.error or collective.error
        if error is None and self._state != _OPEN:
            error = self._describe_state()
        if error is None:
            with self._lock:
                error = self._async_error()
        if error is not None:
            raise RendezvousError(
                f"rank {self.rank} of {self.world_size}: NCCL failed while connecting the peers: "
                f"{error}", rank=self.rank,
            )

    # --- posting -------------------------------------------------------------------------

    def _guard(self, tensor: torch.Tensor, role: str) -> None:
        """Refuses bad input before any NCCL call, with ValueError: every rank passes the same
        tensors and raises alike, so the communicator re-raises it without failing."""
        if tensor.device != self.device:
            raise ValueError(
                f"the NCCL data plane takes CUDA tensors only, on this rank's device "
                f"{self.device}; got a tensor on {tensor.device} to {role} (host tensors belong "
                "on Communicator.control)"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"the NCCL data plane takes contiguous tensors only; got a "
                             f"non-contiguous one to {role}")

    def _guard_reduction(self, tensor: torch.Tensor, op: ReduceOp) -> tuple[int, int]:
        """`_guard` for the native allreduce, which also needs an NCCL type and operation:
        returns them."""
        self._guard(tensor, "allreduce")
        name = NCCL_OPS.get(op)
        if name is None or not hasattr(self._nccl, name):
            raise ValueError(f"backend 'nccl' cannot reduce with op {op!r} natively")
        return nccl_dtype(self._nccl, tensor.dtype), int(getattr(self._nccl, name))

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be in [0, {self.world_size}), got {peer}")

    def _describe_state(self) -> str:
        state = f"the NCCL communicator is {self._state}"
        return f"{state} ({self._reason})" if self._reason else state

    def _usable(self) -> None:
        if self._state != _OPEN:
            raise CollectiveError(self._describe_state())

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        # NCCL matches point-to-point calls in order per peer; the tag is not needed.
        ops: list[tuple[Any, ...]] = []
        for tensor, peer in sends:
            self._guard(tensor, "send")
            self._check_peer(peer)
            if tensor.numel():
                ops.append(("send", tensor, peer))
        for tensor, peer in recvs:
            self._guard(tensor, "receive into")
            self._check_peer(peer)
            if tensor.numel():
                ops.append(("recv", tensor, peer))
        if not ops:
            return []
        self._usable()  # before the lock, which a releasing helper may hold
        producer = self._rt.current_stream()
        with self._lock:
            self._usable()
            batch = self._open
            if batch is None:
                batch = self._open = _Batch()
            batch.ops.extend(ops)
            if not any(p == producer for p in batch.producers):
                batch.producers.append(producer)
        return [_NcclPending(self, batch)]

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int,
                    scratch: torch.Tensor | None = None) -> list[Pending]:
        # Received into scratch by the group, reduced into `tensor` on the caller's stream
        # when checked (after the stream waited for the group): `Transport.recv_reduce`.
        self._guard(tensor, "reduce into")
        if scratch is not None:
            self._guard(scratch, "receive into")
        return super().recv_reduce(tensor, src, op, tag, scratch)

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        dtype, nccl_op = self._guard_reduction(tensor, op)
        if not tensor.numel():
            return []
        return self._collective(("allreduce", tensor, dtype, nccl_op))

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        self._guard(tensor, "broadcast")  # moved as bytes: any dtype
        self._check_peer(src)
        if not tensor.numel():
            return []
        return self._collective(("bcast", tensor, src))

    def _collective(self, op: tuple[Any, ...]) -> list[Pending]:
        self._usable()
        producer = self._rt.current_stream()
        batch = _Batch()
        batch.ops.append(op)
        batch.producers.append(producer)
        with self._lock:
            self._usable()
            if self._open is not None:  # what was posted before goes first, as its own group
                self._issue(self._open)
                self._usable()  # that group failed: the collective must not be enqueued
            self._issue(batch)
            if batch.error is not None:
                raise CollectiveError(batch.error)
        return [_NcclPending(self, batch)]

    # --- issuing -------------------------------------------------------------------------

    def _issue(self, batch: _Batch) -> None:
        """Enqueues a batch as one group on the communication stream. Call with the lock
        held. Never raises: what goes wrong is the batch's error, raised when checked, and
        fails the transport (NCCL is aborted and nothing more is issued), so that no rank
        enqueues an operation its peers may not."""
        if batch.issued:
            return
        batch.issued = True
        if self._open is batch:
            self._open = None
        if self._state != _OPEN:
            batch.error = self._describe_state()
            return
        nccl, comm = self._nccl, self._comm
        try:
            with self._rt.bound():
                for producer in batch.producers:
                    self._stream.wait_stream(producer)
                stream = self._rt.handle(self._stream)
                nccl.groupStart()
                try:
                    for op in batch.ops:
                        kind, tensor = op[0], op[1]
                        ptr = tensor.data_ptr()
                        nbytes = tensor.numel() * tensor.element_size()
                        if kind == "send":
                            comm.send(ptr, nbytes, nccl.NCCL_UINT8, op[2], stream)
                        elif kind == "recv":
                            comm.recv(ptr, nbytes, nccl.NCCL_UINT8, op[2], stream)
                        elif kind == "allreduce":
                            comm.allReduce(ptr, ptr, tensor.numel(), op[2], op[3], stream)
                        else:
                            comm.bcast(ptr, nbytes, nccl.NCCL_UINT8, op[2], stream)
                finally:
                    nccl.groupEnd()
                self._rt.record_stream([op[1] for op in batch.ops], self._stream)
                event = self._rt.new_event()
                event.record(self._stream)
        except Exception as e:
            batch.error = ("NCCL refused the operation: "
                           f"{describe_nccl_error(e, self._rt.free_memory)}")
            self._stop(_FAILED, batch.error)
            return
        batch.event = event
        self._last = batch

    # --- waiting (the handles call these) -------------------------------------------------

    def _async_error(self) -> str | None:
        """The communicator's asynchronous error. Call with the lock held, while open."""
        try:
            with self._rt.bound():
                self._comm.check_async_error()
        except Exception as e:  # cupy raises NcclError, or KeyError for codes it lacks
            return describe_nccl_error(e, self._rt.free_memory)
        return None

    def _query(self, batch: _Batch) -> bool:
        """Whether an issued batch's event completed. Call with the lock held, while open. An
        exception (a CUDA error) is the batch's error and fails the transport: True then."""
        try:
            with self._rt.bound():
                return bool(batch.event.query())
        except Exception as e:
            batch.error = ("querying an NCCL operation failed: "
                           f"{describe_nccl_error(e, self._rt.free_memory)}")
            self._stop(_FAILED, batch.error)
            return True

    def _is_done(self, batch: _Batch) -> bool:
        if self._state != _OPEN:  # no lock: a helper releasing the handle may hold it
            return True
        with self._lock:
            self._issue(batch)
            if batch.error is not None or self._state != _OPEN:
                return True
            return self._query(batch) or self._async_error() is not None

    def _wait(self, batch: _Batch, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the batch, an asynchronous error, or an abort;
        returns `is_done()`."""
        deadline = time.monotonic() + timeout
        while not self._is_done(batch):
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.is_set():
                return self._is_done(batch)
            self._rt.wait_event(batch.event, min(left, self._rt.poll_s), self._wake)
        return True

    def _check(self, batch: _Batch) -> None:
        if batch.error is not None:
            raise CollectiveError(batch.error)
        self._usable()
        with self._lock:
            self._issue(batch)
            if batch.error is not None:
                raise CollectiveError(batch.error)
            self._usable()
            error = self._async_error()
            if error is not None:
                raise CollectiveError(f"NCCL reported an asynchronous error: {error}")
            if not self._query(batch):
                raise CollectiveError("an NCCL operation was checked before it finished")
            if batch.error is not None:
                raise CollectiveError(batch.error)
            with self._rt.bound():
                # What runs next on the caller's stream sees the result.
                self._rt.current_stream().wait_event(batch.event)

    # --- failure and release -------------------------------------------------------------

    def _stop(self, state: str, reason: str | None = None) -> None:
        """Leaves the open state (failed, or aborted, which also overrides failed), wakes the
        waiters and starts the helper that aborts NCCL. Never blocks: safe with or without
        the lock held."""
        with self._flags:
            if self._state == _OPEN or (self._state == _FAILED and state == _ABORTED):
                self._state = state
            if reason is not None and self._reason is None:
                self._reason = reason
            self._start_release(destroy=False)
        self._wake.set()

    def _start_release(self, destroy: bool) -> None:
        """Starts the helper thread that aborts or destroys the handle, unless one was started.
        Call with `_flags` held."""
        if self._releaser is None:
            self._releaser = threading.Thread(
                target=self._release, args=(destroy,), daemon=True,
                name=f"elastic-nccl-{'destroy' if destroy else 'abort'}-r{self.rank}")
            self._releaser.start()

    def _release(self, destroy: bool) -> None:
        """On the helper thread: ncclCommAbort or ncclCommDestroy (either may wait for
        kernels), once nobody else is inside a call on the handle."""
        try:
            with self._lock:
                self._open = None
                try:
                    with self._rt.bound():
                        if destroy:
                            self._comm.destroy()
                        else:
                            self._comm.abort()
                except Exception as e:  # nothing more can be done about the handle
                    logger.warning("releasing the NCCL communicator failed: %s", describe_nccl_error(e))
                if self._stream is not None:
                    self._rt.retire_stream(self._stream)
        finally:
            self._wake.set()

    def abort(self) -> None:
        """Sets the state, wakes every waiter and returns at once; a helper thread aborts NCCL
        (`close()` waits for it)."""
        self._stop(_ABORTED)

    def fail(self) -> None:
        """An operation of this rank failed: abort NCCL, so that the communication stream
        gives up (and peers see a remote error) instead of running a group forever. Returns at
        once, as `abort()`."""
        self._stop(_FAILED)

    def close(self, destroy: bool = False) -> None:
        """Aborts the communicator (ncclCommAbort, local: it cannot wait for a peer), or with
        `destroy`, for a caller that knows every rank is alive and past a barrier, destroys it
        after clean use (nothing failed or aborted, no asynchronous error, nothing in flight);
        then waits for that release: for as long as it takes, so a caller that cannot wait
        bounds it (`Communicator.close(timeout)`)."""
        if self._releaser is None:
            with self._lock:  # not released while this holds it
                clean = (self._state == _OPEN
                         and (self._last is None or self._query(self._last))
                         and (self._last is None or self._last.error is None)
                         and self._async_error() is None)
                with self._flags:
                    if self._state == _OPEN:
                        self._state = _CLOSED
                    self._start_release(destroy=destroy and clean and self._state == _CLOSED)
        self._wake.set()
        releaser = self._releaser
        assert releaser is not None
        releaser.join()
