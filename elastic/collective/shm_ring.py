"""The byte rings of the shared-memory transport (`elastic.collective.shm`), and the transfers
that move through them.

A ring is a single-producer single-consumer byte stream in a receiver's segment, one per
sender: the sender copies a message header and then the payload in behind its tail, the
receiver copies them out behind its head, and each publishes its position with a plain store
after the copies (total store order on x86_64 makes the copies visible first). Transfers
between a pair of ranks match in the order they are posted, whatever their tags; the header
names the tag and size so that a receive that does not match fails with both named.

A reducing receive (`SharedMemoryTransport.recv_reduce`) reduces straight from the ring's
bytes into the caller's tensor, with vectorised ops over typed views of the ring (two where a
message wraps around the ring's end), as whole elements arrive. Where the bytes lie at an
offset that is not a multiple of the element size (earlier messages on this ring of another
dtype and an odd length), it copies them out to scratch first and reduces from there.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from elastic.collective.transport import reduce_into
from elastic.config import ReduceOp


class RingDriver(Protocol):
    """What a handle needs of its transport to complete (`shm.SharedMemoryTransport`)."""

    def progress_if_idle(self) -> None: ...

    def drive(self, item: Handle, timeout: float) -> bool: ...

# Ring layout: positions on their own cache lines, then the bytes.
_TAIL = 0  # u64 stream position written by the sender
_HEAD = 64  # u64 stream position written by the receiver
CHANNEL_HEADER = 128
_MESSAGE_HEADER = 16  # (tag: i64, nbytes: i64) in front of every payload


class Ring:
    """A single-producer single-consumer byte stream of `capacity` bytes."""

    def __init__(self, mm: mmap.mmap, offset: int, capacity: int) -> None:
        self.tail = ctypes.c_uint64.from_buffer(mm, offset + _TAIL)
        self.head = ctypes.c_uint64.from_buffer(mm, offset + _HEAD)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=capacity,
                                     offset=offset + CHANNEL_HEADER)
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

    def reduce(self, position: int, dst: torch.Tensor, op: ReduceOp) -> bool:
        """`dst = dst op` the `dst`'s worth of bytes at stream `position`, read straight from
        the ring as `dst`'s dtype; False (nothing done) when those bytes do not start at a
        multiple of the element size, where no typed view of them exists."""
        unit = dst.element_size()
        start = position % self.capacity
        # `connect` makes the capacity a multiple of 64, so that an aligned message also wraps
        # between two elements.
        if start % unit or self.capacity % unit:
            return False
        first = min(dst.numel(), (self.capacity - start) // unit)
        reduce_into(dst[:first], self.data[start : start + first * unit].view(dst.dtype), op)
        if first < dst.numel():
            rest = dst.numel() - first
            reduce_into(dst[first:], self.data[: rest * unit].view(dst.dtype), op)
        return True


class Handle:
    """A `Pending` the transport completes: waiting on it drives the transport."""

    __slots__ = ("_transport", "done", "error")

    def __init__(self, transport: RingDriver) -> None:
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


class Transfer(Handle):
    """One posted send or receive, or a reducing receive (`op` set); also its `Pending`
    handle."""

    __slots__ = ("data", "moved", "op", "started", "tag", "target", "unit")

    def __init__(self, transport: RingDriver, tensor: torch.Tensor, tag: int,
                 op: ReduceOp | None = None) -> None:
        super().__init__(transport)
        self.target = tensor.reshape(-1)  # the caller's contiguous tensor, flat
        self.data = self.target.view(torch.uint8)
        self.tag = tag
        self.op = op
        # A reducing receive takes whole elements only.
        self.unit = 1 if op is None else tensor.element_size()
        self.started = False  # message header written / read
        self.moved = 0  # payload bytes copied (or reduced) so far


class Mismatch(Exception):
    """A receive whose tag or size differs from the message the peer sent."""


class _End:
    """This rank's end of one ring: its queued transfers, in order, and its stream position."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.queue: deque[Transfer] = deque()
        self.position = 0
        self._header = torch.empty(2, dtype=torch.int64)

    def fail(self, error: BaseException) -> None:
        """Ends every queued transfer with `error`."""
        while self.queue:
            transfer = self.queue.popleft()
            transfer.error = error
            transfer.done = True


class Sender(_End):
    """The end of a ring in a peer's segment that this rank writes."""

    def push(self) -> bool:
        """Copies what fits of the queued sends into the ring; True if anything moved."""
        ring = self.ring
        start = self.position

        def header(transfer: Transfer, position: int) -> None:
            self._header[0], self._header[1] = transfer.tag, transfer.data.numel()
            ring.put(position, self._header.view(torch.uint8))

        def payload(transfer: Transfer, position: int, count: int) -> None:
            ring.put(position, transfer.data[transfer.moved : transfer.moved + count])

        tail = _advance(self.queue, start, ring.capacity - (start - ring.head.value), header, payload)
        if tail == start:
            return False
        self.position = tail
        ring.tail.value = tail  # after the payload: the receiver reads up to here
        return True


class Receiver(_End):
    """The end of a ring in this rank's segment that rank `peer` writes."""

    def __init__(self, ring: Ring, rank: int, peer: int) -> None:
        super().__init__(ring)
        self._rank = rank
        self._peer = peer
        self._staging: torch.Tensor | None = None  # for bytes no typed view can read

    def pull(self) -> bool:
        """Copies what has arrived into the queued receives; True if anything moved.

        Raises:
            Mismatch: the next message is not the one the next receive expects.
        """
        ring = self.ring
        start = self.position

        def header(transfer: Transfer, position: int) -> None:
            ring.get(position, self._header.view(torch.uint8))
            tag, nbytes = int(self._header[0]), int(self._header[1])
            if tag != transfer.tag or nbytes != transfer.data.numel():
                raise Mismatch(
                    f"rank {self._rank} expected {transfer.data.numel()} bytes with tag "
                    f"{transfer.tag} from rank {self._peer} but its next message has {nbytes} "
                    f"bytes with tag {tag}; transfers between two ranks match in order"
                )

        head = _advance(self.queue, start, ring.tail.value - start, header, self._take)
        if head == start:
            return False
        self.position = head
        ring.head.value = head  # the sender may reuse the space up to here
        return True

    def _take(self, transfer: Transfer, position: int, count: int) -> None:
        """Copies `count` payload bytes at `position` into a receive, or reduces them into a
        reducing one."""
        if transfer.op is None:
            self.ring.get(position, transfer.data[transfer.moved : transfer.moved + count])
            return
        unit = transfer.unit
        dst = transfer.target[transfer.moved // unit : (transfer.moved + count) // unit]
        if not self.ring.reduce(position, dst, transfer.op):
            if self._staging is None:
                self._staging = torch.empty(self.ring.capacity, dtype=torch.uint8)
            staged = self._staging[:count]
            self.ring.get(position, staged)
            reduce_into(dst, staged.view(dst.dtype), transfer.op)


def _advance(queue: deque[Transfer], position: int, room: int,
             header: Callable[[Transfer, int], None],
             payload: Callable[[Transfer, int, int], None]) -> int:
    """Moves the queued transfers of one ring, in order, through `room` bytes from stream
    `position` (free space for a sender, unread bytes for a receiver): each message header,
    then as much payload as fits (whole elements for a reducing receive, which waits for the
    rest of an element: the sender always has room for it). Returns the new stream
    position."""
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
        count -= count % transfer.unit
        if count:
            payload(transfer, position, count)
            position += count
            room -= count
            transfer.moved += count
        if transfer.moved < transfer.data.numel():
            break
        transfer.done = True
        queue.popleft()
    return position
