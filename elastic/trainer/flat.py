"""Gradients reduced as flat buffers once the backward pass is over: the path without overlap.

The gradients are concatenated into one buffer per dtype and each buffer is summed over ranks
in one allreduce. The step's metadata (summed loss, one vote per rank, the ledger) rides in the
float64 buffer when there is one (else in the float32 one), so a typical step costs one
allreduce. The counterpart that overlaps the backward pass is `elastic.trainer.buckets`.

The buffers live on the parameters' device, except for GPU workers on the host plane (backend
'gloo', several workers sharing a GPU): their gradients are staged in host memory (`staging`:
the communicator's registered region, page-locked, where it lends one; see
`elastic.trainer.staging`), copied from the GPU, reduced there by the host allreduce, and
copied back to the GPU by `unflatten_grads`. `flatten_grads` is the reduce's only allocation
(with room for the metadata in the buffer that carries it), so that the replica can run it
inside the step's vote: a rank out of memory there votes the step down instead of leaving the
collectives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from elastic.collective import Communicator
from elastic.trainer.device import finite_sum, shaped_like
from elastic.trainer.staging import HostStaging, Lender


def meta_carrier(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The dtype of the gradient buffer the metadata rides in on a single plane: float64 if
    there is one, else float32 (ledger indices < 2**24 are exact there: checked at start),
    else None (the metadata is summed on its own)."""
    present = set(dtypes)
    return next((d for d in (torch.float64, torch.float32) if d in present), None)


def flatten_grads(params: list[torch.nn.Parameter], zero: bool, meta_len: int = 0,
                  lend: Lender | None = None,
                  staging: HostStaging | None = None) -> dict[torch.dtype, torch.Tensor]:
    """One buffer per dtype holding the gradients of `params` in order, on their device; a
    parameter without a gradient, or every parameter when `zero` (this rank voted the step
    down), contributes zeros, so every rank sends buffers of the same size. With `meta_len`,
    the buffer of `meta_carrier` has `meta_len` more elements (zeros) at its end, for
    `allreduce_flat(..., room=True)`. With `lend` (`Communicator.shared_buffers`) the buffers
    of CPU gradients are the communicator's registered buffers when it can lend them (host
    memory the allreduce reduces where it lies), else allocated. With `staging` (GPU
    gradients on the host plane) every buffer is host memory from it (lent by `lend` where it
    can), filled by copies from the GPU that have ended when this returns (the host allreduce
    reads them next).

    Raises:
        torch.OutOfMemoryError: the buffers did not fit (nothing else is allocated here).
    """
    sizes: dict[torch.dtype, int] = {}
    devices: dict[torch.dtype, torch.device] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        devices.setdefault(p.dtype, p.device)
    carrier = meta_carrier(sizes) if meta_len else None
    rooms = {dtype: n + (meta_len if dtype == carrier else 0) for dtype, n in sizes.items()}
    if staging is not None:
        return _staged(params, staging.buffers(rooms, lend), sizes, zero, staging)
    lent = None
    if lend is not None and all(d.type == "cpu" for d in devices.values()):
        lent = lend(rooms)
    buffers = {}
    for dtype, n in sizes.items():
        if lent is not None:
            buffers[dtype] = lent[dtype]
            (buffers[dtype] if zero else buffers[dtype][n:]).zero_()
            continue
        if zero:
            buffers[dtype] = torch.zeros(rooms[dtype], dtype=dtype, device=devices[dtype])
            continue
        buffers[dtype] = torch.empty(rooms[dtype], dtype=dtype, device=devices[dtype])
        buffers[dtype][n:].zero_()
    if zero:
        return buffers
    offsets = dict.fromkeys(sizes, 0)
    for p in params:
        start, n = offsets[p.dtype], p.numel()
        target = buffers[p.dtype][start : start + n]
        if p.grad is not None:
            shaped_like(target, p).copy_(p.grad)
        else:
            target.zero_()
        offsets[p.dtype] = start + n
    return buffers


