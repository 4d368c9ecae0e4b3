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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from elastic.errors import (
    CollectiveAbortedError,
    CollectiveError,
    ConfigError,
    GenerationOutOfMemoryError,
)

# What a job may give to move a batch itself (`TrainJob.move_batch`).
MoveBatch = Callable[[Any, torch.device], Any]

# Text of out-of-memory errors that reach us as text only: CUDA's (through NCCL or CuPy:
# "Cuda failure 'out of memory'", cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY) and
# torch's own ("CUDA out of memory", "DefaultCPUAllocator: can't allocate memory").
_OUT_OF_MEMORY_TEXT = re.compile(
    r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|can't allocate memory",
    re.IGNORECASE)
# torch's CPU allocator's failure (a RuntimeError: torch raises no OutOfMemoryError for it).
_CPU_ALLOCATOR_TEXT = re.compile(r"DefaultCPUAllocator: can't allocate memory")


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


def batched_read(device: torch.device) -> bool:
    """Whether the host reads values on `device` together (`host_values`): on a GPU each read
    waits for the device to finish everything queued before it. Tests replace it to run the
    GPU's way on the CPU."""
    return device.type != "cpu"


def read_later(value: torch.Tensor, what: str) -> float | torch.Tensor:
    """A one-element tensor of the step (`what`, for the error) to be summed by the host: read
    now where reading costs nothing (the CPU: `float`, as it is at this moment), else a copy of
    it on its device, not read yet (`host_values` reads the step's together); a copy, since the
    user's tensor may change in place later in the step, and a view would keep its whole base.

    Raises:
        ValueError: `value` has more or fewer than one element, or is complex.
    """
    if value.numel() != 1 or value.is_complex():
        raise ValueError(f"{what} must be a number or a real tensor of one element, got a tensor "
                         f"of shape {tuple(value.shape)} ({value.dtype})")
    if batched_read(value.device):
        return value.detach().reshape(()).clone()
    return float(value.detach())


