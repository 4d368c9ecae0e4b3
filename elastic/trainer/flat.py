"""Gradients reduced as flat buffers once the backward pass is over: the path without overlap.

The gradients are concatenated into one buffer per dtype and each buffer is summed over ranks
in one allreduce. The step's metadata (summed loss, one vote per rank, the ledger) rides in the
float64 buffer when there is one (else in the float32 one), so a typical step costs one
allreduce. The counterpart that overlaps the backward pass is `elastic.trainer.buckets`.
"""

from __future__ import annotations

import math

import torch

from elastic.collective import Communicator


def flatten_grads(params: list[torch.nn.Parameter], zero: bool) -> dict[torch.dtype, torch.Tensor]:
    """One buffer per dtype holding the gradients of `params` in order; a parameter without a
    gradient, or every parameter when `zero` (this rank voted the step down), contributes
    zeros, so every rank sends buffers of the same size."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad if (p.grad is not None and not zero) else torch.zeros_like(p)
        groups.setdefault(p.dtype, []).append(g.reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def all_finite(buffers: dict[torch.dtype, torch.Tensor]) -> bool:
    """Whether every element of every buffer is finite."""
    # A sum is not finite iff an element is not (or the sum overflows): 30x cheaper than
    # torch.isfinite(...).all() on a CPU.
    return all(math.isfinite(float(t.sum())) for t in buffers.values())


def unflatten_grads(params: list[torch.nn.Parameter], buffers: dict[torch.dtype, torch.Tensor]) -> None:
    """Sets each parameter's gradient to (a copy of) its slice of the summed buffers."""
    offsets = dict.fromkeys(buffers, 0)
    for p in params:
        n = p.numel()
        start = offsets[p.dtype]
        p.grad = buffers[p.dtype][start : start + n].view_as(p).clone()
        offsets[p.dtype] = start + n


def allreduce_flat(comm: Communicator, buffers: dict[torch.dtype, torch.Tensor],
                   meta: torch.Tensor) -> None:
    """Sums `buffers` and the float64 `meta` over ranks, in place, in the same collectives in
    the same order on every rank (the buffer carrying `meta` first, then the others in dtype
    order of first appearance). With two planes (NCCL) `meta` is summed on its own over the
    control plane, after the gradients.

    Raises:
        CollectiveError: the communication failed or was aborted.
    """
    if comm.control is not comm:
        for buffer in buffers.values():
            comm.allreduce(buffer)
        comm.control.allreduce(meta)
        return
    if torch.float64 in buffers:
        joined = torch.cat([buffers[torch.float64], meta])
        comm.allreduce(joined)
        n = buffers[torch.float64].numel()
        buffers[torch.float64] = joined[:n]
        meta.copy_(joined[n:])
    elif torch.float32 in buffers:  # ledger indices < 2**24 are exact (checked at start)
        joined = torch.cat([buffers[torch.float32], meta.to(torch.float32)])
        comm.allreduce(joined)
        n = buffers[torch.float32].numel()
        buffers[torch.float32] = joined[:n]
        meta.copy_(joined[n:].to(torch.float64))
    else:
        comm.allreduce(meta)
    for dtype, buffer in buffers.items():
        if dtype not in (torch.float64, torch.float32) or (
            dtype == torch.float32 and torch.float64 in buffers
        ):
            comm.allreduce(buffer)
