"""A CPU simulator of NCCL's execution model, standing in for `cupy.cuda.nccl` and the CUDA
stream runtime on a machine without a GPU (`CollectiveConfig.nccl_simulator`).

It offers the subset of `cupy.cuda.nccl` that `elastic.collective.nccl` calls, with the same
names and signatures (`get_unique_id`, `NcclCommunicator`, `groupStart`/`groupEnd`, the
`NCCL_*` constants, `NcclError`), and the few stream and event objects that take the place of
`torch.cuda` there (`Stream`, `Event`, `current_stream`). "Device pointers" are host
addresses (`tensor.data_ptr()` of CPU tensors), read and written in place.

What it models, because the transport's correctness depends on it:

- Each stream runs its work in order, one executor thread per stream. A group (everything
  between `groupStart` and `groupEnd`, or one call outside a group) is one unit of work; it
  completes only once every send in it was consumed by the peer's matching receive, every
  receive was filled, and every collective in it was reached by all ranks. So two groups
  "receive, then send" on every rank of a ring deadlock, as they do on a GPU.
- Point-to-point transfers between a pair of ranks match in the order they were enqueued;
  collectives match by their order on the communicator. A receive of another size than the
  matching send is ncclInvalidUsage.
- Events complete when their stream reaches them; `Stream.wait_event`/`wait_stream` make a
  stream wait. Each host thread has its own default stream (CUDA's per-thread default stream),
  and `launch` enqueues a "kernel" (any callable) on a stream, so tests can make a producer
  stream late.
- `NcclCommunicator(ndev, uid, rank)` blocks until all `ndev` ranks have arrived.
- `abort()` works while a group is running: the executor gives up, nothing more is read from
  or written to user memory once `abort()` returned, and later calls fail (as CuPy's calls on
  its nulled handle do, with ncclInvalidArgument).
- A peer that died or aborted makes the survivors' `check_async_error()` raise what CuPy
  raises for ncclRemoteError: `KeyError(6)` (CuPy's `NcclError` knows codes 0-5 only);
  `inject_error(code)` sets any result code, e.g. 7 (ncclInProgress).
- `destroy()` waits for the communicator's work in flight, as ncclCommDestroy does: destroying
  a communicator whose group never completes hangs. Then it says goodbye and waits until
  every peer has said goodbye or its connection closed (a live peer's reader closes its end
  once it has read the goodbye): a weaker wait than recent NCCL's, whose destroy synchronises
  with the peers like a collective and hangs while one that left never closes.

Ranks may be threads of one process or separate processes; nothing is process-global but
the threads. `get_unique_id()` starts a bootstrap root (a listening socket and a thread) in
the calling process and encodes its address in the 128 values of the id, as NCCL's id carries
its bootstrap root's address. Each `NcclCommunicator` sends the root the address it listens
on; once all ranks have arrived the root hands each the table and ends, and the ranks connect
in a full TCP mesh that carries the data. The address the root and the ranks listen on is
`127.0.0.1` unless the environment variable `ELASTIC_NCCL_SIM_ADDRESS` names another (an IPv4
address, for ranks on several hosts).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

# --- result codes, constants, errors ---------------------------------------------------------

ncclSuccess = 0
ncclUnhandledCudaError = 1
ncclSystemError = 2
ncclInternalError = 3
ncclInvalidArgument = 4
ncclInvalidUsage = 5
ncclRemoteError = 6
ncclInProgress = 7

# What CuPy's NcclError can name (NCCL >= 2.0); other codes raise KeyError from its constructor.
_ERROR_NAMES = {
    0: "NCCL_ERROR_SUCCESS",
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
    2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR",
    4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE",
}
_MESSAGES = {
    0: "no error",
    1: "unhandled cuda error",
    2: "unhandled system error",
    3: "internal error",
    4: "invalid argument",
    5: "invalid usage",
    6: "remote process exited or there was a network error",
    7: "NCCL operation in progress",
}


class NcclError(RuntimeError):
    """As CuPy's: `NcclError(status)`; for a status CuPy cannot name (6 and up) the
    constructor itself raises `KeyError(status)`."""

    def __init__(self, status: int) -> None:
        self.status = status
        name = _ERROR_NAMES[status]  # KeyError for codes CuPy does not know, as in CuPy
        super().__init__(f"{name}: {_MESSAGES.get(status, 'unknown result code')}")


# ncclDataType_t and ncclRedOp_t, with NCCL's values.
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM = 0
NCCL_PROD = 1
NCCL_MAX = 2
NCCL_MIN = 3
NCCL_AVG = 4

_DTYPES: dict[int, torch.dtype] = {
    NCCL_INT8: torch.int8, NCCL_UINT8: torch.uint8, NCCL_INT32: torch.int32,
    NCCL_UINT32: torch.uint32, NCCL_INT64: torch.int64, NCCL_UINT64: torch.uint64,
    NCCL_FLOAT16: torch.float16, NCCL_FLOAT32: torch.float32, NCCL_FLOAT64: torch.float64,
    NCCL_BFLOAT16: torch.bfloat16,
}
_REDUCE_OPS = (NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG)

NCCL_UNIQUE_ID_BYTES = 128


def get_version() -> int:
    """The NCCL version this simulator stands for (2.21)."""
    return 22100


# --- streams and events ----------------------------------------------------------------------

# An executor thread with nothing to do for this long ends; the next work starts a new one.
_IDLE_S = 1.0

_stream_handles = itertools.count(1)
_streams: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()
_local = threading.local()


class Stream:
    """A simulated CUDA stream: work runs in order on one executor thread.

    `cuda_stream` is the integer handle that NCCL calls take, as on `torch.cuda.Stream`.
    """

    def __init__(self, name: str = "stream") -> None:
        self.name = name
        self.cuda_stream = next(_stream_handles)
        _streams[self.cuda_stream] = self
        self._cv = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._running = False

    def __repr__(self) -> str:
        return f"<nccl_sim.Stream {self.name} #{self.cuda_stream}>"

    def _submit(self, work: Callable[[], None]) -> None:
        with self._cv:
            self._queue.append(work)
            if self._running:
                self._cv.notify()
                return
            self._running = True
        threading.Thread(target=self._run, name=f"nccl-sim-{self.name}-{self.cuda_stream}",
                         daemon=True).start()

    def _when_reached(self, work: Callable[[], None]) -> None:
        """Runs `work` when the stream has finished everything enqueued so far: now when it is
        idle, else as its next item."""
        with self._cv:
            if self._queue:
                self._queue.append(work)
                self._cv.notify()
                return
        work()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if not self._cv.wait(_IDLE_S) and not self._queue:
                        self._running = False
                        return
                work = self._queue[0]  # stays queued while it runs: the stream is busy
            try:
                work()
            except BaseException:
                logger.exception("work on simulated stream %s failed", self.name)
            del work  # what the work held (tensors, see `hold`) is released here
            with self._cv:
                self._queue.popleft()
                self._cv.notify_all()

    def query(self) -> bool:
        """True when everything enqueued has run."""
        with self._cv:
            return not self._queue

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits until `event` (as last recorded) completed."""
        marker = event._marker
        if marker is not None and not marker.is_set():
            self._submit(marker.wait)

    def wait_stream(self, stream: Stream) -> None:
        """Later work on this stream waits for all work enqueued on `stream` so far."""
        if stream is not self:
            event = Event()
            event.record(stream)
            self.wait_event(event)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.record_event().synchronize()


