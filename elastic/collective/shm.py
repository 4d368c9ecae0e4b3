"""Shared memory between the ranks of one host: point-to-point transfers, and the stages of
the direct allreduce (`elastic.collective.direct`).

Each rank maps one segment in `/dev/shm` per rank of its host. When every rank of a generation
runs on the same host, sends and receives bypass loopback TCP: a segment holds a byte ring per
sender, and a transfer is a copy into the receiver's ring and a copy out of it. Every segment
also holds two buffers for the direct allreduce and a stage word that its rank advances as it
goes through it. When the ranks span hosts (or `CollectiveConfig.simulated_hosts` says they
do), each rank maps only the segments of its own host's ranks, without rings: point-to-point
transfers then go over the network, and shared memory serves the direct allreduce inside each
host.

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

Cleanup: a rank unlinks its segment as soon as every peer has mapped it, so a killed process
leaves nothing behind; a segment orphaned between creation and that point (its creator was
killed during the rendezvous) is removed by the next rendezvous on the host.

Supported on Linux x86_64 (total store order: the plain stores of ring positions and stages
are seen in program order, after the payload copies). Elsewhere, or when `/dev/shm` lacks
room, or no two ranks share a host, every rank agrees to fall back to the backend's own
transfers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import platform
import re
import select
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^elastic-shm-(\d+)-[0-9a-f]{32}$")
_FUTEX_SYSCALL = {"x86_64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1

# Segment layout. Words written by different processes sit on different cache lines.
_NONCE_BYTES = 16
_DOORBELL = 64  # u32, written by peers and by abort()
_STAGE = 128  # u64, written by the owner: how far it is in the direct allreduce
_FAILED = 192  # u32, written by the owner: nonzero once it gave up on the generation
_SLEEPING = 196  # u32, written by the owner: nonzero while it sleeps on its doorbell
_SEGMENT_HEADER = 256  # then two direct-allreduce buffers, then the rings
_TAIL = 0  # u64 stream position written by the sender
_HEAD = 64  # u64 stream position written by the receiver
_CHANNEL_HEADER = 128
_MESSAGE_HEADER = 16  # (tag: i64, nbytes: i64) in front of every payload

# Longest sleep between checks of the peers' processes while nothing moves.
_LIVENESS_S = 0.05
# How long a waiter keeps checking (yielding its core between checks) before it sleeps on its
# doorbell. Waking a sleeper costs the waker a context switch or more (measured 12 us per
# wake on 2 cores), so a waiter that is about to be served saves its peers that cost.
_SPIN_S = 0.0002


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    def __init__(self) -> None:
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._number = ctypes.c_long(_FUTEX_SYSCALL[platform.machine()])

    def wait(self, word: ctypes.c_uint32, expected: int, timeout_s: float) -> None:
        """Sleeps while `word == expected`, at most `timeout_s` (releases the GIL)."""
        ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        self._syscall(self._number, ctypes.byref(word), ctypes.c_long(_FUTEX_WAIT),
                      ctypes.c_long(expected), ctypes.byref(ts), None, ctypes.c_long(0))

    def wake(self, word: ctypes.c_uint32) -> None:
        self._syscall(self._number, ctypes.byref(word), ctypes.c_long(_FUTEX_WAKE),
                      ctypes.c_long(0x7FFFFFFF), None, None, ctypes.c_long(0))


def supported() -> str | None:
    """None when this host can use the transport, else why not."""
    if platform.system() != "Linux" or platform.machine() not in _FUTEX_SYSCALL:
        return f"shared-memory transfers need Linux x86_64, not {platform.system()} {platform.machine()}"
    if not os.path.isdir(_SHM_DIR):
        return f"{_SHM_DIR} does not exist"
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is unavailable"
    return None


def _host_identity() -> str:
    """Equal on two processes exactly when they share a kernel, /dev/shm and pid numbers."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    namespaces = [os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "ipc", "mnt")]
    return f"{boot}/{'/'.join(map(str, namespaces))}/{os.stat(_SHM_DIR).st_dev}"


def _remove_orphans() -> None:
    """Unlinks segments whose creating process is gone (killed during a rendezvous): only
    regular files of our name pattern that this user owns."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except PermissionError:
            pass  # another user's live process


_OFFER_KEYS = frozenset({"name", "nonce", "pid", "size"})


def _parse(raw: bytes, keys: frozenset[str]) -> dict:
    """A peer's host key or offer, or a refusal when it is not one (every rank then agrees on
    the backend's own transfers)."""
    try:
        offer = json.loads(raw)
    except ValueError:
        offer = None
    if isinstance(offer, dict) and ("reason" in offer or keys <= offer.keys()):
        return offer
    return {"reason": "a malformed shared-memory offer"}


