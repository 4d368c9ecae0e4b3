"""Host memory for the gradients of GPU workers on the host plane, and the stream operations
that order the copies into it and out of it.

GPU workers whose ranks cannot reduce over NCCL (several share a GPU, or NCCL is not
installed: backend 'gloo' with `scaling.use_gpu`) sum their gradients in host memory: each
gradient is copied from the GPU into a host buffer, the buffers are reduced by the host
allreduce, and the sums are copied back. The host buffers are the communicator's registered
shared-memory region when it lends one (`Communicator.shared_buffers`: the direct allreduce
then reduces them where they lie, with no copy through the transport), page-locked with
`cudaHostRegister` so that a copy from the GPU is a DMA queued on the stream, which the host
does not wait for; else page-locked buffers of their own, kept from step to step.

A region stays registered while its communicator's generation lasts: the next generation lends
another region (the old one is unregistered then, once the device is idle, and its mapping
goes with the last reference), and `release` unregisters it when the replica stops using it.

Host memory that a copy to the GPU still reads must not be written by the host: the caller
waits for the device (`CudaStreams.block`, `synchronize`) before it writes into buffers it
copied out of in the last step.

`CudaStreams` is what runs on a GPU (`torch.cuda`); the CPU tests pass a fake that defers each
copy until the fence after it is waited for, so that a read that comes too early reads what
was there before.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# What a communicator lends (`Communicator.shared_buffers`): dtype -> elements, or None.
Lender = Callable[[dict[torch.dtype, int]], "dict[torch.dtype, torch.Tensor] | None"]


class CudaStreams:
    """The stream operations of gradient buckets and host staging on a GPU (`torch.cuda`)."""

    def current(self) -> object:
        return torch.cuda.current_stream()

    def own_stream(self) -> None:
        """The calling thread (the buckets' communication thread) works on a stream of its
        own from now on: what it queues (sums, copies back, NCCL's wait for its producer)
        waits for the fences it is given, not for everything the backward pass has queued on
        the default stream meanwhile (which would hold each bucket's reduction back until
        the backward caught up with the host; c10d's NCCL process group also runs its
        collectives on streams of its own).
        Of high priority: torch hands out streams of a priority from a small pool, and a
        user's side streams are of the default one."""
        torch.cuda.set_stream(torch.cuda.Stream(priority=-1))

    def fence(self, stream: object) -> object:
        """An event recorded on `stream` after the work queued on it so far (blocking: a
        host that waits for it sleeps, where the default spins a core; workers sharing a GPU
        share the host's cores with their sums)."""
        event = torch.cuda.Event(blocking=True)
        event.record(stream)  # type: ignore[arg-type]
        return event

    def wait(self, event: object) -> None:
        """The calling thread's current stream waits for `event` (the host does not)."""
        torch.cuda.current_stream().wait_event(event)  # type: ignore[arg-type]

    def block(self, event: object) -> None:
        """The calling thread waits until the work before `event` is done (what the host
        reads next was written by the device)."""
        event.synchronize()  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        """The calling thread waits for its current stream's work."""
        torch.cuda.current_stream().synchronize()

    def idle(self) -> None:
        """The calling thread waits for every stream of its device."""
        torch.cuda.synchronize()

    def retire(self, tensor: torch.Tensor) -> None:
        """`tensor` (allocated on another stream) is freed once the current stream's work on
        it is done, not before."""
        tensor.record_stream(torch.cuda.current_stream())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queues a copy of `src` into `dst` on the current stream (between host memory that
        is page-locked and the GPU: a DMA that the host does not wait for)."""
        dst.copy_(src, non_blocking=True)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of `host` on `device`, queued on the current stream (the stream's later
        work sees it; the host does not know when the copy has read `host`)."""
        return host.to(device, non_blocking=True)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory of its own."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def register(self, address: int, nbytes: int) -> str | None:
        """Page-locks `nbytes` of host memory (not torch's) at `address` for copies from and
        to the GPU; returns why not, or None."""
        code = _code(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if code == 0:
            return None
        _clear_last_error()
        return f"cudaHostRegister returned CUDA error {code}"

    def unregister(self, address: int) -> None:
        if _code(torch.cuda.cudart().cudaHostUnregister(address)) != 0:
            _clear_last_error()


def _ref(owner: object) -> Callable[[], object]:
    """A weak reference to `owner` (a strong one where it takes none)."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


def _code(error: object) -> int:
    """A CUDA runtime call's error code, as torch's bindings return it."""
    return int(error[0] if isinstance(error, tuple) else error)  # type: ignore[index,call-overload]


def _clear_last_error() -> None:
    """A runtime call that failed left its error as the thread's last error, which the check
    after the next kernel launch would raise as that kernel's own: a throwaway launch reads it
    (and so clears it) here. Registration errors are not sticky: the second launch runs."""
    for _ in range(2):
        try:
            torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
            return
        except RuntimeError:
            continue


class HostStaging:
    """A GPU worker's host buffers for its gradients (see the module).

    Args:
        streams: the stream operations (`CudaStreams` on a GPU).
    """

    def __init__(self, streams: CudaStreams) -> None:
        self.streams = streams
        self._own: dict[torch.dtype, torch.Tensor] = {}
        # The pages page-locked: [start, end) and the buffers in them (which keep them mapped).
        self._registered: tuple[int, int, list[torch.Tensor]] | None = None
        # The last pages that could not be page-locked, and why (not asked again).
        self._refused: tuple[int, int, str] | None = None
        self._lender: Callable[[], object] | None = None  # who lent last (the communicator)
        self._warned: str | None = None  # the last reason a region was refused, as logged

    @property
    def registered(self) -> bool:
        """Whether the buffers last lent are page-locked by `cudaHostRegister`."""
        return self._registered is not None

    def buffers(self, sizes: dict[torch.dtype, int], lend: Lender | None) -> dict[torch.dtype, torch.Tensor]:
        """Host buffers of `sizes[dtype]` elements: lent by the communicator (`lend`) and
        page-locked, or page-locked buffers of this staging's own. The same memory as the last
        call's where the sizes and the lender's region are the same: the caller writes into it
        from the host only after the device is done with the last step's copies.
        """
        owner = getattr(lend, "__self__", lend)
        if self._lender is None or self._lender() is not owner:  # another generation's
            self._refused = None  # a region refused before is not this one
            self._lender = _ref(owner) if owner is not None else None
        lent = lend(sizes) if lend is not None else None
        if lent is not None:
            self._pin(lent)
            return lent
        self._unpin()
        out = {}
        for dtype, numel in sizes.items():
            own = self._own.get(dtype)
            if own is None or own.numel() < numel:
                self._own.pop(dtype, None)  # the old one goes before the larger one comes
                own = self._own[dtype] = self.streams.pinned(numel, dtype)
            out[dtype] = own[:numel]
        return out

    def release(self) -> None:
        """Unregisters the region (once the device is idle) and frees the buffers of its own."""
        self._unpin()
        self._own, self._refused, self._lender = {}, None, None

    def _pin(self, lent: dict[torch.dtype, torch.Tensor]) -> None:
        """Page-locks the whole pages that hold `lent`, unless they are already. The region
        lies in a mapping (page-aligned, and whole pages), so the pages around the buffers
        are the segment's own."""
        start = min(t.data_ptr() for t in lent.values())
        end = max(t.data_ptr() + t.numel() * t.element_size() for t in lent.values())
        low, high = start - start % mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
        held = self._registered
        if held is not None and held[0] <= low and high <= held[1]:
            return
        self._unpin()
        if self._refused is not None and self._refused[:2] == (low, high):
            return
        why = self.streams.register(low, high - low)
        if why is not None:
            if why != self._warned:  # once per reason
                logger.warning("the shared-memory region for the gradients could not be "
                               "page-locked (%s): each copy from the GPU into it makes the "
                               "host wait for it", why)
            self._refused, self._warned = (low, high, why), why
            return
        # The lent views keep the mapping alive until it is unregistered.
        self._registered, self._refused = (low, high, list(lent.values())), None

    def _unpin(self) -> None:
        held, self._registered = self._registered, None
        if held is not None:
            self.streams.idle()  # no copy still reads or writes it
            self.streams.unregister(held[0])