class Event:
    """A simulated CUDA event. Never recorded, it counts as complete (as in CUDA)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self._marker: threading.Event | None = None

    def record(self, stream: Stream | None = None) -> None:
        marker = threading.Event()
        self._marker = marker
        (stream if stream is not None else current_stream())._when_reached(marker.set)

    def query(self) -> bool:
        marker = self._marker
        return marker is None or marker.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        """Blocks the host until the event completed, or `timeout` seconds (a simulator
        extension: a CUDA event cannot be waited on with a timeout); returns `query()`."""
        marker = self._marker
        return marker is None or marker.wait(timeout)

    def wait(self, stream: Stream | None = None) -> None:
        """Makes `stream` (default: the current stream) wait for this event."""
        (stream if stream is not None else current_stream()).wait_event(self)


def current_stream() -> Stream:
    """This thread's current stream: the one set by `stream(...)`, else the thread's own
    default stream."""
    selected = getattr(_local, "stream", None)
    if selected is not None:
        return selected
    default = getattr(_local, "default", None)
    if default is None:
        default = _local.default = Stream(f"default-{threading.current_thread().name}")
    return default


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    """Makes `s` this thread's current stream inside the block (as `torch.cuda.stream`)."""
    previous = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield s
    finally:
        _local.stream = previous