def _host_key(rank: int, world_size: int, simulated_hosts: int | None) -> str:
    """This rank's host identity; with `simulated_hosts` (tests, benchmarks) also the block
    of ranks it is placed in, so that blocks on one machine act as separate hosts."""
    key = _host_identity()
    if simulated_hosts is not None:
        key += f"#block{rank * min(simulated_hosts, world_size) // world_size}"
    return key


def _agree_on_hosts(rank: int, world_size: int, store: dist.Store, key: str | None,
                    reason: str | None) -> list[list[int]] | None:
    """Every rank publishes its host key; all read all and reach the same grouping: the ranks
    of each host in rank order, hosts ordered by their first rank. None (on every rank) when
    some rank cannot use shared memory or no two ranks share a host."""
    store.set(f"shm/host/{rank}", json.dumps({"reason": reason} if reason else {"host": key}))
    keys = [_parse(store.get(f"shm/host/{q}"), frozenset({"host"})) for q in range(world_size)]
    refusal = next((k["reason"] for k in keys if "reason" in k), None)
    groups: dict[str, list[int]] = {}
    for q, k in enumerate(keys):
        groups.setdefault(str(k.get("host")), []).append(q)
    if refusal is None and all(len(g) == 1 for g in groups.values()):
        refusal = "no two ranks share a host"
    if refusal is not None:
        logger.info("shared-memory transfers off for this generation: %s", refusal)
        return None
    return list(groups.values())


def _map_peer_segment(name: object, size: int) -> mmap.mmap:
    """Maps the segment a peer offered, trusting nothing in the offer but a name to check.

    The name must be one of ours (so it has no `/` and no `..`); it is opened relative to
    /dev/shm without following a link, and must be a regular file with one link, owned by
    this user, mode 0600 and exactly `size` bytes. Anything else is refused before a byte is
    written (a forged offer could otherwise name any file this process can write).

    Raises:
        OSError: the segment is refused or cannot be mapped.
    """
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise OSError(f"refused segment {name!r}: not a name of ours")
    directory = os.open(_SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        st = os.fstat(fd)
        problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"{st.st_nlink} links" if st.st_nlink != 1 else
                   f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else
                   f"mode {stat.S_IMODE(st.st_mode):o}" if stat.S_IMODE(st.st_mode) != 0o600 else
                   f"{st.st_size} bytes, not {size}" if st.st_size != size else None)
        if problem is not None:
            raise OSError(f"refused segment {name!r}: {problem}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class _Segment:
    """One rank's mapped segment: its doorbell, its stage and failure words, its two buffers
    for the direct allreduce, and one inbound ring per peer that sends to it through rings."""

    def __init__(self, mm: mmap.mmap, channels: int, capacity: int, chunk: int) -> None:
        self.mm = mm
        self.doorbell = ctypes.c_uint32.from_buffer(mm, _DOORBELL)
        self.stage = ctypes.c_uint64.from_buffer(mm, _STAGE)
        self.failed = ctypes.c_uint32.from_buffer(mm, _FAILED)
        self.sleeping = ctypes.c_uint32.from_buffer(mm, _SLEEPING)
        self.buffers = [torch.frombuffer(mm, dtype=torch.uint8, count=chunk,
                                         offset=_SEGMENT_HEADER + i * chunk) for i in (0, 1)]
        base = _SEGMENT_HEADER + 2 * chunk
        self.rings = [_Ring(mm, base + i * (_CHANNEL_HEADER + capacity), capacity)
                      for i in range(channels)]

    @staticmethod
    def size(channels: int, capacity: int, chunk: int) -> int:
        return _SEGMENT_HEADER + 2 * chunk + channels * (_CHANNEL_HEADER + capacity)


class _Ring:
    """A single-producer single-consumer byte stream of `capacity` bytes."""

    def __init__(self, mm: mmap.mmap, offset: int, capacity: int) -> None:
        self.tail = ctypes.c_uint64.from_buffer(mm, offset + _TAIL)
        self.head = ctypes.c_uint64.from_buffer(mm, offset + _HEAD)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=capacity,
                                     offset=offset + _CHANNEL_HEADER)
        self.capacity = capacity

    def put(self, position: int, src: torch.Tensor) -> None:
        start = position % self.capacity
        first = min(src.numel(), self.capacity - start)
        self.data[start : start + first].copy_(src[:first])
        if first < src.numel():
            self.data[: src.numel() - first].copy_(src[first:])

    def get(self, position: int, dst: torch.Tensor) -> None:
        start = position % self.capacity
        first = min(dst.numel(), self.capacity - start)
        dst[:first].copy_(self.data[start : start + first])
        if first < dst.numel():
            dst[first:].copy_(self.data[: dst.numel() - first])


