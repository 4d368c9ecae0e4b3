"""The backend interface the communicator is built on.

A backend (gloo, nccl) offers batched point-to-point transfers and a few native collectives,
all asynchronous: each returns `Pending` handles that the communicator polls against its abort
flag and deadline. Never blocking a caller inside a backend call is what makes `abort()` work:
measured here, gloo's own abort does not wake a pending recv.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from elastic.config import ReduceOp

if TYPE_CHECKING:
    from elastic.collective.shm import SharedMemoryTransport


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

    def host_group(self) -> SharedMemoryTransport | None:
        """The shared memory of the ranks on this host, for the direct and hierarchical
        allreduce; None when this transport has none."""
        return None