def launch(kernel: Callable[[], None], on: Stream | None = None) -> None:
    """Enqueues `kernel` on a stream (default: the current one): it runs after the work
    enqueued there before, and work enqueued after it waits for it."""
    (on if on is not None else current_stream())._submit(kernel)


def hold(objects: Sequence[Any], on: Stream) -> None:
    """Keeps `objects` alive until `on` reaches this point: what `Tensor.record_stream` does
    for the CUDA caching allocator, so that memory a stream still reads or writes is not
    freed under it."""
    held = tuple(objects)
    on._when_reached(lambda: held and None)


def _stream_of(handle: int | Stream) -> Stream:
    if isinstance(handle, Stream):
        return handle
    if not handle:
        return current_stream()
    found = _streams.get(int(handle))
    if found is None:
        raise NcclError(ncclUnhandledCudaError)
    return found


# --- unique id and bootstrap -----------------------------------------------------------------

_MAGIC = b"ESIM"
_HELLO = struct.Struct("!16sIIH")  # token, rank, ndev, length of the address that follows
_PEER_HELLO = struct.Struct("!16sI")  # token, rank: the first bytes on a mesh connection

BOOTSTRAP_TIMEOUT_S = float(os.environ.get("ELASTIC_NCCL_SIM_BOOTSTRAP_S", "120"))
"""How long a communicator's construction waits for the other ranks, and a bootstrap root
for all of them (NCCL's blocking init waits as long as its bootstrap does)."""


def _address() -> str:
    return os.environ.get("ELASTIC_NCCL_SIM_ADDRESS", "127.0.0.1")


def get_unique_id() -> tuple[int, ...]:
    """A new id: 128 signed byte values (as CuPy returns) carrying the address of a bootstrap
    root started in this process. The root serves one communicator: it collects every rank's
    address and, once all `ndev` have arrived, sends each the full table, then ends (or ends
    after `BOOTSTRAP_TIMEOUT_S` without them)."""
    listener = socket.create_server((_address(), 0))
    listener.settimeout(BOOTSTRAP_TIMEOUT_S)
    token = secrets.token_bytes(16)
    threading.Thread(target=_serve_bootstrap, args=(listener, token), name="nccl-sim-bootstrap",
                     daemon=True).start()
    host, port = listener.getsockname()[:2]
    raw = _MAGIC + socket.inet_aton(host) + struct.pack("!H", port) + token
    raw = raw.ljust(NCCL_UNIQUE_ID_BYTES, b"\0")
    return tuple(b - 256 if b > 127 else b for b in raw)