def _staged(params: list[torch.nn.Parameter], buffers: dict[torch.dtype, torch.Tensor],
            sizes: dict[torch.dtype, int], zero: bool,
            staging: HostStaging) -> dict[torch.dtype, torch.Tensor]:
    """`flatten_grads` into host buffers: the device copies the gradients in (queued on the
    current stream), the host waits for them, and only then writes the zeros: the buffers may
    be the last step's, which that step's copies to the device read until then."""
    offsets = dict.fromkeys(sizes, 0)
    missing = []
    for p in params:
        start, n = offsets[p.dtype], p.numel()
        target = buffers[p.dtype][start : start + n]
        if p.grad is not None and not zero:
            staging.streams.copy(shaped_like(target, p), p.grad)
        else:
            missing.append(target)
        offsets[p.dtype] = start + n
    staging.streams.synchronize()
    for target in missing:
        target.zero_()
    for dtype, buffer in buffers.items():
        buffer[sizes[dtype] :].zero_()
    return buffers


def all_finite(buffers: dict[torch.dtype, torch.Tensor]) -> bool:
    """Whether every element of every buffer is finite."""
    return all(math.isfinite(float(finite_sum(t))) for t in buffers.values())


def unflatten_grads(params: list[torch.nn.Parameter], buffers: dict[torch.dtype, torch.Tensor],
                    staging: HostStaging | None = None) -> None:
    """Sets each parameter's gradient to its slice of the summed buffers (a view: the apply
    phase allocates no second copy of the gradients). Buffers staged in host memory
    (`staging`) are first copied to the parameters' device, once per dtype, on the current
    stream (before the optimizer's kernels; the host does not wait for them)."""
    offsets = dict.fromkeys(buffers, 0)
    on_device: dict[torch.dtype, torch.Tensor] = {}
    for p in params:
        n = p.numel()
        start = offsets[p.dtype]
        buffer = buffers[p.dtype]
        if staging is not None:
            if p.dtype not in on_device:
                on_device[p.dtype] = staging.streams.to_device(buffer, p.device)
            buffer = on_device[p.dtype]
        p.grad = shaped_like(buffer[start : start + n], p)
        offsets[p.dtype] = start + n


def allreduce_flat(comm: Communicator, buffers: dict[torch.dtype, torch.Tensor],
                   meta: torch.Tensor, room: bool = False) -> None:
    """Sums `buffers` and the float64 `meta` over ranks, in place, in the same collectives in
    the same order on every rank (the buffer carrying `meta` first, then the others in dtype
    order of first appearance). With two planes (NCCL) `meta` is summed on its own over the
    control plane, after the gradients.

    Args:
        comm: the generation's communicator.
        buffers: from `flatten_grads`; on a single plane with `room`, flattened with
            `meta_len=len(meta)`, so that `meta` is written into the carrier's room instead of
            joined to it by a copy (an allocation). Afterwards the carrier is its gradients
            only.
        meta: the step's metadata (host memory).
        room: whether the carrier buffer ends with room for `meta`.

    Raises:
        CollectiveError: the communication failed or was aborted.
    """
    if comm.control is not comm:
        for buffer in buffers.values():
            comm.allreduce(buffer)
        comm.control.allreduce(meta)
        return
    carrier = meta_carrier(buffers)
    if carrier is None:
        comm.allreduce(meta)
    else:
        joined = buffers[carrier]
        if room:
            n = joined.numel() - meta.numel()
            assert n >= 0, "the carrier buffer has no room for the metadata"
            joined[n:].copy_(meta)
        else:
            n = joined.numel()
            joined = torch.cat([joined, meta.to(carrier)])
        comm.allreduce(joined)
        buffers[carrier] = joined[:n]
        meta.copy_(joined[n:])
    for dtype, buffer in buffers.items():
        if dtype != carrier:
            comm.allreduce(buffer)