class _Handle:
    """A `Pending` the transport completes: waiting on it drives the transport."""

    __slots__ = ("_transport", "done", "error")

    def __init__(self, transport: SharedMemoryTransport) -> None:
        self._transport = transport
        self.done = False
        self.error: BaseException | None = None

    def is_done(self) -> bool:
        if not self.done:
            self._transport.progress_if_idle()
        return self.done

    def wait(self, timeout: float) -> bool:
        return self._transport.drive(self, timeout)

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Transfer(_Handle):
    """One posted send or receive; also its `Pending` handle."""

    __slots__ = ("data", "moved", "started", "tag")

    def __init__(self, transport: SharedMemoryTransport, data: torch.Tensor, tag: int) -> None:
        super().__init__(transport)
        self.data = data  # flat uint8 view of the caller's tensor
        self.tag = tag
        self.started = False  # message header written / read
        self.moved = 0  # payload bytes copied so far


@dataclass(frozen=True)
class SharedMemoryLinks:
    """The mapped segments of one generation's ranks on this host (see `connect`).

    `hosts` lists the global ranks of every host, in rank order, hosts ordered by their first
    rank; `segments` and `pids` belong to this host's ranks (`hosts[host]`), in that order.
    Rings (`capacity` bytes each) exist only when every rank is on this host."""

    rank: int
    world_size: int
    hosts: list[list[int]]
    host: int
    segments: list[_Segment]
    pids: list[int]
    capacity: int
    chunk: int


