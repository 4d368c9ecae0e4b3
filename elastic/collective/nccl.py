"""The NCCL backend: `cupy.cuda.nccl` on CUDA tensors, on a communication stream of its own.

Rank 0 creates the NCCL unique id and publishes it in the generation's rendezvous store; the
others read it. `NcclCommunicator(...)` blocks until every rank has arrived.

Grouping: one NCCL communicator runs its work in order on the stream, and a point-to-point
group completes only when its peers' matching groups run. So the sends and receives of one
algorithm step must be one group: if a rank's receive were a group of its own, queued before
its send, every rank of a ring would wait in its receive with its send queued behind it. The
transport therefore only records what `exchange` and `recv_reduce` post; everything posted
since the last issue goes out as ONE group (`groupStart`; every send and receive; `groupEnd`)
when one of its handles is first polled, waited on or checked, or when a native collective
(`allreduce`, `broadcast`: ncclAllReduce, ncclBcast) starts. Algorithms post a step's
transfers and then wait, so each step is one group.

Streams: every operation is enqueued on the transport's own communication stream, which first
waits for the streams that produce the tensors (the caller's current stream at each post; the
wait, made when the group is issued, covers all work enqueued there until then, such as the
reduction of the previous step's receive into the buffer the next one reuses). Completion is
an event recorded on the communication stream after the group; a checked handle makes the
caller's current stream wait for that event, so later kernels see the result, and every tensor
the group uses is `record_stream`-ed on the communication stream so that the caching
allocator does not reuse its memory early. The device is captured when the transport is built
and set on whichever thread issues, checks or aborts.

Failure: handles are polled (event query plus `ncclCommGetAsyncError`) against the
communicator's abort flag, so a dead peer never leaves a caller blocked. `fail()` (a timeout or
an error) and `abort()` call `ncclCommAbort`; after either, `close()` never calls
`ncclCommDestroy`, which would wait for kernels that may never end. Only a close after clean
use, with nothing in flight, destroys. Every call on the communicator handle (enqueueing,
`check_async_error`, `abort`, `destroy`) holds one lock, so a polling thread never uses a
handle that `abort()` is freeing. A tensor not on the transport's device (a host tensor would
be an illegal address that poisons the CUDA context) or not contiguous is refused before any
NCCL call.

Two runtimes implement the stream, event and device calls: `torch.cuda` with cupy's NCCL on a
GPU, and `elastic.collective.nccl_sim` (`CollectiveConfig.nccl_simulator`), a CPU simulator of
NCCL's execution model on CPU tensors, so that this code runs, deadlocks included, in tests on
machines without a GPU.

Needs `pip install elastic[gpu]` (cupy-cuda12x, nvidia-nccl-cu12) and a CUDA device, unless
simulated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp
from elastic.errors import BackendUnavailableError, CollectiveError

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


def load_nccl(simulated: bool = False) -> Any:
    """`cupy.cuda.nccl`, or the simulator module when `simulated`.

    Raises:
        BackendUnavailableError: cupy or NCCL is not installed, or there is no CUDA device.
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
    return nccl


def nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    """The NCCL data type for a torch dtype.

    Raises:
        ValueError: NCCL has no such type.
    """
    name = NCCL_DTYPES.get(dtype)
    if name is None or not hasattr(nccl, name):
        raise ValueError(f"backend 'nccl' cannot reduce tensors of dtype {dtype}")
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


def describe_nccl_error(error: BaseException) -> str:
    """One line for what CuPy raised from an NCCL call, including the codes it cannot name."""
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        code = error.args[0]
        return f"NCCL result {code} ({NCCL_RESULTS.get(code, 'unknown to this version')})"
    return str(error) or type(error).__name__