def host_values(values: list[float | torch.Tensor]) -> list[float]:
    """`values` as floats: the tensors among them (those `read_later` kept on a GPU) read in
    one copy per device, so that a step with many micro-batches waits for the device once,
    after its last backward pass, not once per micro-batch."""
    out = [v if isinstance(v, float) else 0.0 for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        joined = torch.stack([values[i].to(torch.float64) for i in indices])
        for i, x in zip(indices, joined.tolist(), strict=True):
            out[i] = x
    return out


def shaped_like(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`flat` (one dimension, `like.numel()` elements) as a tensor of `like`'s shape, laid out
    as `like` is where that is dense in another order than the contiguous one (channels-last
    convolutions): a gradient then has its parameter's strides, as PyTorch's autograd makes it
    (an optimizer's fused and foreach kernels take the slow path on mixed layouts), and a
    copy between the two is one block. Anything else: contiguous. The strides are `like`'s
    exactly, those of its dimensions of size 1 too (which `is_contiguous` does not look at:
    a channels-last depthwise convolution's weight)."""
    view = flat.view(like.shape)
    if view.stride() == like.stride() or not _dense(like):
        return view
    return flat.as_strided(like.shape, like.stride())


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill one block without gaps or overlaps, in some order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def finite_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t`'s elements, to tell whether every element is finite (the sum is not
    finite iff an element is not, or the sum overflows: 30x cheaper than
    `torch.isfinite(t).all()` on a CPU). Half-precision values are summed in float32: a
    float16 sum of finite gradients overflows at 65504 (and would vote a step down)."""
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


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


def memory_left(device: torch.device) -> str | None:
    """What is free of a CUDA device, as "312 MiB of 80 GiB free on cuda:0"; None elsewhere or
    when the device cannot say."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:  # a broken context: the error that got here says more
        return None
    return f"{free / 2**20:.0f} MiB of {total / 2**30:.1f} GiB free on {device}"


def pass_through(batch: Any, device: torch.device) -> Any:
    """The batch as it is: how a CPU worker whose job has no `TrainJob.move_batch` "moves"
    its batches (they are where the collate function made them; nothing is rebuilt)."""
    return batch


def default_move(device: torch.device) -> MoveBatch:
    """How a worker on `device` moves a batch when its job has no `TrainJob.move_batch`:
    `pass_through` on the CPU, `move_batch` on any other device."""
    return pass_through if device.type == "cpu" else move_batch


def move_batch(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """`batch` with every tensor in it on `device`, through dicts (and other mappings), lists,
    tuples, named tuples and dataclass instances; anything else is left as it is.

    A tensor already there is the same tensor, and a container none of whose contents changed
    is the same container (nothing is rebuilt: with every tensor already on `device` this is
    an identity). A container that is rebuilt keeps its type (a mapping, list or dataclass is
    copied with `copy.copy`, so its attributes stay, and refilled; a tuple is built by its
    type); one that cannot be rebuilt so raises a TypeError that names `TrainJob.move_batch`,
    with which a job moves such a batch itself. A copy from pinned host memory is
    asynchronous with `non_blocking` (the step's kernels run on the same stream, after it).
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


class UnbuildableBatch(TypeError):
    """A batch holds a container that cannot be rebuilt with its tensors replaced."""


def _unbuildable(value: Any, error: BaseException) -> TypeError:
    return UnbuildableBatch(
        f"cannot move a batch holding a {type(value).__qualname__} to the device: it could not "
        f"be rebuilt with its tensors moved ({type(error).__name__}: {error}); give the job a "
        "TrainJob.move_batch(batch, device) that moves such a batch")


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor in it (see `move_batch` for the containers
    and when one is rebuilt); leaves that are not tensors are the same objects."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        moved = {k: map_tensors(v, fn) for k, v in value.items()}
        if all(moved[k] is v for k, v in value.items()):
            return value
        if type(value) is dict:
            return moved
        try:  # keep the mapping's type and attributes (OrderedDict, defaultdict, UserDict)
            clone = copying.copy(value)
            clone.update(moved)  # type: ignore[attr-defined]
            return clone
        except Exception:  # (not copyable or not mutable: built from its items)
            try:
                return type(value)(moved)  # type: ignore[call-arg]
            except Exception as e:
                raise _unbuildable(value, e) from e
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if type(value) is tuple:
            return tuple(items)
        try:
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        except Exception as e:
            raise _unbuildable(value, e) from e
    if isinstance(value, list):
        items = [map_tensors(v, fn) for v in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if type(value) is list:
            return items
        try:  # a list subclass keeps its type and attributes
            clone = copying.copy(value)
            clone[:] = items
            return clone
        except Exception as e:
            raise _unbuildable(value, e) from e
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: map_tensors(getattr(value, f.name), fn)
                  for f in dataclasses.fields(value)}
        if all(new is getattr(value, name) for name, new in fields.items()):
            return value
        try:
            clone = copying.copy(value)
            for name, new in fields.items():
                object.__setattr__(clone, name, new)  # frozen dataclasses too
        except Exception as e:
            raise _unbuildable(value, e) from e
        return clone
    return value


_NOTHING = object()


def to_device_like(saved: Any, template: Any, device: torch.device) -> Any:
    """`saved` (a state loaded into host memory) with each tensor where the tensor at the same
    place (key or index) of `template` (the live object's own state) is, and each tensor that
    has no tensor there (state allocated lazily, say at a first update) on `device`; through
    mappings (keeping their type and attributes), lists and tuples. What is already where it
    belongs is not copied."""

    def walk(value: Any, like: Any) -> Any:
        if isinstance(value, torch.Tensor):
            target = like.device if isinstance(like, torch.Tensor) else device
            return value if value.device == target else value.to(target)
        if isinstance(value, Mapping):
            items = {k: walk(v, like.get(k, _NOTHING) if isinstance(like, Mapping) else _NOTHING)
                     for k, v in value.items()}
            try:
                clone = copying.copy(value)
                for k, v in items.items():
                    clone[k] = v  # type: ignore[index]
                return clone
            except Exception:  # (not copyable or not mutable: a plain dict)
                return items
        if isinstance(value, (list, tuple)):
            likes = (list(like) if isinstance(like, (list, tuple)) and len(like) == len(value)
                     else [_NOTHING] * len(value))
            items = [walk(v, lk) for v, lk in zip(value, likes, strict=True)]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return value

    return walk(saved, template)


# Most bytes of one snapshot that `to_host(..., pin=True)` copies into pinned host memory; the
# rest goes to pageable memory. PyTorch's caching host allocator keeps pinned blocks once freed
# (for the next snapshot), so this also bounds what snapshots hold pinned between checkpoints.
PIN_LIMIT_BYTES = 2 << 30


def to_host(obj: Any, *, copy: bool = False, pin: bool = False,
            pin_limit: int = PIN_LIMIT_BYTES) -> Any:
    """`obj` with every CUDA tensor in it copied to host memory, through mappings, lists and
    tuples (state dicts).

    Args:
        obj: a state (tensors, numbers, strings and containers of them).
        copy: copy everything else too (CPU tensors and other values), so that the live state
            can change while the copy is written (a background checkpoint); without it, CPU
            tensors and other values are the same objects (for a caller that serialises at
            once).
        pin: the host copies of CUDA tensors in pinned memory (a faster copy), as long as the
            snapshot's pinned bytes stay within `pin_limit`; the rest, and any tensor whose
            pinned allocation fails, in pageable memory. Ignored without CUDA.
        pin_limit: see `pin` (`PIN_LIMIT_BYTES`: 2 GiB).

    A state with no CUDA tensor in its mappings, lists and tuples is `copy.deepcopy(obj)` with
    `copy` and `obj` itself without. Otherwise mappings keep their type and attributes (a
    state dict's `OrderedDict` keeps the `_metadata` that `load_state_dict` reads for version
    migrations), named tuples their type; storages shared by several tensors (tied weights:
    `state_dict` gives each name its own tensor over one storage) are copied once, and each
    tensor is rebuilt as the same view of the copy (offset, size, stride). Values that are
    not tensors or such containers are deep-copied with `copy` (one memo for the whole state,
    so objects shared within it stay shared).
    """
    if not _holds_cuda(obj):
        return copying.deepcopy(obj) if copy else obj
    return _HostCopy(copy, pin and torch.cuda.is_available(), pin_limit).walk(obj)


def _holds_cuda(value: Any) -> bool:
    """Whether a tensor in the mappings, lists and tuples of `value` is not in host memory."""
    if isinstance(value, torch.Tensor):
        return value.device.type != "cpu"
    if isinstance(value, Mapping):
        return any(_holds_cuda(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_cuda(v) for v in value)
    return False


class _HostCopy:
    """One `to_host` walk: its memos and the pinned bytes so far."""

    def __init__(self, copy: bool, pin: bool, pin_limit: int) -> None:
        self.copy = copy
        self.pin = pin
        self.pinned_left = pin_limit
        self.tensors: dict[int, torch.Tensor] = {}  # id(tensor) -> its copy
        # (device, address, bytes) of a storage -> its host copy (a uint8 tensor)
        self.storages: dict[tuple[str, int, int], torch.Tensor] = {}
        self.objects: dict[int, Any] = {}  # copy.deepcopy's memo, for the other values
        self.keep: list[Any] = []  # what the memo keys' ids name stays alive during the walk

    def walk(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, Mapping):
            items = {k: self.walk(v) for k, v in value.items()}
            try:  # the mapping's type and attributes (an OrderedDict's _metadata)
                clone = copying.copy(value)
                for k, v in items.items():
                    clone[k] = v  # type: ignore[index]
                attributes = getattr(clone, "__dict__", None)
                if self.copy and attributes:
                    attributes.update(copying.deepcopy(attributes, self.objects))
                return clone
            except Exception:  # (not copyable or not mutable: a plain dict)
                return items
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, tuple):
            items = [self.walk(v) for v in value]
            if hasattr(value, "_fields"):
                return type(value)(*items)
            return tuple(items)
        return copying.deepcopy(value, self.objects) if self.copy else value

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        done = self.tensors.get(id(t))
        if done is not None:
            return done
        if t.device.type == "cpu" and not self.copy:
            out = t
        elif (t.layout != torch.strided or t.is_nested
              or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter))):
            # Not a plain view of a storage (sparse, nested, a tensor subclass): on its own.
            out = t.detach().to("cpu", copy=True)
        else:
            out = self.view(t)
        self.tensors[id(t)] = out
        self.keep.append(t)
        return out

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the same view of a host copy of its storage, the storage copied once."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (str(t.device), storage.data_ptr(), nbytes)
        host = self.storages.get(key) if nbytes else None
        if host is None:
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = self.allocate(nbytes, on_cuda=t.device.type == "cuda")
            host.copy_(source)  # blocking: the caller may hand the copy to another thread
            if nbytes:
                self.storages[key] = host
                self.keep.append(storage)
        out = torch.empty(0, dtype=t.dtype)
        return out.set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def allocate(self, nbytes: int, on_cuda: bool) -> torch.Tensor:
        """Host memory for one storage: pinned while the bound allows and pinning works."""
        if self.pin and on_cuda and nbytes <= self.pinned_left:
            try:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except Exception:  # (out of pinned memory, or none to be had)
                self.pin = False  # pageable from here on: the next would fail alike
            else:
                self.pinned_left -= nbytes
                return host
        return torch.empty(nbytes, dtype=torch.uint8)


def is_allocation_failure(error: BaseException) -> bool:
    """Whether `error` is an allocation of this process that failed: a `torch.OutOfMemoryError`
    (CUDA's caching allocator), or the RuntimeError of torch's CPU allocator
    ("DefaultCPUAllocator: can't allocate memory"), which torch raises as no subclass of its
    own. Not Python's `MemoryError`: in user code that is mostly a request no memory could
    hold (a shape gone wrong), better told with its traceback than backed off."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return (isinstance(error, RuntimeError) and not isinstance(error, CollectiveError)
            and _CPU_ALLOCATOR_TEXT.search(str(error)) is not None)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` means that this rank ran out of memory (so the step can be redone with
    smaller micro-batches), rather than that a peer was lost.

    True for an allocation that failed (`is_allocation_failure`: a `torch.OutOfMemoryError`,
    or the CPU allocator's RuntimeError), and for a `CollectiveError` that one caused (its
    cause or context chain holds one) or whose text, or its cause's, names out-of-memory
    (NCCL and CuPy give CUDA's failure as text only: an `ncclUnhandledCudaError` or
    `ncclSystemError` with "out of memory"). A `CollectiveAbortedError` never is: it is the
    consequence of an earlier failure or an abort (its text may repeat that failure's), not
    where memory ran out.
    """
    if is_allocation_failure(error):
        return True
    if not isinstance(error, CollectiveError) or isinstance(error, CollectiveAbortedError):
        return False
    return any(is_allocation_failure(e) or _OUT_OF_MEMORY_TEXT.search(str(e))
               for e in _chain(error))


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then its cause (else context), and so on, each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def out_of_memory_line(error: BaseException) -> str:
    """The first line of the allocation failure behind `error` (its cause chain), else of
    the first error in the chain whose text names out of memory (NCCL's), else of `error`."""
    chain = list(_chain(error))
    named = (next((e for e in chain if is_allocation_failure(e)), None)
             or next((e for e in chain if _OUT_OF_MEMORY_TEXT.search(str(e))), error))
    text = str(named).strip()
    return text.splitlines()[0] if text else type(error).__name__


def out_of_memory_forming(error: BaseException, *, rank: int, generation: int, doing: str,
                          device: torch.device,
                          worker_id: int) -> GenerationOutOfMemoryError | None:
    """`error`, raised while generation `generation` formed (`doing`: 'connecting',
    'restoring' or 'loading a checkpoint'), as the error the controller's policy acts on when
    it means that this rank ran out of memory (`is_out_of_memory`); the allocator's cached
    blocks are freed first. None for any other error."""
    if not is_out_of_memory(error):
        return None
    release_cached_memory(device)
    left = memory_left(device)
    when = (f"while generation {generation} formed" if generation >= 0
            else "before the run's first generation formed")
    return GenerationOutOfMemoryError(
        f"rank {rank} (worker {worker_id}) ran out of memory {when} "
        f"({doing}{'; ' + left if left else ''}): {out_of_memory_line(error)}. The "
        "model, its optimizer state (the worker's parts of it when sharded) and the "
        "communicator's buffers must fit on each worker before a step runs, whatever the "
        "micro-batch: shard the optimizer state (sharding.stage 1 or 2, fewer "
        "sharding.replicas), give each worker more memory (fewer workers per GPU: "
        "scaling.gpus_per_worker), or use a smaller model",
        rank=rank, generation=generation, doing=doing)


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
