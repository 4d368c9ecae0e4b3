"""Shared memory between the ranks of one host: point-to-point transfers, and the stages of
the direct allreduce (`elastic.collective.direct`).

Each rank maps one segment in `/dev/shm` per rank of its host (`elastic.collective.shm_segments`).
When every rank of a generation runs on the same host, sends and receives bypass loopback TCP: a
segment holds a byte ring per sender (`elastic.collective.shm_ring`), and a transfer is a copy
into the receiver's ring and a copy out of it. Every segment also holds two buffers for the
direct allreduce and a stage word that its rank advances as it goes through it. When the ranks
span hosts (or `CollectiveConfig.simulated_hosts` says they do), each rank maps only the
segments of its own host's ranks, without rings: point-to-point transfers then go over the
network, and shared memory serves the direct allreduce inside each host.

There are no helper threads: the thread that waits on a handle moves the bytes of every
outstanding transfer of this rank (as MPI's progress engine does), so nothing is handed between
threads and nothing keeps writing into a caller's tensor after `abort()`.

Waking: every rank has a doorbell word in its segment. A peer that moved bytes or advanced a
stage a rank may wait for writes a value to that rank's doorbell that nobody else ever writes
(its own counter combined with its rank), and wakes it with a futex if the rank said it sleeps;
a waiter reads its doorbell before looking at the rings and stages and sleeps only while the
doorbell still holds that value, so a wake-up cannot be lost. Before sleeping, a waiter checks
again for `_SPIN_S`, yielding its core in between: a waker pays for waking a sleeper.
`abort()` changes the rank's own doorbell.

Failure: each rank holds a pidfd of every peer process of its host and checks them while it
waits, so a killed peer fails the waits of the survivors within `_LIVENESS_S` even if nobody
aborts them. A rank that gives up (abort, timeout, error) sets its failure word, which fails
its host peers' waits at once, including their waits on network transfers.

Supported on Linux x86_64 (total store order: the plain stores of ring positions and stages
are seen in program order, after the payload copies). Elsewhere, or when `/dev/shm` lacks
room, or no two ranks share a host, every rank agrees to fall back to the backend's own
transfers.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence

import torch

from elastic.collective.shm_ring import Handle, Mismatch, Receiver, Sender, Transfer
from elastic.collective.shm_segments import Futex, PeerProcesses, SharedMemoryLinks, connect, supported

# Reached as `shm._Segment` and `shm._host_identity` by tests/unit/test_rendezvous_auth.py.
from elastic.collective.shm_segments import Segment as _Segment  # noqa: F401
from elastic.collective.shm_segments import host_identity as _host_identity  # noqa: F401
from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp

__all__ = ["SharedMemoryLinks", "SharedMemoryTransport", "connect", "supported"]

# Longest sleep between checks of the peers' processes while nothing moves.
_LIVENESS_S = 0.05
# How long a waiter keeps checking (yielding its core between checks) before it sleeps on its
# doorbell. Waking a sleeper costs the waker a context switch or more (measured 12 us per
# wake on 2 cores), so a waiter that is about to be served saves its peers that cost.
_SPIN_S = 0.0002


class SharedMemoryTransport(Transport):
    """Shared memory between the ranks of this host; native collectives through `native`.

    When every rank is on this host, point-to-point transfers go through byte rings: transfers
    between a pair of ranks match in the order they are posted, and a receive whose tag or size
    differs from the matching send fails with an error naming both. When the ranks span hosts,
    point-to-point transfers go through `native` (all of them: a ring step that waited on a
    network transfer while a shared-memory one had to be pushed could deadlock), and shared
    memory serves the direct and hierarchical allreduce only (`stage`, `buffers`).
    """

    def __init__(self, links: SharedMemoryLinks, native: Transport) -> None:
        self.rank = links.rank
        self.world_size = links.world_size
        self.hosts = links.hosts
        self.host = links.host
        self.local = links.hosts[links.host]  # global ranks of this host
        self.local_rank = self.local.index(self.rank)
        self.chunk = links.chunk
        self.name = "shared_memory" if len(self.local) == self.world_size else "shared_memory+gloo"
        self._native = native
        self._futex = Futex()
        own = links.segments[self.local_rank]
        self._bell = own.doorbell
        self._bell_count = 0
        self._stage_word = own.stage
        self._descriptor = own.descriptor
        self._failed_word = own.failed
        self.region = links.region
        self._regions = [s.region[: links.region] for s in links.segments]
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._peers = [(q, s) for q, s in zip(self.local, links.segments, strict=True) if q != self.rank]
        self._peer_bells = {q: (s.doorbell, s.sleeping) for q, s in self._peers}
        self._sleeping = own.sleeping
        self._fence = threading.Lock()
        self._views: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._segments = links.segments  # keeps the mappings alive
        self._sequence = 0
        self._stage: _Stage | None = None
        self._lock = threading.Lock()
        self._aborted = False
        self._broken: BaseException | None = None
        self._open_rings(links)
        self._processes = PeerProcesses(self.rank, self.local, links.pids)
        if self._processes.gone is not None:
            self._broken = RuntimeError(self._processes.gone)
        self._checked = time.monotonic()

    def _open_rings(self, links: SharedMemoryLinks) -> None:
        n, r = self.world_size, self.rank
        rings = n == len(self.local)
        own = links.segments[r] if rings else None
        # _outbound[q]: my end of my ring in q's segment; _inbound[q]: of q's ring in mine.
        self._outbound = {q: Sender(links.segments[q].rings[r if r < q else r - 1])
                          for q in range(n) if q != r and rings}
        self._inbound = {q: Receiver(own.rings[q if q < r else q - 1], r, q)
                         for q in range(n) if q != r and own is not None}

    # --- posting ------------------------------------------------------------------------

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        self._check_unbroken()
        if not self._outbound:
            return [_Watched(p, self) for p in self._native.exchange(sends, recvs, tag)]
        pending: list[Pending] = []
        for ends, pairs in ((self._inbound, recvs), (self._outbound, sends)):
            for tensor, peer in pairs:
                pending.extend(self._queue(ends, peer, Transfer(self, tensor, tag)))
        # Start copying at once, so the peer finds data when it first looks.
        self.progress_if_idle()
        return pending

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int,
                    scratch: torch.Tensor | None = None) -> list[Pending]:
        """Reduces straight out of `src`'s byte ring as the bytes arrive (`scratch` unused);
        through `native` (into scratch) when the ranks span hosts. As for every transfer here,
        only a thread waiting on a handle of this transport moves bytes, and none does once
        the transport is aborted."""
        self._check_unbroken()
        if not self._inbound:
            return super().recv_reduce(tensor, src, op, tag, scratch)
        pending = self._queue(self._inbound, src, Transfer(self, tensor, tag, op))
        self.progress_if_idle()
        return pending

    def _queue(self, ends: dict[int, Sender] | dict[int, Receiver], peer: int,
               transfer: Transfer) -> list[Pending]:
        if peer not in ends:
            raise ValueError(f"peer {peer} is not another rank of {self.world_size}")
        if not transfer.data.numel():
            return []
        ends[peer].queue.append(transfer)
        return [transfer]

    # The collectives that go through the native transport (a generation's state broadcast,
    # barriers, the 'native' allreduce) are watched as its transfers are: a host peer that
    # gave up alive fails them within the liveness check (before, they waited out the
    # native transport's timeout, the collective timeout of minutes).
    def _check_unbroken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"shared-memory transport failed earlier: {self._broken}")

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        self._check_unbroken()
        return [_Watched(p, self) for p in self._native.allreduce(tensor, op)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        self._check_unbroken()
        return [_Watched(p, self) for p in self._native.broadcast(tensor, src)]

    def abort(self) -> None:
        self._aborted = True
        self.fail()
        self._bell.value ^= 1 << 31  # a sleeper wakes on any change of its bell
        self._futex.wake(self._bell)
        self._native.abort()

    def fail(self) -> None:
        # Peers of this host waiting on this rank (a stage, a watched network transfer) give
        # up at once instead of at their timeout.
        self._failed_word.value = 1
        for bell in self._peer_bells.values():
            self._ring(*bell)

    def close(self) -> None:
        self._aborted = True
        self._native.close()
        self._processes.close()
        # The segments are unlinked already; the mappings go with the last reference.
        self._outbound, self._inbound, self._segments, self._views = {}, {}, [], {}
        self._peers, self._peer_bells = [], {}
        self.region, self._regions, self._scratch = 0, [], {}

    def host_group(self) -> SharedMemoryTransport:  # a `HostGroup`
        return self

    # --- the direct allreduce's shared state ----------------------------------------------

    def buffers(self, sequence: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every local rank's buffer number `sequence % 2`, in local rank order, as `dtype`
        (`chunk` bytes each)."""
        key = (sequence % 2, dtype)
        views = self._views.get(key)
        if views is None:
            views = [s.buffers[key[0]].view(dtype) for s in self._segments]
            self._views[key] = views
        return views

    def next_sequence(self) -> int:
        """Numbers the chunks of the direct allreduce; every local rank counts the same."""
        self._sequence += 1
        return self._sequence

    def stage(self, value: int, descriptor: tuple[int, int] | None = None) -> Pending:
        """Publishes that this rank reached `value` (which only grows) and returns a handle
        that is done once every rank of this host has reached it.

        With `descriptor` (two integers saying which buffer this rank's allreduce reduces:
        `(0, 0)` for a caller's tensor, `(offset + 1, bytes)` for a registered buffer), the
        handle fails, and with it the transport, unless every rank of this host published the
        same one with this stage: ranks that disagree would otherwise read and write each
        other's memory in different patterns. Only a stage no rank can pass before every
        rank reached the one before may carry a descriptor (the first stage of an
        allreduce), so that what a peer's words hold when this rank checks them is theirs for
        this stage."""
        if descriptor is not None:
            self._descriptor[0], self._descriptor[1] = descriptor
        self._stage_word.value = value
        for bell in self._peer_bells.values():
            self._ring(*bell)
        stage = _Stage(self, value, descriptor)
        self._stage = stage
        return stage

    # --- registered buffers ---------------------------------------------------------------

    def shared_buffers(self, sizes: dict[torch.dtype, int]) -> dict[torch.dtype, torch.Tensor] | None:
        """Buffers of `sizes[dtype]` elements each, laid out in order in this rank's region
        (each at a multiple of 64 bytes), or None when they do not fit. Every rank of the host
        that asks for the same sizes gets the same offsets, so that an allreduce of one of
        them reduces it where it lies (`registered`). A later call returns the same memory:
        a caller takes buffers again only once it is done with the previous ones."""
        offset, views = 0, {}
        for dtype, numel in sizes.items():
            size = numel * torch.empty(0, dtype=dtype).element_size()
            if offset + size > self.region:
                return None
            views[dtype] = self._regions[self.local_rank][offset : offset + size].view(dtype)
            offset = -(-(offset + size) // 64) * 64
        return views

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor of `numel` elements, kept for the next call (its pages are not
        faulted in again on every allreduce); only one user at a time."""
        kept = self._scratch.get(dtype)
        if kept is None or kept.numel() < numel:
            kept = self._scratch[dtype] = torch.empty(numel, dtype=dtype)
        return kept[:numel]

    def registered(self, flat: torch.Tensor) -> int | None:
        """The byte offset of `flat` (contiguous) in this rank's region, if it lies there."""
        if not self.region or flat.device.type != "cpu":
            return None
        base = self._regions[self.local_rank].data_ptr()
        start = flat.data_ptr() - base
        if 0 <= start and start + flat.numel() * flat.element_size() <= self.region \
                and start % flat.element_size() == 0:
            return start
        return None

    def registered_views(self, offset: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every local rank's `numel` elements of `dtype` at byte `offset` of its region, in
        local rank order (this rank's is the registered buffer itself)."""
        size = numel * torch.empty(0, dtype=dtype).element_size()
        return [r[offset : offset + size].view(dtype) for r in self._regions]

    # --- progress -----------------------------------------------------------------------

    def progress_if_idle(self) -> None:
        """Moves what can move without waiting, unless another thread is at it."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._aborted:
                    self._progress()
            finally:
                self._lock.release()

    def drive(self, item: Handle, timeout: float) -> bool:
        """Moves bytes until `item` is done, the transport is aborted or `timeout` passes;
        returns whether it is done."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(0.0, timeout)):
            return item.done
        spin_until = 0.0
        try:
            while not item.done and not self._aborted:
                bell = self._bell.value
                if self._progress():
                    spin_until = 0.0
                    continue
                now = time.monotonic()
                if now - self._checked >= _LIVENESS_S:
                    self._check_peers()
                    self._checked = now
                    continue
                remaining = deadline - now
                if remaining <= 0:
                    break
                if not spin_until:
                    spin_until = now + _SPIN_S
                if now < spin_until:
                    os.sched_yield()
                    continue
                self._sleeping.value = 1
                self._futex.wait(self._bell, bell, min(remaining, _LIVENESS_S))
                self._sleeping.value = 0
        finally:
            self._lock.release()
        return item.done

    def _progress(self) -> bool:
        """One pass over every ring with work and the pending stage; True if anything moved."""
        if self._broken is not None:
            self._fail_all(self._broken)
            return True
        moved = self._settle() if self._stage is not None else False
        try:
            for peer, sender in self._outbound.items():
                if sender.queue and sender.push():
                    moved = True
                    self._ring(*self._peer_bells[peer])
            for peer, receiver in self._inbound.items():
                if receiver.queue and receiver.pull():
                    moved = True
                    self._ring(*self._peer_bells[peer])
        except Mismatch as e:
            self._broken = RuntimeError(str(e))
            self._fail_all(self._broken)
            return True
        return moved

    def _settle(self) -> bool:
        """Finishes the pending stage if every local peer reached it; fails it (and the
        transport) if a peer gave up. True if it finished."""
        stage = self._stage
        assert stage is not None
        if all(s.stage.value >= stage.value for _, s in self._peers):
            theirs = next(((q, tuple(s.descriptor)) for q, s in self._peers
                           if stage.descriptor is not None
                           and tuple(s.descriptor) != stage.descriptor), None)
            if theirs is not None:
                self._broken = RuntimeError(
                    f"rank {theirs[0]} of this host allreduces another buffer than rank "
                    f"{self.rank} (descriptors {theirs[1]} and {stage.descriptor}): every rank "
                    "must pass a registered buffer at the same offset, or none")
                self._fail_all(self._broken)
                return True
            stage.done = True
            self._stage = None
            return True
        problem = self.local_failure()
        if problem is not None:
            self._fail_all(problem)
            return True
        return False

    def local_failure(self) -> BaseException | None:
        """Why this host's group is broken (a local peer gave up or exited), if it is.
        Checks the peers' processes at most every `_LIVENESS_S`."""
        self._peer_gave_up()
        now = time.monotonic()
        if self._broken is None and now - self._checked >= _LIVENESS_S:
            self._checked = now
            self._check_peers()
        return self._broken

    def _ring(self, bell: ctypes.c_uint32, sleeping: ctypes.c_uint32) -> None:
        # A value no other rank ever writes, so a waiter that read the old value sees a change.
        self._bell_count += 1
        bell.value = (self._bell_count * len(self.local) + self.local_rank) & 0xFFFFFFFF
        # The waiter stores its sleeping flag and then (in the kernel, after a full barrier)
        # reads its bell; here the bell is stored and then the flag read. A full barrier
        # between the two (an uncontended lock is a locked instruction on x86) means that
        # either the waiter sees the new bell and does not sleep, or this sees its flag.
        with self._fence:
            pass
        if sleeping.value:
            self._futex.wake(bell)

    def _peer_gave_up(self) -> None:
        if self._broken is None:
            failed = next((q for q, s in self._peers if s.failed.value), None)
            if failed is not None:
                self._broken = RuntimeError(f"rank {failed} of this host gave up on the generation")

    def _check_peers(self) -> None:
        # A peer that gave up alive (its abort, timeout or error) fails point-to-point waits
        # too, not only the stages' (before: they waited out their own timeout).
        self._peer_gave_up()
        if self._broken is None:
            rank = self._processes.exited()
            if rank is not None:
                self._broken = RuntimeError(f"rank {rank} of the generation exited")
        if self._broken is not None:
            self._fail_all(self._broken)

    def _fail_all(self, error: BaseException) -> None:
        for end in (*self._outbound.values(), *self._inbound.values()):
            end.fail(error)
        if self._stage is not None:
            self._stage.error = error
            self._stage.done = True
            self._stage = None


class _Stage(Handle):
    """A handle on every local rank reaching one stage of the direct allreduce (with the same
    descriptor, when it carries one)."""

    __slots__ = ("descriptor", "value")

    def __init__(self, transport: SharedMemoryTransport, value: int,
                 descriptor: tuple[int, int] | None = None) -> None:
        super().__init__(transport)
        self.value = value
        self.descriptor = descriptor


class _Watched:
    """A network transfer of a rank whose host peers may give up meanwhile: waiting on it also
    watches them, so that one failure on a host fails the whole host's ranks promptly."""

    __slots__ = ("_error", "_inner", "_transport")

    def __init__(self, inner: Pending, transport: SharedMemoryTransport) -> None:
        self._inner = inner
        self._transport = transport
        self._error: BaseException | None = None

    def is_done(self) -> bool:
        return self._error is not None or self._inner.is_done()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if self._inner.wait(max(0.0, min(remaining, _LIVENESS_S))):
                return True
            self._error = self._transport.local_failure()
            if self._error is not None or remaining <= 0 or self._transport._aborted:
                return self._error is not None

    def check(self) -> None:
        if self._error is not None:
            raise self._error
        self._inner.check()