def _create_segment(path: str, size: int) -> tuple[mmap.mmap | None, str | None]:
    """Creates and maps this rank's segment; (None, why) when /dev/shm refuses it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS later
            return mmap.mmap(fd, size), None
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"cannot create a {size}-byte segment in {_SHM_DIR}: {e}"


def _map_local(rank: int, local: list[int], offers: list[dict], own: mmap.mmap,
               layout: tuple[int, int, int]) -> tuple[list[_Segment], str]:
    """Maps the segment of every rank of this host; returns them and "ok" or what failed."""
    size = _Segment.size(*layout)
    segments = []
    for q, offer in zip(local, offers, strict=True):
        if q == rank:
            segments.append(_Segment(own, *layout))
            continue
        if "reason" in offer:
            return segments, f"rank {q} cannot offer a segment: {offer['reason']}"
        try:
            mm = _map_peer_segment(offer.get("name"), size)
            if mm[:_NONCE_BYTES] != bytes.fromhex(str(offer.get("nonce"))):
                mm.close()
                raise OSError(f"segment of rank {q} holds another nonce")
            segments.append(_Segment(mm, *layout))
        except (OSError, ValueError) as e:  # a refused segment or a malformed offer
            return segments, f"rank {rank} cannot map the segment of rank {q}: {e}"
    return segments, "ok"


def connect(rank: int, world_size: int, store: dist.Store, capacity: int, chunk: int = 4 << 20,
            simulated_hosts: int | None = None) -> SharedMemoryLinks | None:
    """Maps the shared-memory segments of the ranks that share this host, if all ranks can.

    Every rank calls this with the generation's store and reaches the same answer: links when
    every rank could map the segment of every rank of its host and at least two ranks share a
    host, else None (the caller then uses the backend's own transfers). The segments carry
    `capacity`-byte rings only when all ranks share this host (point-to-point transfers between
    hosts go over the network), and two `chunk`-byte buffers for the direct allreduce.
    """
    reason = supported()
    key = _host_key(rank, world_size, simulated_hosts) if reason is None else None
    if reason is None:
        _remove_orphans()
    hosts = _agree_on_hosts(rank, world_size, store, key, reason)
    if hosts is None:
        return None
    host = next(i for i, ranks in enumerate(hosts) if rank in ranks)
    local = hosts[host]
    layout = (world_size - 1 if len(local) == world_size else 0, capacity, chunk & ~63)
    size = _Segment.size(*layout)
    name = f"elastic-shm-{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(_SHM_DIR, name)
    try:
        own, problem = _create_segment(path, size)
        nonce = os.urandom(_NONCE_BYTES)
        if own is not None:
            own[:_NONCE_BYTES] = nonce
        store.set(f"shm/offer/{rank}", json.dumps({"reason": problem} if problem else {
            "name": name, "nonce": nonce.hex(), "pid": os.getpid(), "size": size}))
        offers = [_parse(store.get(f"shm/offer/{q}"), _OFFER_KEYS) for q in local]
        segments, mapped = ([], problem) if own is None else _map_local(rank, local, offers, own, layout)
        store.set(f"shm/mapped/{rank}", mapped or "?")
        # Everyone has mapped every segment of its host (or given up) once all have answered.
        answers = [store.get(f"shm/mapped/{q}").decode() for q in range(world_size)]
        failed = next((a for a in answers if a != "ok"), None)
        if failed is not None:
            logger.warning("shared-memory transfers off for this generation: %s", failed)
            return None
        return SharedMemoryLinks(rank, world_size, hosts, host, segments,
                                 [int(o["pid"]) for o in offers], capacity, layout[2])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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
        self._futex = _Futex()
        own = links.segments[self.local_rank]
        self._bell = own.doorbell
        self._bell_count = 0
        self._stage_word = own.stage
        self._failed_word = own.failed
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
        self._header = torch.empty(2, dtype=torch.int64)
        self._open_rings(links)
        self._pidfds: list[tuple[int, int]] = []
        self._poll = select.poll()
        for q, pid in zip(self.local, links.pids, strict=True):
            if q != self.rank and pid != os.getpid():
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # already gone: found by the first liveness check
                    self._broken = RuntimeError(f"rank {q} (pid {pid}) exited")
                    continue
                self._pidfds.append((q, fd))
                self._poll.register(fd, select.POLLIN)
        self._checked = time.monotonic()

    def _open_rings(self, links: SharedMemoryLinks) -> None:
        n, r = self.world_size, self.rank
        rings = n == len(self.local)
        own = links.segments[r] if rings else None
        # _outbound[q]: my ring in q's segment; _inbound[q]: q's ring in mine.
        self._outbound = {q: links.segments[q].rings[r if r < q else r - 1]
                          for q in range(n) if q != r and rings}
        self._inbound = {q: own.rings[q if q < r else q - 1] for q in range(n) if q != r and own is not None}
        self._sent = {q: 0 for q in self._outbound}  # my tail in each outbound ring
        self._received = {q: 0 for q in self._inbound}  # my head in each inbound ring
        self._sends: dict[int, deque[_Transfer]] = {q: deque() for q in self._outbound}
        self._recvs: dict[int, deque[_Transfer]] = {q: deque() for q in self._inbound}

    # --- posting ------------------------------------------------------------------------

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        if self._broken is not None:
            raise RuntimeError(f"shared-memory transport failed earlier: {self._broken}")
        if not self._outbound:
            return [_Watched(p, self) for p in self._native.exchange(sends, recvs, tag)]
        pending: list[Pending] = []
        for queues, pairs in ((self._recvs, recvs), (self._sends, sends)):
            for tensor, peer in pairs:
                if peer not in queues:
                    raise ValueError(f"peer {peer} is not another rank of {self.world_size}")
                if tensor.numel():
                    transfer = _Transfer(self, tensor.reshape(-1).view(torch.uint8), tag)
                    queues[peer].append(transfer)
                    pending.append(transfer)
        # Start copying at once, so the peer finds data when it first looks.
        self.progress_if_idle()
        return pending

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        return self._native.allreduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        return self._native.broadcast(tensor, src)

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
        for _, fd in self._pidfds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds = []
        # The segments are unlinked already; the mappings go with the last reference.
        self._outbound, self._inbound, self._segments, self._views = {}, {}, [], {}
        self._peers, self._peer_bells = [], {}

    def host_group(self) -> SharedMemoryTransport:
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

    def stage(self, value: int) -> Pending:
        """Publishes that this rank reached `value` (which only grows) and returns a handle
        that is done once every rank of this host has reached it."""
        self._stage_word.value = value
        for bell in self._peer_bells.values():
            self._ring(*bell)
        stage = _Stage(self, value)
        self._stage = stage
        return stage

    # --- progress -----------------------------------------------------------------------

    def progress_if_idle(self) -> None:
        """Moves what can move without waiting, unless another thread is at it."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._aborted:
                    self._progress()
            finally:
                self._lock.release()

    def drive(self, item: _Handle, timeout: float) -> bool:
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
            for peer, queue in self._sends.items():
                if queue and self._send_some(peer, queue):
                    moved = True
                    self._ring(*self._peer_bells[peer])
            for peer, queue in self._recvs.items():
                if queue and self._receive_some(peer, queue):
                    moved = True
                    self._ring(*self._peer_bells[peer])
        except _Mismatch as e:
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
        if self._broken is None:
            failed = next((q for q, s in self._peers if s.failed.value), None)
            if failed is not None:
                self._broken = RuntimeError(f"rank {failed} of this host gave up on the generation")
        now = time.monotonic()
        if self._broken is None and now - self._checked >= _LIVENESS_S:
            self._checked = now
            self._check_peers()
        return self._broken

    def _send_some(self, peer: int, queue: deque[_Transfer]) -> bool:
        ring = self._outbound[peer]
        start = self._sent[peer]

        def header(transfer: _Transfer, position: int) -> None:
            self._header[0], self._header[1] = transfer.tag, transfer.data.numel()
            ring.put(position, self._header.view(torch.uint8))

        tail = _advance(queue, start, ring.capacity - (start - ring.head.value), header, ring.put)
        if tail == start:
            return False
        self._sent[peer] = tail
        ring.tail.value = tail  # after the payload: the receiver reads up to here
        return True

    def _receive_some(self, peer: int, queue: deque[_Transfer]) -> bool:
        ring = self._inbound[peer]
        start = self._received[peer]

        def header(transfer: _Transfer, position: int) -> None:
            ring.get(position, self._header.view(torch.uint8))
            tag, nbytes = int(self._header[0]), int(self._header[1])
            if tag != transfer.tag or nbytes != transfer.data.numel():
                raise _Mismatch(
                    f"rank {self.rank} expected {transfer.data.numel()} bytes with tag "
                    f"{transfer.tag} from rank {peer} but its next message has {nbytes} "
                    f"bytes with tag {tag}; transfers between two ranks match in order"
                )

        head = _advance(queue, start, ring.tail.value - start, header, ring.get)
        if head == start:
            return False
        self._received[peer] = head
        ring.head.value = head  # the sender may reuse the space up to here
        return True

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

    def _check_peers(self) -> None:
        if self._broken is None and self._pidfds:
            ready = self._poll.poll(0)
            if ready:
                fd = ready[0][0]
                rank = next(q for q, f in self._pidfds if f == fd)
                self._broken = RuntimeError(f"rank {rank} of the generation exited")
        if self._broken is not None:
            self._fail_all(self._broken)

    def _fail_all(self, error: BaseException) -> None:
        for queues in (self._sends, self._recvs):
            for queue in queues.values():
                while queue:
                    transfer = queue.popleft()
                    transfer.error = error
                    transfer.done = True
        if self._stage is not None:
            self._stage.error = error
            self._stage.done = True
            self._stage = None


class _Stage(_Handle):
    """A handle on every local rank reaching one stage of the direct allreduce."""

    __slots__ = ("value",)

    def __init__(self, transport: SharedMemoryTransport, value: int) -> None:
        super().__init__(transport)
        self.value = value


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


def _advance(queue: deque[_Transfer], position: int, room: int,
             header: Callable[[_Transfer, int], None],
             payload: Callable[[int, torch.Tensor], None]) -> int:
    """Moves the queued transfers of one ring, in order, through `room` bytes from stream
    `position` (free space for a sender, unread bytes for a receiver): each message header,
    then as much payload as fits. Returns the new stream position."""
    while queue:
        transfer = queue[0]
        if not transfer.started:
            if room < _MESSAGE_HEADER:
                break
            header(transfer, position)
            position += _MESSAGE_HEADER
            room -= _MESSAGE_HEADER
            transfer.started = True
        count = min(transfer.data.numel() - transfer.moved, room)
        if count:
            payload(position, transfer.data[transfer.moved : transfer.moved + count])
            position += count
            room -= count
            transfer.moved += count
        if transfer.moved < transfer.data.numel():
            break
        transfer.done = True
        queue.popleft()
    return position


class _Mismatch(Exception):
    pass
