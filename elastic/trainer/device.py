"""Where a worker computes: its device, batches moved there, the random state of that device,
host copies of device state, and which errors mean that its memory ran out.

A worker with `scaling.use_gpu` computes on the GPU Ray assigned to it, found as Ray Train
finds it: Ray sets `CUDA_VISIBLE_DEVICES` for the actor to the GPUs it reserved, and
`ray.get_gpu_ids()` names them, so the first assigned id's position in that list is its local
CUDA index. Every other worker computes on the CPU, where everything here is an identity (or
close to one), so that the CPU tests exercise the same code.

The worker actor reads Ray's assignment and calls `resolve_device`; nothing here imports Ray.
"""

from __future__ import annotations

import copy as copying
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from elastic.errors import CollectiveAbortedError, CollectiveError, ConfigError

# What a job may give to move a batch itself (`TrainJob.move_batch`).
MoveBatch = Callable[[Any, torch.device], Any]

# Text of out-of-memory errors that reach us as text only: CUDA's (through NCCL or CuPy:
# "Cuda failure 'out of memory'", cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY) and
# torch's own ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory").
_OUT_OF_MEMORY_TEXT = re.compile(
    r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|can't allocate memory",
    re.IGNORECASE)


def local_gpu_index(gpu_ids: Sequence[int | str], visible: str | None) -> int:
    """The local CUDA index of the first GPU Ray assigned to this process.

    Args:
        gpu_ids: `ray.get_gpu_ids()` (ints or strings, depending on the Ray version).
        visible: `CUDA_VISIBLE_DEVICES` as Ray set it for the actor (None: unset).

    Returns:
        The first assigned id's position in `visible`; with `visible` unset (Ray told not to
        set it), the id itself, which then is the local index; 0 when nothing is assigned
        (called outside a Ray worker) or `visible` does not name the id.
    """
    if not gpu_ids:
        return 0
    first = str(gpu_ids[0])
    if visible is None or visible.strip() in ("", "NoDevFiles"):
        return int(first) if first.isdigit() else 0
    names = [name.strip() for name in visible.split(",")]
    return names.index(first) if first in names else 0


def resolve_device(use_gpu: bool, gpu_ids: Sequence[int | str], visible: str | None,
                   cuda_available: bool) -> torch.device:
    """The device a worker computes on: its GPU (`local_gpu_index`) with `use_gpu`, else the
    CPU.

    Raises:
        ConfigError: `use_gpu`, but torch sees no CUDA device in this process.
    """
    if not use_gpu:
        return torch.device("cpu")
    if not cuda_available:
        raise ConfigError(
            "scaling.use_gpu: this worker sees no CUDA device (torch.cuda.is_available() is "
            f"False; CUDA_VISIBLE_DEVICES={visible!r}); install a CUDA build of torch on every "
            "node, or set scaling.use_gpu=False")
    return torch.device("cuda", local_gpu_index(gpu_ids, visible))


def bind_thread(device: torch.device) -> None:
    """Makes `device` the calling thread's current CUDA device (CUDA's current device is per
    thread: every thread that allocates or launches work binds it); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def release_cached_memory(device: torch.device) -> None:
    """Returns the allocator's cached blocks to the device after an out-of-memory error, so
    that what is retried allocates from a clean pool (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def move_batch(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """`batch` with every tensor in it on `device`, through dicts (and other mappings), lists,
    tuples, named tuples and dataclass instances; anything else is left as it is. A tensor
    already there is the same tensor (no copy: on the CPU this is an identity). A copy from
    pinned host memory is asynchronous with `non_blocking` (the step's kernels run on the same
    stream, after it)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def to_host(obj: Any, *, copy: bool = False, pin: bool = False) -> Any:
    """`obj` with every CUDA tensor in it copied to host memory, through dicts, lists and
    tuples (state dicts).

    Args:
        obj: a state (tensors, numbers, strings and containers of them).
        copy: copy everything else too (CPU tensors cloned, other values deep-copied), so
            that the live state can change while the copy is written (a background
            checkpoint); without it, CPU tensors and other values are the same objects (for a
            caller that serialises at once).
        pin: the host copies of CUDA tensors in pinned memory (a faster copy; the caching
            host allocator reuses it from one snapshot to the next). Ignored without CUDA.

    A tensor that appears twice (tied weights) is copied once.
    """
    pin = pin and torch.cuda.is_available()
    memo: dict[int, torch.Tensor] = {}

    def host(t: torch.Tensor) -> torch.Tensor:
        done = memo.get(id(t))
        if done is not None:
            return done
        if t.device.type == "cpu":
            out = t.detach().clone() if copy else t
        else:
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            out.copy_(t.detach())  # blocking: the caller may hand the copy to another thread
        memo[id(t)] = out
        return out

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return host(value)
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            items = [walk(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return copying.deepcopy(value) if copy else value

    return walk(obj)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor in it (see `move_batch` for the containers);
    containers are rebuilt, leaves that are not tensors are the same objects."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        moved = {k: _map_tensors(v, fn) for k, v in value.items()}
        if type(value) is dict:
            return moved
        try:  # keep the mapping's type (OrderedDict, defaultdict, a UserDict batch)
            clone = copying.copy(value)
            clone.update(moved)  # type: ignore[attr-defined]
            return clone
        except (TypeError, AttributeError):
            return moved
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        clone = copying.copy(value)
        for f in dataclasses.fields(value):
            # object.__setattr__: frozen dataclasses too
            object.__setattr__(clone, f.name, _map_tensors(getattr(value, f.name), fn))
        return clone
    return value


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` means that this rank ran out of memory (so the step can be redone with
    smaller micro-batches), rather than that a peer was lost.

    True for a `torch.OutOfMemoryError`, and for a `CollectiveError` that an out-of-memory
    error caused (its cause or context chain holds one) or whose text, or its cause's, names
    out-of-memory (NCCL and CuPy give CUDA's failure as text only: an `ncclUnhandledCudaError`
    or `ncclSystemError` with "out of memory"). A `CollectiveAbortedError` never is: it is the
    consequence of an earlier failure or an abort (its text may repeat that failure's), not
    where memory ran out.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, CollectiveError) or isinstance(error, CollectiveAbortedError):
        return False
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError) or _OUT_OF_MEMORY_TEXT.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The random state a replica commits: 'rng', the CPU generator, and 'cuda_rng', the
    generator of `device` when it is a CUDA device and CUDA is initialised in this process."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda" and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restores what `rng_state` saved, as far as this worker has it: the CPU generator
    whenever the state has one; the CUDA generator only on a CUDA `device` (a GPU worker's
    state restored on a CPU worker keeps the CPU part; a CPU worker's state restored on a GPU
    worker leaves the CUDA generator as it is)."""
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
    cuda = state.get("cuda_rng")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
