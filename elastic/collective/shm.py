"""Shared-memory point-to-point transfers between the ranks of one host.

When every rank of a generation runs on the same host, sends and receives bypass loopback TCP:
each rank maps one segment in `/dev/shm` holding a byte ring per sender, and a transfer is a
copy into the receiver's ring and a copy out of it. There are no helper threads: the thread
that waits on a handle moves the bytes of every outstanding transfer of this rank (as MPI's
progress engine does), so nothing is handed between threads and nothing keeps writing into a
caller's tensor after `abort()`.

Waking: every rank has a doorbell word in its segment. A peer that moved bytes a rank is
waiting for writes a value to that rank's doorbell that nobody else ever writes (its own
counter combined with its rank) and wakes it with a futex; a waiter reads its doorbell before
looking at the rings and sleeps only while the doorbell still holds that value, so a wake-up
cannot be lost. `abort()` rings the rank's own doorbell.

Peer death: each rank holds a pidfd of every peer process and checks them while it waits, so a
killed peer fails the waits of the survivors within `_LIVENESS_S` even if nobody aborts them.

Cleanup: a rank unlinks its segment as soon as every peer has mapped it, so a killed process
leaves nothing behind; a segment orphaned between creation and that point (its creator was
killed during the rendezvous) is removed by the next rendezvous on the host.

Supported on Linux x86_64 (total store order: the plain stores of ring positions are seen in
program order, after the payload copies). Elsewhere, or when the ranks span hosts or
`/dev/shm` lacks room, every rank agrees to fall back to the backend's own transfers.
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
_SEGMENT_HEADER = 128
_TAIL = 0  # u64 stream position written by the sender
_HEAD = 64  # u64 stream position written by the receiver
_CHANNEL_HEADER = 128
_MESSAGE_HEADER = 16  # (tag: i64, nbytes: i64) in front of every payload

# Longest sleep between checks of the peers' processes while nothing moves.
_LIVENESS_S = 0.05


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


_OFFER_KEYS = frozenset({"host", "name", "nonce", "pid", "size"})


def _parse_offer(raw: bytes) -> dict:
    """A peer's offer, or a refusal when it is not one (every rank then agrees on gloo)."""
    try:
        offer = json.loads(raw)
    except ValueError:
        offer = None
    if isinstance(offer, dict) and ("reason" in offer or _OFFER_KEYS <= offer.keys()):
        return offer
    return {"reason": "a malformed shared-memory offer"}


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
    """One rank's mapped segment: its doorbell and one inbound ring per peer."""

    def __init__(self, mm: mmap.mmap, world_size: int, capacity: int) -> None:
        self.mm = mm
        self.doorbell = ctypes.c_uint32.from_buffer(mm, _DOORBELL)
        self.rings = [_Ring(mm, _SEGMENT_HEADER + i * (_CHANNEL_HEADER + capacity), capacity)
                      for i in range(world_size - 1)]

    @staticmethod
    def size(world_size: int, capacity: int) -> int:
        return _SEGMENT_HEADER + (world_size - 1) * (_CHANNEL_HEADER + capacity)


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


class _Transfer:
    """One posted send or receive; also its `Pending` handle."""

    __slots__ = ("_transport", "data", "done", "error", "moved", "started", "tag")

    def __init__(self, transport: SharedMemoryTransport, data: torch.Tensor, tag: int) -> None:
        self._transport = transport
        self.data = data  # flat uint8 view of the caller's tensor
        self.tag = tag
        self.started = False  # message header written / read
        self.moved = 0  # payload bytes copied so far
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


@dataclass(frozen=True)
class SharedMemoryLinks:
    """The mapped segments of one generation on one host (see `connect`)."""

    rank: int
    world_size: int
    segments: list[_Segment]
    pids: list[int]