def _serve_bootstrap(listener: socket.socket, token: bytes) -> None:
    arrived: dict[int, tuple[socket.socket, bytes]] = {}
    ndev = 0
    try:
        with listener:
            while not ndev or len(arrived) < ndev:
                conn, _ = listener.accept()
                try:
                    conn.settimeout(BOOTSTRAP_TIMEOUT_S)
                    their_token, rank, size, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                    address = bytes(_recv_exact(conn, n))
                except (OSError, EOFError):
                    conn.close()
                    continue
                if their_token != token or rank in arrived or (ndev and size != ndev) or rank >= size:
                    conn.close()
                    continue
                ndev = size
                arrived[rank] = (conn, address)
            table = b"".join(struct.pack("!H", len(a)) + a for _, a in
                             (arrived[r] for r in range(ndev)))
            for conn, _ in arrived.values():
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack("!I", len(table)) + table)
    except OSError:  # no rank came for too long: the id is abandoned
        pass
    finally:
        for conn, _ in arrived.values():
            conn.close()


def _decode_id(uid: Sequence[int]) -> tuple[str, int, bytes]:
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise NcclError(ncclInvalidArgument)
    raw = bytes(int(x) & 0xFF for x in uid)
    if raw[:4] != _MAGIC:
        raise NcclError(ncclInvalidArgument)
    return socket.inet_ntoa(raw[4:8]), struct.unpack("!H", raw[8:10])[0], raw[10:26]


# --- groups ----------------------------------------------------------------------------------

_SEND, _RECV, _ALLREDUCE, _BCAST = "send", "recv", "allreduce", "bcast"


@dataclass(eq=False)
class _Op:
    kind: str
    send_ptr: int
    recv_ptr: int
    nbytes: int
    peer: int = -1  # send/recv: the peer; bcast: the root
    seq: int = 0  # per pair (send/recv) or per communicator (collectives)
    dtype: torch.dtype = torch.uint8
    count: int = 0
    op: int = NCCL_SUM
    contributions: dict[int, bytearray] = field(default_factory=dict)


def _group_state() -> list[tuple[NcclCommunicator, Stream, _Op]]:
    ops = getattr(_local, "group_ops", None)
    if ops is None:
        ops = _local.group_ops = []
        _local.group_depth = 0
    return ops


def groupStart() -> None:  # CuPy's name
    """Starts (or nests) a group on this thread: calls until the matching `groupEnd` are
    issued together."""
    _group_state()
    _local.group_depth += 1


def groupEnd() -> None:  # CuPy's name
    """Ends a group; at the outermost level, enqueues its operations as one unit of work per
    (communicator, stream)."""
    ops = _group_state()
    if _local.group_depth == 0:
        raise NcclError(ncclInvalidUsage)
    _local.group_depth -= 1
    if _local.group_depth:
        return
    _local.group_ops = []
    units: dict[tuple[int, int], list[_Op]] = {}
    owners: dict[tuple[int, int], tuple[NcclCommunicator, Stream]] = {}
    for comm, s, op in ops:
        key = (id(comm), id(s))
        units.setdefault(key, []).append(op)
        owners[key] = (comm, s)
    for key, unit in units.items():
        comm, s = owners[key]
        comm._submit(s, unit)


# --- the communicator ------------------------------------------------------------------------

_HEADER = struct.Struct("!BQQ")  # kind, sequence number, payload bytes
_DATA, _ACK, _COLL, _BYE = 1, 2, 3, 4
# Longest an executor sleeps between checks of abort and errors (they also wake it at once).
_SLICE_S = 0.05
# Payloads up to this size go out in one write with their header.
_SMALL = 1 << 16


class _GiveUp(Exception):
    """The communicator was aborted or broke: the running group stops where it is."""


