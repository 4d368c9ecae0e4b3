"""The backend interface the communicator is built on.

A backend (gloo, nccl) offers batched point-to-point transfers, a receive that reduces into
its destination, and a few native collectives, all asynchronous: each returns `Pending`
handles that the communicator polls against its abort flag and deadline. Never blocking a
caller inside a backend call is what makes `abort()` work: measured here, gloo's own abort
does not wake a pending recv.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from elastic.config import ReduceOp

if TYPE_CHECKING:
    from elastic.config import CollectiveConfig


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp) -> None:
    """`dst = dst op src`, in place ('avg' is summed here and divided by the caller)."""
    if op == "max":
        torch.maximum(dst, src, out=dst)
    else:
        dst.add_(src)


class Pending(Protocol):
    """One asynchronous backend operation."""

    def is_done(self) -> bool:
        """True once the operation finished, successfully or not. Never blocks."""
        ...

    def wait(self, timeout: float) -> bool:
        """Blocks up to `timeout` seconds until the operation finished or the transport was
        aborted; returns `is_done()`."""
        ...

    def check(self) -> None:
        """Raises the backend's error if a finished operation failed."""
        ...


class Transport(ABC):
    """One rank's connection to the other ranks of a generation."""

    rank: int
    world_size: int
    name: str  # what carries point-to-point transfers: "gloo", "shared_memory" or "nccl"

    @abstractmethod
    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        """Starts sending each `(tensor, peer)` of `sends` and receiving into each
        `(tensor, peer)` of `recvs`, all at once (so a ring step cannot deadlock). Tensors must
        be contiguous. Transfers between a pair of ranks with the same tag match in order."""

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int,
                    scratch: torch.Tensor | None = None) -> list[Pending]:
        """Starts receiving `tensor.numel()` elements from `src` and reducing them into
        `tensor` (`tensor = tensor op received`), matched with `src`'s sends like a receive of
        `exchange` with the same tag. The result is in place once every handle has been waited
        for and checked, in order (`Communicator.wait`); a handle that failed, or that was
        abandoned because the transport was aborted, writes nothing more into `tensor`.

        Default: receive into `scratch` (allocated when None; contiguous, as long as `tensor`
        and of its dtype), then reduce in the thread that checks the receive. A transport that
        can reduce straight from its own memory overrides this and leaves `scratch` alone.
        """
        buffer = torch.empty_like(tensor) if scratch is None else scratch
        pending = self.exchange([], [(buffer, src)], tag)
        return [_ReducedWhenChecked(pending, buffer, tensor, op)] if pending else []

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        """Starts the backend's own allreduce of a contiguous tensor, in place."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        """Starts the backend's own broadcast of a contiguous tensor from `src`, in place."""

    @abstractmethod
    def abort(self) -> None:
        """Wakes every thread blocked in `Pending.wait` and releases what can be released
        without blocking."""

    @abstractmethod
    def close(self) -> None:
        """Releases the backend after normal use."""

    def fail(self) -> None:
        """Called once when an operation of this rank failed (timeout, error): tells peers
        that wait on this rank through a side channel to give up as well. Default: nothing."""
        return

    def host_group(self) -> HostGroup | None:
        """The shared memory of the ranks on this host, for the direct and hierarchical
        allreduce; None when this transport has none."""
        return None


class _ReducedWhenChecked:
    """A receive into scratch, reduced into the destination when it is checked: after it
    finished and after the caller saw that nothing was aborted, so a failed or abandoned
    receive never touches the destination."""

    __slots__ = ("_dst", "_op", "_pending", "_reduced", "_scratch")

    def __init__(self, pending: list[Pending], scratch: torch.Tensor, dst: torch.Tensor,
                 op: ReduceOp) -> None:
        self._pending = pending
        self._scratch = scratch
        self._dst = dst
        self._op = op
        self._reduced = False

    def is_done(self) -> bool:
        return all(p.is_done() for p in self._pending)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(p.wait(max(0.0, deadline - time.monotonic())) for p in self._pending)

    def check(self) -> None:
        for p in self._pending:
            p.check()
        if not self._reduced:
            self._reduced = True
            reduce_into(self._dst, self._scratch, self._op)


class Collective(Protocol):
    """What the allreduce algorithms (`algorithms`, `direct`) need of a communicator:
    `Communicator` is one. Declared here so that they need not import it (it imports them)."""

    rank: int
    world_size: int
    config: CollectiveConfig

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], tag: int = 0) -> list[Pending]: ...

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int = 0,
                    scratch: torch.Tensor | None = None) -> list[Pending]: ...

    def wait(self, pending: Sequence[Pending]) -> None: ...


class HostGroup(Protocol):
    """The shared memory of the ranks on one host (`Transport.host_group`), as the direct and
    hierarchical allreduce and the registered buffers use it: `shm.SharedMemoryTransport` is
    one. Declared here so that this module need not import it (it imports this one)."""

    rank: int
    hosts: list[list[int]]  # the global ranks of each host
    host: int  # this rank's host
    local: list[int]  # the global ranks of this host
    local_rank: int
    chunk: int  # bytes of each staging buffer

    def buffers(self, sequence: int, dtype: torch.dtype) -> list[torch.Tensor]: ...

    def next_sequence(self) -> int: ...

    def stage(self, value: int, descriptor: tuple[int, int] | None = None) -> Pending: ...

    def shared_buffers(self, sizes: dict[torch.dtype, int]) -> dict[torch.dtype, torch.Tensor] | None: ...

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def registered(self, flat: torch.Tensor) -> int | None: ...

    def registered_views(self, offset: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]: ...