def connect(rank: int, world_size: int, store: dist.Store, capacity: int) -> SharedMemoryLinks | None:
    """Maps a shared-memory ring from every rank to every other, if all ranks can.

    Every rank calls this with the generation's store and reaches the same answer: links when
    all ranks share this host and each could map every segment, else None (the caller then
    uses the backend's own transfers).
    """
    reason = supported()
    size = _Segment.size(world_size, capacity)
    name = f"elastic-shm-{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(_SHM_DIR, name)
    own: mmap.mmap | None = None
    nonce = os.urandom(_NONCE_BYTES)
    try:
        if reason is None:
            _remove_orphans()
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS later
                    own = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                own[:_NONCE_BYTES] = nonce
            except OSError as e:
                reason = f"cannot create a {size}-byte segment in {_SHM_DIR}: {e}"
        mine = {"reason": reason} if reason else {
            "host": _host_identity(), "name": name, "nonce": nonce.hex(), "pid": os.getpid(),
            "size": size,
        }
        store.set(f"shm/offer/{rank}", json.dumps(mine))
        offers = [_parse_offer(store.get(f"shm/offer/{q}")) for q in range(world_size)]
        refusal = next((o["reason"] for o in offers if "reason" in o), None)
        if refusal is None and len({(o["host"], o["size"]) for o in offers}) != 1:
            refusal = "the ranks are on different hosts"
        if refusal is not None:
            logger.info("shared-memory transfers off for this generation: %s", refusal)
            return None
        assert own is not None
        segments: list[_Segment | None] = [None] * world_size
        mapped = "ok"
        for q, offer in enumerate(offers):
            if q == rank:
                segments[q] = _Segment(own, world_size, capacity)
                continue
            try:
                mm = _map_peer_segment(offer.get("name"), size)
                if mm[:_NONCE_BYTES] != bytes.fromhex(str(offer.get("nonce"))):
                    mm.close()
                    raise OSError(f"segment of rank {q} holds another nonce")
                segments[q] = _Segment(mm, world_size, capacity)
            except (OSError, ValueError) as e:  # a refused segment or a malformed offer
                mapped = f"rank {rank} cannot map the segment of rank {q}: {e}"
                break
        store.set(f"shm/mapped/{rank}", mapped)
        # Everyone has mapped every segment (or given up) once all have answered.
        answers = [store.get(f"shm/mapped/{q}").decode() for q in range(world_size)]
        failed = next((a for a in answers if a != "ok"), None)
        if failed is not None:
            logger.warning("shared-memory transfers off for this generation: %s", failed)
            return None
        return SharedMemoryLinks(rank, world_size, segments, [int(o["pid"]) for o in offers])  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class SharedMemoryTransport(Transport):
    """Point-to-point transfers through shared memory; native collectives through `native`.

    Transfers between a pair of ranks match in the order they are posted; a receive whose tag
    or size differs from the matching send fails with an error naming both.
    """

    name = "shared_memory"

    def __init__(self, links: SharedMemoryLinks, native: Transport) -> None:
        self.rank = links.rank
        self.world_size = links.world_size
        self._native = native
        self._futex = _Futex()
        own = links.segments[self.rank]
        self._bell = own.doorbell
        self._bell_count = 0
        n, r = self.world_size, self.rank
        # _outbound[q]: my ring in q's segment; _inbound[q]: q's ring in mine.
        self._outbound = {q: links.segments[q].rings[r if r < q else r - 1]
                          for q in range(n) if q != r}
        self._inbound = {q: own.rings[q if q < r else q - 1] for q in range(n) if q != r}
        self._peer_bells = {q: links.segments[q].doorbell for q in range(n) if q != r}
        self._sent = {q: 0 for q in self._outbound}  # my tail in each outbound ring
        self._received = {q: 0 for q in self._inbound}  # my head in each inbound ring
        self._sends: dict[int, deque[_Transfer]] = {q: deque() for q in self._outbound}
        self._recvs: dict[int, deque[_Transfer]] = {q: deque() for q in self._inbound}
        self._segments = links.segments  # keeps the mappings alive
        self._lock = threading.Lock()
        self._aborted = False
        self._broken: BaseException | None = None
        self._header = torch.empty(2, dtype=torch.int64)
        self._pidfds: list[tuple[int, int]] = []
        self._poll = select.poll()
        for q, pid in enumerate(links.pids):
            if q != r and pid != os.getpid():
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # already gone: found by the first liveness check
                    self._broken = RuntimeError(f"rank {q} (pid {pid}) exited")
                    continue
                self._pidfds.append((q, fd))
                self._poll.register(fd, select.POLLIN)
        self._checked = time.monotonic()

    # --- posting ------------------------------------------------------------------------

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        if self._broken is not None:
            raise RuntimeError(f"shared-memory transport failed earlier: {self._broken}")
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
        self._ring(self._bell)
        self._native.abort()

    def close(self) -> None:
        self._aborted = True
        self._native.close()
        for _, fd in self._pidfds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds = []
        # The segments are unlinked already; the mappings go with the last reference.
        self._outbound, self._inbound, self._segments = {}, {}, []

    # --- progress -----------------------------------------------------------------------

    def progress_if_idle(self) -> None:
        """Moves what can move without waiting, unless another thread is at it."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._aborted:
                    self._progress()
            finally:
                self._lock.release()

    def drive(self, transfer: _Transfer, timeout: float) -> bool:
        """Moves bytes until `transfer` is done, the transport is aborted or `timeout` passes;
        returns whether it is done."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(0.0, timeout)):
            return transfer.done
        try:
            while not transfer.done and not self._aborted:
                bell = self._bell.value
                if self._progress():
                    continue
                now = time.monotonic()
                if now - self._checked >= _LIVENESS_S:
                    self._check_peers()
                    self._checked = now
                    continue
                remaining = deadline - now
                if remaining <= 0:
                    break
                self._futex.wait(self._bell, bell, min(remaining, _LIVENESS_S))
        finally:
            self._lock.release()
        return transfer.done

    def _progress(self) -> bool:
        """One pass over every ring with work; True if anything moved."""
        if self._broken is not None:
            self._fail_all(self._broken)
            return True
        moved = False
        try:
            for peer, queue in self._sends.items():
                if queue and self._send_some(peer, queue):
                    moved = True
                    self._ring(self._peer_bells[peer])
            for peer, queue in self._recvs.items():
                if queue and self._receive_some(peer, queue):
                    moved = True
                    self._ring(self._peer_bells[peer])
        except _Mismatch as e:
            self._broken = RuntimeError(str(e))
            self._fail_all(self._broken)
            return True
        return moved

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

    def _ring(self, bell: ctypes.c_uint32) -> None:
        # A value no other rank ever writes, so a waiter that read the old value sees a change.
        self._bell_count += 1
        bell.value = (self._bell_count * self.world_size + self.rank) & 0xFFFFFFFF
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