class NcclCommunicator:
    """One rank of a simulated NCCL communicator: `NcclCommunicator(ndev, uid, rank)` blocks
    until all `ndev` ranks have called it with the same id."""

    def __init__(self, ndev: int, commId: Sequence[int], rank: int) -> None:
        host, port, token = _decode_id(commId)
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(ncclInvalidArgument)
        self._rank, self._size, self._token = rank, ndev, token
        self._cv = threading.Condition()
        self._mem_lock = threading.Lock()  # user memory is touched under it, never after abort
        self._aborted = False
        self._gone = False  # abort() or destroy() was called: the handle is null, as in CuPy
        self._closing = False
        self._error = ncclSuccess
        self._error_detail = ""
        self._inflight = 0
        self._sent = [0] * ndev  # sends enqueued to each peer
        self._received = [0] * ndev  # receives enqueued from each peer
        self._collectives = 0
        self._inbox: list[dict[int, bytearray]] = [{} for _ in range(ndev)]
        self._acked: list[set[int]] = [set() for _ in range(ndev)]
        self._coll_inbox: dict[tuple[int, int], bytearray] = {}
        self._bye: set[int] = set()
        self._hung_up: set[int] = set()  # peers whose connection closed
        self._socks: dict[int, socket.socket] = {}
        self._send_locks: dict[int, threading.Lock] = {}
        try:
            self._connect(host, port, token)
        except BaseException:
            for s in self._socks.values():
                s.close()
            raise
        # The thread reading each peer's socket; it ends once that peer left or the connection
        # broke, having set the remote error if it is one (tests join it to know that).
        self._readers: dict[int, threading.Thread] = {}
        for peer, s in self._socks.items():
            self._readers[peer] = threading.Thread(target=self._read_loop, args=(peer, s),
                                                   name=f"nccl-sim-r{rank}-from{peer}", daemon=True)
            self._readers[peer].start()

    def _connect(self, host: str, port: int, token: bytes) -> None:
        """Meets the other ranks through the bootstrap root, then builds the full mesh: each
        rank connects to every lower rank and accepts every higher one."""
        seconds = BOOTSTRAP_TIMEOUT_S
        with socket.create_server((_address(), 0)) as listener:
            listener.settimeout(seconds)
            mine = "{}:{}".format(*listener.getsockname()[:2]).encode()
            try:
                with socket.create_connection((host, port), timeout=seconds) as root:
                    root.settimeout(seconds)
                    root.sendall(_HELLO.pack(token, self._rank, self._size, len(mine)) + mine)
                    # Blocks until every rank has arrived.
                    (n,) = struct.unpack("!I", _recv_exact(root, 4))
                    table = bytes(_recv_exact(root, n))
                addresses, at = [], 0
                while at < len(table):
                    (k,) = struct.unpack("!H", table[at:at + 2])
                    addresses.append(table[at + 2:at + 2 + k].decode())
                    at += 2 + k
                for peer in range(self._rank):
                    peer_host, peer_port = addresses[peer].rsplit(":", 1)
                    s = socket.create_connection((peer_host, int(peer_port)), timeout=seconds)
                    s.sendall(_PEER_HELLO.pack(token, self._rank))
                    self._add_peer(peer, s)
                while len(self._socks) < self._size - 1:
                    s, _ = listener.accept()
                    s.settimeout(seconds)
                    their_token, peer = _PEER_HELLO.unpack(_recv_exact(s, _PEER_HELLO.size))
                    if their_token != token or not self._rank < peer < self._size or peer in self._socks:
                        s.close()
                        continue
                    self._add_peer(peer, s)
            except (OSError, EOFError, ValueError, IndexError) as e:
                raise NcclError(ncclSystemError) from e

    def _add_peer(self, peer: int, s: socket.socket) -> None:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socks[peer] = s
        self._send_locks[peer] = threading.Lock()

    # --- CuPy's API ---

    def rank_id(self) -> int:
        self._check_handle()
        return self._rank

    def size(self) -> int:
        self._check_handle()
        return self._size

    def device_id(self) -> int:
        self._check_handle()
        return 0

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue(_Op(_SEND, sendbuf, 0, count * _size_of(datatype), peer), stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue(_Op(_RECV, 0, recvbuf, count * _size_of(datatype), peer), stream)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        if op not in _REDUCE_OPS:
            raise NcclError(ncclInvalidArgument)
        self._enqueue(_Op(_ALLREDUCE, sendbuf, recvbuf, count * _size_of(datatype),
                          dtype=_DTYPES[datatype], count=count, op=op), stream)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        self._enqueue(_Op(_BCAST, sendbuff, recvbuff, count * _size_of(datatype), root), stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def check_async_error(self) -> None:
        """Raises the communicator's asynchronous error: `NcclError` for codes 1-5,
        `KeyError(code)` beyond (what CuPy raises); on an aborted or destroyed communicator,
        ncclInvalidArgument (CuPy then passes a null handle)."""
        self._check_handle()
        if self._error != ncclSuccess:
            raise NcclError(self._error)

    def abort(self) -> None:
        """ncclCommAbort: stops the running group and all later work of this communicator at
        once; once it returned, no user memory is read or written. Peers see a remote error.
        A no-op on an aborted or destroyed communicator."""
        with self._cv:
            if self._gone:
                return
            self._gone = self._aborted = self._closing = True
            self._cv.notify_all()
        with self._mem_lock:
            pass  # a copy under way finishes; none starts after this
        for s in self._socks.values():
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes readers and senders; readers close

    def destroy(self) -> None:
        """ncclCommDestroy: waits for the communicator's work in flight (forever if a group
        never completes), then says goodbye to the peers. A no-op once aborted or destroyed."""
        with self._cv:
            if self._gone:
                return
            while self._inflight:
                self._cv.wait()
            self._gone = self._closing = True
        for peer, s in self._socks.items():
            with self._send_locks[peer], contextlib.suppress(OSError):
                s.sendall(_HEADER.pack(_BYE, 0, 0))
                s.shutdown(socket.SHUT_WR)  # the reader closes once the peer has left too
        with self._cv:  # every peer's goodbye, or its connection closed (see the module)
            while not all(p in self._bye or p in self._hung_up for p in self._socks):
                self._cv.wait()

    # --- simulator extensions ---

    def inject_error(self, code: int, detail: str = "injected") -> None:
        """Sets this communicator's asynchronous error to `code` (any NCCL result code), as
        if NCCL had detected it: running and later groups give up. The first error sticks."""
        with self._cv:
            self._fail(code, detail)

    @property
    def busy(self) -> bool:
        """Whether groups of this communicator are enqueued or running."""
        with self._cv:
            return self._inflight > 0

    # --- enqueueing ---

    def _check_handle(self) -> None:
        if self._gone:
            raise NcclError(ncclInvalidArgument)

    def _enqueue(self, op: _Op, stream_handle: int | Stream) -> None:
        s = _stream_of(stream_handle)
        with self._cv:
            self._check_handle()
            if self._error != ncclSuccess:
                raise NcclError(self._error)
            if op.kind in (_SEND, _RECV):
                if not 0 <= op.peer < self._size:
                    raise NcclError(ncclInvalidArgument)
                counters = self._sent if op.kind == _SEND else self._received
                op.seq = counters[op.peer]
                counters[op.peer] += 1
            else:
                if op.kind == _BCAST and not 0 <= op.peer < self._size:
                    raise NcclError(ncclInvalidArgument)
                op.seq = self._collectives
                self._collectives += 1
        if getattr(_local, "group_depth", 0):
            _group_state().append((self, s, op))
        else:
            self._submit(s, [op])

    def _submit(self, s: Stream, unit: list[_Op]) -> None:
        with self._cv:
            self._inflight += 1
        s._submit(lambda: self._run_unit(unit))

    # --- execution (on a stream's executor thread) ---

    def _run_unit(self, unit: list[_Op]) -> None:
        try:
            self._execute(unit)
        except _GiveUp:
            pass
        except Exception as e:
            logger.exception("simulated NCCL group failed")
            with self._cv:
                self._fail(ncclInternalError, f"simulator: {e!r}")
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()

    def _fail(self, code: int, detail: str) -> None:
        """Sets the asynchronous error (the first one sticks). Call with `_cv` held."""
        if self._error == ncclSuccess:
            self._error, self._error_detail = code, detail
        self._cv.notify_all()

    def _stop_if_broken(self) -> None:
        """Call with `_cv` held."""
        if self._aborted or self._error != ncclSuccess:
            raise _GiveUp

    def _execute(self, unit: list[_Op]) -> None:
        with self._cv:
            self._stop_if_broken()
        others = [p for p in range(self._size) if p != self._rank]
        # Post: sends and collective contributions leave now (NCCL's proxy moves them; their
        # completion waits for the receivers below).
        for op in unit:
            if op.kind == _SEND:
                self._transmit(op.peer, _DATA, op.seq, self._read(op.send_ptr, op.nbytes))
            elif op.kind == _ALLREDUCE or (op.kind == _BCAST and op.peer == self._rank):
                data = self._read(op.send_ptr, op.nbytes)
                op.contributions[self._rank] = data
                for peer in others:
                    self._transmit(peer, _COLL, op.seq, data)
            elif op.kind == _BCAST:  # a receiving rank says it arrived
                for peer in others:
                    self._transmit(peer, _COLL, op.seq, b"")
        remaining = list(unit)
        while remaining:
            ready: list[tuple[_Op, bytearray | None]] = []
            with self._cv:
                self._stop_if_broken()
                for op in remaining:
                    if op.kind == _RECV:
                        if op.seq in self._inbox[op.peer]:
                            ready.append((op, self._inbox[op.peer].pop(op.seq)))
                    elif op.kind == _SEND:
                        if op.seq in self._acked[op.peer]:
                            self._acked[op.peer].discard(op.seq)
                            ready.append((op, None))
                    elif all((op.seq, p) in self._coll_inbox for p in others):
                        for p in others:
                            op.contributions[p] = self._coll_inbox.pop((op.seq, p))
                        ready.append((op, None))
                if not ready:
                    self._fail_if_peer_left(remaining, others)
                    self._cv.wait(_SLICE_S)
                    continue
            for op, data in ready:
                self._finish(op, data)
                remaining.remove(op)

    def _fail_if_peer_left(self, remaining: list[_Op], others: list[int]) -> None:
        """A peer that destroyed its communicator will never send again: an operation still
        waiting for it fails. (What it sent before arrived before its goodbye.) Call with `_cv`
        held."""
        for op in remaining:
            if op.kind in (_SEND, _RECV):
                needed = [op.peer]
            else:  # the peers whose contribution has not arrived
                needed = [p for p in others if (op.seq, p) not in self._coll_inbox]
            gone = [p for p in needed if p in self._bye]
            if gone:
                self._fail(ncclRemoteError, f"rank {gone[0]} left the communicator")
                raise _GiveUp

    def _finish(self, op: _Op, data: bytearray | None) -> None:
        if op.kind == _RECV:
            assert data is not None
            if len(data) != op.nbytes:
                with self._cv:
                    self._fail(ncclInvalidUsage, f"received {len(data)} bytes from rank {op.peer} "
                               f"into a receive of {op.nbytes}")
                raise _GiveUp
            self._write(op.recv_ptr, data)
            self._transmit(op.peer, _ACK, op.seq, b"")
        elif op.kind == _ALLREDUCE:
            sizes = {len(c) for c in op.contributions.values()}
            if sizes != {op.nbytes}:
                with self._cv:
                    self._fail(ncclInvalidUsage, "allReduce of different sizes across ranks")
                raise _GiveUp
            self._write(op.recv_ptr, _reduce([op.contributions[r] for r in range(self._size)],
                                             op.dtype, op.op))
        elif op.kind == _BCAST and op.peer != self._rank:
            data = op.contributions[op.peer]
            if len(data) != op.nbytes:
                with self._cv:
                    self._fail(ncclInvalidUsage, "broadcast of different sizes across ranks")
                raise _GiveUp
            self._write(op.recv_ptr, data)
        elif op.kind == _BCAST and op.send_ptr != op.recv_ptr:
            self._write(op.recv_ptr, op.contributions[self._rank])

    def _read(self, ptr: int, nbytes: int) -> bytearray:
        data = bytearray(nbytes)
        if nbytes:
            with self._mem_lock:
                if self._aborted:
                    raise _GiveUp
                ctypes.memmove((ctypes.c_char * nbytes).from_buffer(data), ptr, nbytes)
        return data

    def _write(self, ptr: int, data: bytearray) -> None:
        if data:
            with self._mem_lock:
                if self._aborted:
                    raise _GiveUp
                ctypes.memmove(ptr, (ctypes.c_char * len(data)).from_buffer(data), len(data))

    def _transmit(self, peer: int, kind: int, seq: int, payload: bytes | bytearray) -> None:
        header = _HEADER.pack(kind, seq, len(payload))
        with self._send_locks[peer]:
            if self._closing:
                raise _GiveUp
            try:
                s = self._socks[peer]
                if len(payload) <= _SMALL:
                    s.sendall(header + payload)
                else:
                    s.sendall(header)
                    s.sendall(payload)
            except OSError as e:
                with self._cv:
                    if not self._closing:
                        self._fail(ncclRemoteError, f"sending to rank {peer}: {e}")
                raise _GiveUp from e

    # --- the reader of one peer's socket ---

    def _read_loop(self, peer: int, s: socket.socket) -> None:
        try:
            while True:
                kind, seq, n = _HEADER.unpack(_recv_exact(s, _HEADER.size))
                payload = _recv_exact(s, n) if n else bytearray()
                with self._cv:
                    if kind == _DATA:
                        self._inbox[peer][seq] = payload
                    elif kind == _ACK:
                        self._acked[peer].add(seq)
                    elif kind == _COLL:
                        self._coll_inbox[(seq, peer)] = payload
                    elif kind == _BYE:
                        self._bye.add(peer)
                    self._cv.notify_all()
        except (OSError, EOFError):
            pass
        with self._cv:
            self._hung_up.add(peer)
            if not self._closing and peer not in self._bye:
                self._fail(ncclRemoteError, f"rank {peer} died or aborted")
            self._cv.notify_all()
        with self._send_locks[peer]:
            s.close()


def _recv_exact(s: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise EOFError("connection closed")
        got += k
    return buf


def _size_of(datatype: int) -> int:
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        raise NcclError(ncclInvalidArgument)
    return dtype.itemsize


def _reduce(parts: list[bytearray], dtype: torch.dtype, op: int) -> bytearray:
    """Reduces the contributions in rank order (every rank computes the same bits)."""
    if not parts[0]:
        return bytearray()
    tensors = [torch.frombuffer(p, dtype=dtype) for p in parts]
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op in (NCCL_SUM, NCCL_AVG):
            acc.add_(t)
        elif op == NCCL_PROD:
            acc.mul_(t)
        elif op == NCCL_MAX:
            torch.maximum(acc, t, out=acc)
        else:
            torch.minimum(acc, t, out=acc)
    if op == NCCL_AVG:
        acc = acc.div_(len(parts)) if acc.is_floating_point() else acc.div_(len(parts), rounding_mode="floor")
    out = bytearray(acc.numel() * acc.element_size())
    ctypes.memmove((ctypes.c_char * len(out)).from_buffer(out), acc.data_ptr(), len(out))
    return out


def wait_idle(comm: NcclCommunicator, timeout: float) -> bool:
    """Test helper: waits up to `timeout` seconds until no group of `comm` is enqueued or
    running; returns whether that happened."""
    deadline = time.monotonic() + timeout
    with comm._cv:
        while comm._inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            comm._cv.wait(left)
    return True


def wait_error(comm: NcclCommunicator, timeout: float) -> bool:
    """Test helper: waits up to `timeout` seconds until `comm` has an asynchronous error (the
    one `check_async_error` raises); returns whether it has one."""
    with comm._cv:
        return comm._cv.wait_for(lambda: comm._error != ncclSuccess, timeout)
