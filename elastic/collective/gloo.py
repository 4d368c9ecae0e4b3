"""The gloo backend: torch's ProcessGroupGloo on CPU tensors.

Gloo's collective works complete through a future, but its send/recv works only complete
inside a blocking `wait()` (their `is_completed()` stays false until then, measured on torch
2.13). So point-to-point works are waited on by two helper threads per transport (one for
sends, one for receives) that flag each handle as it finishes; callers block on that flag and
`abort()` releases them at once. The helpers of an aborted transport stay blocked in gloo
until a peer closes its end or gloo's own timeout expires, without touching the next
generation.

Process exit after an abort: if gloo wakes such a helper while CPython 3.11 is finalizing,
the thread cannot retake the GIL and the process ends in std::terminate. A process that
aborted a communicator with operations in flight should therefore end with `os._exit` (Ray
worker processes are ended by Ray, which does not run finalization).
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp

_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

# Process groups abandoned by abort() while operations were pending. Destroying one then tears
# down gloo's context under a thread still blocked in it, and the process dies with
# std::terminate at exit (measured). Kept alive until the process ends; one per recovery.
_ABANDONED: list[dist.ProcessGroupGloo] = []


def _abandon(pg: dist.ProcessGroupGloo) -> None:
    """Keeps `pg` for good: in `_ABANDONED`, and with a reference nobody owns, so that not
    even the interpreter's teardown at exit destroys it (a list's references are dropped
    then: a thread still blocked in the group, such as a broadcast a host peer gave up on,
    ended the process with std::terminate, measured)."""
    _ABANDONED.append(pg)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


class _GlooPending:
    """A gloo work handle whose completion is signalled by an event."""

    __slots__ = ("_done", "_error", "_work")

    def __init__(self, work: dist.Work) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    # --- called by gloo's future callback or a waiter thread ---

    def finish(self) -> None:
        try:
            self._work.wait()
        except BaseException as e:
            self._error = e
        self._done.set()

    def finish_future(self, future: torch.futures.Future) -> None:
        # Inside the callback the future is complete; waiting on the work here would
        # deadlock gloo's thread.
        try:
            future.value()
        except BaseException as e:
            self._error = e
        self._done.set()

    def wake(self) -> None:
        self._done.set()


class _Waiter:
    """A daemon thread that blocks in `work.wait()` for queued handles, in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_GlooPending | None] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, handle: _GlooPending) -> None:
        self._queue.put(handle)

    def stop(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while (handle := self._queue.get()) is not None:
            handle.finish()


class GlooTransport(Transport):
    """Point-to-point and native collectives over one ProcessGroupGloo.

    Args:
        rank: this rank.
        world_size: number of ranks.
        store: the generation's rendezvous store.
        address: the local address gloo listens on.
        timeout: gloo's own per-operation timeout (a backstop; the communicator's deadline
            and abort normally act first).
    """

    name = "gloo"

    def __init__(
        self, rank: int, world_size: int, store: dist.Store, address: str, timeout: timedelta
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        # Blocks until every rank has connected (full mesh) or `timeout` passes.
        self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            store, rank, world_size, options
        )
        self._senders = _Waiter(f"elastic-gloo-send-r{rank}")
        self._receivers = _Waiter(f"elastic-gloo-recv-r{rank}")
        self._lock = threading.Lock()
        self._outstanding: set[_GlooPending] = set()
        self._failed = False  # an operation failed without an abort (`fail`)

    def _group(self) -> dist.ProcessGroupGloo:
        assert self._pg is not None, "transport used after close"
        return self._pg

    def _track(self, handle: _GlooPending) -> _GlooPending:
        with self._lock:
            self._outstanding = {h for h in self._outstanding if not h.is_done()}
            self._outstanding.add(handle)
        return handle

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        pg = self._group()
        pending: list[Pending] = []
        # Recvs first so that a peer's data lands in a posted buffer without queueing.
        for tensor, peer in recvs:
            if tensor.numel():
                handle = self._track(_GlooPending(pg.recv([_bytes(tensor)], peer, tag)))
                self._receivers.submit(handle)
                pending.append(handle)
        for tensor, peer in sends:
            if tensor.numel():
                handle = self._track(_GlooPending(pg.send([_bytes(tensor)], peer, tag)))
                self._senders.submit(handle)
                pending.append(handle)
        return pending

    def _collective(self, work: dist.Work) -> list[Pending]:
        handle = self._track(_GlooPending(work))
        work.get_future().add_done_callback(handle.finish_future)
        return [handle]

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        options = dist.AllreduceOptions()
        options.reduceOp = _NATIVE_OPS[op]
        return self._collective(self._group().allreduce([tensor], options))

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        return self._collective(self._group().broadcast([tensor], options))

    def abort(self) -> None:
        # Deliberately not pg.abort(): it does not wake a pending recv (measured) and may
        # block. Wake our callers instead and drop the group; gloo threads that still hold it
        # give up when its own timeout expires.
        with self._lock:
            outstanding, self._outstanding = self._outstanding, set()
        for handle in outstanding:
            handle.wake()
        self._senders.stop()
        self._receivers.stop()
        if self._pg is not None:
            _abandon(self._pg)
        self._pg = None

    def fail(self) -> None:
        self._failed = True  # a helper thread may still be blocked in the group (`close`)

    def close(self) -> None:
        # After an abort the group is kept already. After an operation failed (a timeout, a
        # reset connection: no abort) or with one outstanding, a helper thread may still be
        # blocked in it: kept too (see _ABANDONED). After a clean run nothing is, and it is
        # released now (before: kept until the process ended, a group of W - 1 connections
        # and its threads leaked at every resize).
        with self._lock:
            busy = self._failed or any(not h.is_done() for h in self._outstanding)
        self._senders.stop()
        self._receivers.stop()
        if self._pg is not None and busy:
            _abandon(self._pg)
        self._pg = None


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A byte view of a contiguous tensor, so that any dtype travels unchanged."""
    return tensor.reshape(-1).view(torch.uint8)
