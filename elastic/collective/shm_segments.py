"""Shared-memory segments of one host's ranks: who shares a host, creating, offering, checking
and mapping the segments, their layout, and the kernel's means of waiting (futexes) and of
watching peer processes (pidfds). The transport over them is `elastic.collective.shm`.

Each rank maps one segment in `/dev/shm` per rank of its host. A segment holds the rank's
doorbell, stage and failure words, two buffers for the direct allreduce, when every rank of
the generation is on this host one inbound byte ring per peer (`elastic.collective.shm_ring`),
and last a region its rank lends to the trainer for the step's flat gradient buffers (a
registered buffer: the direct allreduce reduces it where it lies, without copying it in).

Cleanup: a rank unlinks its segment as soon as every peer has mapped it, so a killed process
leaves nothing behind; a segment orphaned between creation and that point (its creator was
killed during the rendezvous) is removed by the next rendezvous on the host.
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
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.collective.shm_ring import CHANNEL_HEADER, Ring

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
_DESCRIPTOR = 200  # 2 x u64, written by the owner: the buffer its current allreduce reduces
_SEGMENT_HEADER = 256  # then two direct-allreduce buffers, then the rings, then the region
# The largest region a peer may offer (a bound on what a forged offer could make us map).
MAX_REGION_BYTES = 1 << 40


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
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


class PeerProcesses:
    """pidfds of the processes of this host's other ranks: a killed peer is seen here even
    though nobody tells (ranks that are threads of this process are not watched)."""

    def __init__(self, rank: int, ranks: Sequence[int], pids: Sequence[int]) -> None:
        self.gone: str | None = None  # why a peer counts as exited before any poll
        self._fds: list[tuple[int, int]] = []
        self._poll = select.poll()
        for q, pid in zip(ranks, pids, strict=True):
            if q != rank and pid != os.getpid():
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # already gone: found by the first liveness check
                    self.gone = f"rank {q} (pid {pid}) exited"
                    continue
                self._fds.append((q, fd))
                self._poll.register(fd, select.POLLIN)

    def exited(self) -> int | None:
        """A rank whose process has exited, if any; never blocks."""
        if not self._fds:
            return None
        ready = self._poll.poll(0)
        if not ready:
            return None
        fd = ready[0][0]
        return next(q for q, f in self._fds if f == fd)

    def close(self) -> None:
        for _, fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def supported() -> str | None:
    """None when this host can use the transport, else why not."""
    if platform.system() != "Linux" or platform.machine() not in _FUTEX_SYSCALL:
        return f"shared-memory transfers need Linux x86_64, not {platform.system()} {platform.machine()}"
    if not os.path.isdir(_SHM_DIR):
        return f"{_SHM_DIR} does not exist"
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is unavailable"
    return None


def host_identity() -> str:
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
    key = host_identity()
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


class Segment:
    """One rank's mapped segment: its doorbell, its stage, failure and descriptor words, its two
    buffers for the direct allreduce, one inbound ring per peer that sends to it through rings,
    and its region for registered buffers (`region` bytes, possibly none)."""

    def __init__(self, mm: mmap.mmap, channels: int, capacity: int, chunk: int,
                 region: int = 0) -> None:
        self.mm = mm
        self.doorbell = ctypes.c_uint32.from_buffer(mm, _DOORBELL)
        self.stage = ctypes.c_uint64.from_buffer(mm, _STAGE)
        self.failed = ctypes.c_uint32.from_buffer(mm, _FAILED)
        self.sleeping = ctypes.c_uint32.from_buffer(mm, _SLEEPING)
        self.descriptor = (ctypes.c_uint64 * 2).from_buffer(mm, _DESCRIPTOR)
        self.buffers = [torch.frombuffer(mm, dtype=torch.uint8, count=chunk,
                                         offset=_SEGMENT_HEADER + i * chunk) for i in (0, 1)]
        base = _SEGMENT_HEADER + 2 * chunk
        self.rings = [Ring(mm, base + i * (CHANNEL_HEADER + capacity), capacity)
                      for i in range(channels)]
        start = base + channels * (CHANNEL_HEADER + capacity)
        self.region = (torch.frombuffer(mm, dtype=torch.uint8, count=region, offset=start)
                       if region else torch.empty(0, dtype=torch.uint8))

    @staticmethod
    def size(channels: int, capacity: int, chunk: int, region: int = 0) -> int:
        return _SEGMENT_HEADER + 2 * chunk + channels * (CHANNEL_HEADER + capacity) + region


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
    segments: list[Segment]
    pids: list[int]
    capacity: int
    chunk: int
    region: int = 0  # bytes of the smallest region of this host's ranks: what all can lend


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


def _offered_region(offer: dict) -> int:
    """The region bytes a peer's offer announces (0 when it has none).

    Raises:
        ValueError: not a multiple of 64 in [0, MAX_REGION_BYTES].
    """
    region = offer.get("region", 0)
    if (not isinstance(region, int) or isinstance(region, bool)
            or not 0 <= region <= MAX_REGION_BYTES or region % 64):
        raise ValueError(f"a malformed region size {region!r}")
    return region


def _map_local(rank: int, local: list[int], offers: list[dict], own: mmap.mmap,
               layout: tuple[int, int, int], region: int) -> tuple[list[Segment], str]:
    """Maps the segment of every rank of this host (this rank's own with `region` bytes of
    region, each peer's with the region its offer announces); returns them and "ok" or what
    failed."""
    segments = []
    for q, offer in zip(local, offers, strict=True):
        if q == rank:
            segments.append(Segment(own, *layout, region))
            continue
        if "reason" in offer:
            return segments, f"rank {q} cannot offer a segment: {offer['reason']}"
        try:
            theirs = _offered_region(offer)
            mm = _map_peer_segment(offer.get("name"), Segment.size(*layout, theirs))
            if mm[:_NONCE_BYTES] != bytes.fromhex(str(offer.get("nonce"))):
                mm.close()
                raise OSError(f"segment of rank {q} holds another nonce")
            segments.append(Segment(mm, *layout, theirs))
        except (OSError, ValueError) as e:  # a refused segment or a malformed offer
            return segments, f"rank {rank} cannot map the segment of rank {q}: {e}"
    return segments, "ok"


def _agreed_region(store: dist.Store, world_size: int, hosts: list[list[int]]) -> int:
    """The region every rank of the generation lends: the smallest any rank offered, and 0
    when a host has a single rank (it reduces no registered buffer). The same on every rank,
    so that every host reduces registered buffers or none does: the ranks of different hosts
    swap pieces over the network in a pattern that depends on it, and a mismatch there would
    not be caught by the descriptors, which only the ranks of a host compare. Every rank has
    published its offer once every rank has answered `shm/mapped`."""
    if any(len(ranks) == 1 for ranks in hosts):
        return 0
    smallest = MAX_REGION_BYTES
    for q in range(world_size):
        offer = _parse(store.get(f"shm/offer/{q}"), _OFFER_KEYS)
        try:
            smallest = min(smallest, 0 if "reason" in offer else _offered_region(offer))
        except ValueError:
            smallest = 0  # every rank reads the same malformed offer and agrees on none
    return smallest


def _give_back(mm: mmap.mmap, start: int, end: int) -> None:
    """Frees the pages of `mm` between `start` (rounded up to a page) and `end` in /dev/shm;
    nobody touches them again (best effort: they are freed with the segment otherwise)."""
    start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    if end > start:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            mm.madvise(mmap.MADV_REMOVE, start, end - start)


def connect(rank: int, world_size: int, store: dist.Store, capacity: int, chunk: int = 4 << 20,
            simulated_hosts: int | None = None, region: int = 0) -> SharedMemoryLinks | None:
    """Maps the shared-memory segments of the ranks that share this host, if all ranks can.

    Every rank calls this with the generation's store and reaches the same answer: links when
    every rank could map the segment of every rank of its host and at least two ranks share a
    host, else None (the caller then uses the backend's own transfers). The segments carry
    `capacity`-byte rings (rounded down to a multiple of 64) only when all ranks share this
    host (point-to-point transfers between hosts go over the network), two `chunk`-byte
    buffers for the direct allreduce, and a `region`-byte region (rounded up to a multiple of
    64) for registered buffers. A rank whose segment does not fit in /dev/shm with its region
    offers one without (logged), so a large region never costs the host its shared memory.
    The links' `region` is what every rank of the generation lends (`_agreed_region`): the
    smallest any rank offered, 0 when a host has a single rank; the part of this rank's
    region beyond it is given back to /dev/shm.
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
    # Multiples of 64 keep every buffer and ring on a cache-line boundary, and a ring's end
    # between two elements of any dtype (a reducing receive reads typed views of it).
    layout = (world_size - 1 if len(local) == world_size else 0, capacity & ~63, chunk & ~63)
    region = -(-max(0, region) // 64) * 64 if all(len(h) > 1 for h in hosts) else 0
    name = f"elastic-shm-{os.getpid()}-{uuid.uuid4().hex}"
    path = os.path.join(_SHM_DIR, name)
    try:
        own, problem = _create_segment(path, Segment.size(*layout, region))
        if own is None and region:
            logger.warning("rank %d: no room for a %d-byte region for registered buffers in "
                           "%s (%s); no rank of the generation lends one, and the gradient "
                           "buffers are copied in and out instead", rank, region, _SHM_DIR,
                           problem)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            region = 0
            own, problem = _create_segment(path, Segment.size(*layout))
        nonce = os.urandom(_NONCE_BYTES)
        if own is not None:
            own[:_NONCE_BYTES] = nonce
        store.set(f"shm/offer/{rank}", json.dumps({"reason": problem} if problem else {
            "name": name, "nonce": nonce.hex(), "pid": os.getpid(),
            "size": Segment.size(*layout, region), "region": region}))
        offers = [_parse(store.get(f"shm/offer/{q}"), _OFFER_KEYS) for q in local]
        segments, mapped = (([], problem) if own is None
                            else _map_local(rank, local, offers, own, layout, region))
        store.set(f"shm/mapped/{rank}", mapped or "?")
        # Everyone has mapped every segment of its host (or given up) once all have answered.
        answers = [store.get(f"shm/mapped/{q}").decode() for q in range(world_size)]
        failed = next((a for a in answers if a != "ok"), None)
        if failed is not None:
            logger.warning("shared-memory transfers off for this generation: %s", failed)
            return None
        agreed = _agreed_region(store, world_size, hosts)
        if agreed < region:
            _give_back(own, Segment.size(*layout) + agreed, Segment.size(*layout, region))
        return SharedMemoryLinks(rank, world_size, hosts, host, segments,
                                 [int(o["pid"]) for o in offers], layout[1], layout[2], agreed)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