# --- the two runtimes ------------------------------------------------------------------------


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
        return torch.cuda.Stream(device=self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def record_stream(self, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        for t in tensors:
            t.record_stream(stream)

    def wait_event(self, event: Any, timeout: float) -> bool:
        if not event.query():
            time.sleep(timeout)
        return bool(event.query())


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

    def new_event(self) -> Any:
        return self._sim.Event()

    def handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def record_stream(self, tensors: Sequence[torch.Tensor], stream: Any) -> None:
        self._sim.hold(tensors, stream)

    def wait_event(self, event: Any, timeout: float) -> bool:
        return bool(event.synchronize(timeout))


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
        self.error: str | None = None  # the group could not be issued


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
        timeout: how long ranks other than 0 wait for the unique id.
        simulated: run against `elastic.collective.nccl_sim` on CPU tensors instead of cupy
            on CUDA tensors.

    The CUDA device is the calling thread's current device at construction.

    Raises:
        BackendUnavailableError: not simulated, and cupy, NCCL or a CUDA device is missing.
    """

    name = "nccl"

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: timedelta,
                 *, simulated: bool = False) -> None:
        self._nccl = load_nccl(simulated)
        self._rt: _CudaRuntime | _SimRuntime = _SimRuntime(self._nccl) if simulated else _CudaRuntime()
        self.rank = rank
        self.world_size = world_size
        self.device: torch.device = self._rt.device
        """The device whose tensors this transport moves (CPU under the simulator)."""
        if rank == 0:
            uid = self._nccl.get_unique_id()
            store.set(_UID_KEY, encode_unique_id(uid))
        else:
            store.wait([_UID_KEY], timeout)
            uid = decode_unique_id(store.get(_UID_KEY))
        with self._rt.bound():
            self._comm: Any = self._nccl.NcclCommunicator(world_size, uid, rank)
            try:
                self._stream = self._rt.new_stream()
            except BaseException:
                self._comm.abort()
                raise
        self._lock = threading.RLock()  # every call on the communicator handle holds it
        self._state = _OPEN
        self._released = False  # abort() or destroy() was called on the handle
        self._open: _Batch | None = None  # posted, not issued yet
        self._last: _Batch | None = None  # the last batch issued
        self._wake = threading.Event()  # set on abort or failure: waiters return

    # --- posting -------------------------------------------------------------------------

    def _guard(self, tensor: torch.Tensor, role: str) -> None:
        if tensor.device != self.device:
            raise CollectiveError(
                f"the NCCL data plane takes CUDA tensors only, on this rank's device "
                f"{self.device}; got a tensor on {tensor.device} to {role} (host tensors belong "
                "on Communicator.control)"
            )
        if not tensor.is_contiguous():
            raise CollectiveError(f"the NCCL data plane takes contiguous tensors only; got a "
                                  f"non-contiguous one to {role}")

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be in [0, {self.world_size}), got {peer}")

    def _usable(self) -> None:
        """Call with the lock held."""
        if self._state != _OPEN:
            raise CollectiveError(f"the NCCL communicator is {self._state}")

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
        self._guard(tensor, "allreduce")
        if not tensor.numel():
            return []
        nccl = self._nccl
        return self._collective(("allreduce", tensor, nccl_dtype(nccl, tensor.dtype),
                                 int(getattr(nccl, NCCL_OPS[op]))))

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        self._guard(tensor, "broadcast")
        self._check_peer(src)
        if not tensor.numel():
            return []
        return self._collective(("bcast", tensor, src))

    def _collective(self, op: tuple[Any, ...]) -> list[Pending]:
        producer = self._rt.current_stream()
        batch = _Batch()
        batch.ops.append(op)
        batch.producers.append(producer)
        with self._lock:
            self._usable()
            if self._open is not None:  # what was posted before goes first, as its own group
                self._issue(self._open)
            self._issue(batch)
        return [_NcclPending(self, batch)]

    # --- issuing -------------------------------------------------------------------------

    def _issue(self, batch: _Batch) -> None:
        """Enqueues a batch as one group on the communication stream. Call with the lock
        held. Never raises: what goes wrong is the batch's error, raised when checked."""
        if batch.issued:
            return
        batch.issued = True
        if self._open is batch:
            self._open = None
        if self._state != _OPEN:
            batch.error = f"the NCCL communicator is {self._state}"
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
            batch.error = f"NCCL refused the operation: {describe_nccl_error(e)}"
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
            return describe_nccl_error(e)
        return None

    def _is_done(self, batch: _Batch) -> bool:
        with self._lock:
            self._issue(batch)
            if batch.error is not None or self._state != _OPEN:
                return True
            return bool(batch.event.query()) or self._async_error() is not None

    def _wait(self, batch: _Batch, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the batch, an asynchronous error, or an abort;
        returns `is_done()`."""
        deadline = time.monotonic() + timeout
        while not self._is_done(batch):
            left = deadline - time.monotonic()
            if left <= 0 or self._wake.is_set():
                return self._is_done(batch)
            self._rt.wait_event(batch.event, min(left, self._rt.poll_s))
        return True

    def _check(self, batch: _Batch) -> None:
        with self._lock:
            self._issue(batch)
            if self._state != _OPEN:
                raise CollectiveError(f"the NCCL communicator is {self._state}")
            if batch.error is not None:
                raise CollectiveError(batch.error)
            error = self._async_error()
            if error is not None:
                raise CollectiveError(f"NCCL reported an asynchronous error: {error}")
            if not batch.event.query():
                raise CollectiveError("an NCCL operation was checked before it finished")
            with self._rt.bound():
                # What runs next on the caller's stream sees the result.
                self._rt.current_stream().wait_event(batch.event)

    # --- failure and release -------------------------------------------------------------

    def _release(self, destroy: bool) -> None:
        """Aborts or destroys the communicator handle, once. Call with the lock held."""
        if self._released:
            return
        self._released = True
        self._open = None
        try:
            with self._rt.bound():
                if destroy:
                    self._comm.destroy()
                else:
                    self._comm.abort()
        except Exception as e:  # nothing more can be done about the handle
            logger.warning("releasing the NCCL communicator failed: %s", describe_nccl_error(e))

    def _abort_now(self) -> None:
        """ncclCommAbort without waiting long for the lock: a thread stuck in an NCCL call
        holds it, and abort() must not block, so then a helper thread aborts once it can."""
        if self._lock.acquire(timeout=0.02):
            try:
                self._release(destroy=False)
            finally:
                self._lock.release()
            return

        def locked() -> None:
            with self._lock:
                self._release(destroy=False)

        threading.Thread(target=locked, name=f"elastic-nccl-abort-r{self.rank}", daemon=True).start()

    def abort(self) -> None:
        if self._state in (_OPEN, _FAILED):
            self._state = _ABORTED
        self._wake.set()
        self._abort_now()

    def fail(self) -> None:
        """An operation of this rank failed: abort NCCL, so that the communication stream
        gives up (and peers see a remote error) instead of running a group forever."""
        if self._state == _OPEN:
            self._state = _FAILED
        self._wake.set()
        self._abort_now()

    def close(self) -> None:
        """Destroys the communicator after clean use (nothing failed or aborted, no
        asynchronous error, nothing in flight), else aborts it: ncclCommDestroy waits for
        kernels that may never end."""
        with self._lock:
            clean = (self._state == _OPEN and not self._released
                     and (self._last is None or bool(self._last.event.query()))
                     and self._async_error() is None)
            if self._state == _OPEN:
                self._state = _CLOSED
            self._release(destroy=clean)
        self._wake.set()
