"""Allreduce algorithms over point-to-point transfers.

Each function works on flat contiguous tensors of a communicator's rank and returns when the
result is in place. Costs, with alpha per message, beta per byte and p ranks (Thakur,
Rabenseifner and Gropp 2005):

- ring: `2(p-1) alpha + 2 (p-1)/p n beta`, bandwidth-optimal for any p; pipelined in
  segments so that reduction overlaps transfer.
- tree (binomial reduce, then binomial broadcast): `2 ceil(lg p) (alpha + n beta)`; few
  messages, so good for small buffers, but every level moves the whole buffer.
- halving_doubling (Rabenseifner): `2 lg p alpha + 2 (p-1)/p n beta` for p a power of two;
  other p first fold the extra ranks into their neighbours, then unfold at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elastic.config import ReduceOp

if TYPE_CHECKING:
    from elastic.collective.transport import Collective


def _segments(tensor: torch.Tensor, segment_bytes: int) -> list[torch.Tensor]:
    per = max(1, segment_bytes // max(1, tensor.element_size()))
    return list(tensor.split(per)) if tensor.numel() else []


# --- ring -----------------------------------------------------------------------------------


def ring_reduce_scatter(comm: Collective, chunks: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        op: ReduceOp) -> None:
    """After `p-1` steps rank r holds chunk r reduced over all ranks.

    Step k sends chunk `r-k-1` to the right neighbour and reduces chunk `r-k-2` with what the
    left neighbour sends. Each chunk travels in segments, all posted at once, so that each
    segment is reduced while later ones are still arriving (over shared memory, straight out of
    the byte ring as its bytes arrive; otherwise from scratch once the segment is in).
    """
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    seg_bytes = comm.config.segment_bytes
    largest = max(c.numel() for c in chunks)
    scratch = torch.empty(largest, dtype=chunks[0].dtype, device=chunks[0].device)
    sends: list = []
    for k in range(n - 1):
        out_chunk = chunks[(r - k - 1) % n]
        in_chunk = chunks[(r - k - 2) % n]
        in_scratch = _segments(scratch[: in_chunk.numel()], seg_bytes)
        recv_handles = [
            comm.recv_reduce(seg, left, op, tag, buf)
            for tag, (seg, buf) in enumerate(zip(_segments(in_chunk, seg_bytes), in_scratch, strict=True))
        ]
        for tag, seg in enumerate(_segments(out_chunk, seg_bytes)):
            sends.extend(comm.exchange([(seg, right)], [], tag))
        for handles in recv_handles:
            comm.wait(handles)
        # The next step sends what was just reduced and reduces into a chunk that no send
        # still outstanding reads (nor the scratch buffer), so only the receives had to
        # finish here.
    comm.wait(sends)


def ring_allgather(comm: Collective, chunks: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
    """Rank r starts holding chunk r; after `p-1` steps every rank holds every chunk."""
    n, r = comm.world_size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    seg_bytes = comm.config.segment_bytes
    pending: list = []
    for k in range(n - 1):
        out_chunk = chunks[(r - k) % n]
        in_chunk = chunks[(r - k - 1) % n]
        recvs = []
        for tag, seg in enumerate(_segments(in_chunk, seg_bytes)):
            recvs.extend(comm.exchange([], [(seg, left)], tag))
        for tag, seg in enumerate(_segments(out_chunk, seg_bytes)):
            pending.extend(comm.exchange([(seg, right)], [], tag))
        # What arrives now is sent on in the next step.
        comm.wait(recvs)
    comm.wait(pending)


def ring_allreduce(comm: Collective, flat: torch.Tensor, op: ReduceOp) -> None:
    """Ring allreduce: reduce-scatter, then allgather (Patarasuk and Yuan 2009)."""
    chunks = flat.tensor_split(comm.world_size)
    ring_reduce_scatter(comm, chunks, op)
    ring_allgather(comm, chunks)


# --- tree -----------------------------------------------------------------------------------


def tree_allreduce(comm: Collective, flat: torch.Tensor, op: ReduceOp) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0."""
    n, r = comm.world_size, comm.rank
    scratch = torch.empty_like(flat)
    mask = 1
    while mask < n:
        if r & mask:
            comm.wait(comm.exchange([(flat, r - mask)], []))
            break
        if r + mask < n:
            comm.wait(comm.recv_reduce(flat, r + mask, op, scratch=scratch))
        mask <<= 1
    # Broadcast down the same tree: receive from the parent, then feed the children,
    # largest subtree first.
    if r:
        low = r & -r
        comm.wait(comm.exchange([], [(flat, r - low)]))
    else:
        low = 1
        while low < n:
            low <<= 1
    pending = []
    child_mask = low >> 1
    while child_mask:
        if r + child_mask < n:
            pending.extend(comm.exchange([(flat, r + child_mask)], []))
        child_mask >>= 1
    comm.wait(pending)


# --- recursive halving and doubling ----------------------------------------------------------


def halving_doubling_allreduce(comm: Collective, flat: torch.Tensor, op: ReduceOp) -> None:
    """Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling
    allgather, over the largest power of two `q <= p` ranks.

    The first `2(p-q)` ranks pair up first: each even rank of them hands its whole buffer to
    the odd rank above it and sits out; at the end it gets the result back.
    """
    n, r = comm.world_size, comm.rank
    q = 1 << (n.bit_length() - 1)
    extra = n - q
    if r < 2 * extra:
        if r % 2 == 0:
            comm.wait(comm.exchange([(flat, r + 1)], []))
            comm.wait(comm.exchange([], [(flat, r + 1)]))
            return
        comm.wait(comm.recv_reduce(flat, r - 1, op))
        vrank = r // 2
    else:
        vrank = r - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    blocks = flat.tensor_split(q)
    offsets = [0]
    for b in blocks:
        offsets.append(offsets[-1] + b.numel())

    def span(lo: int, hi: int) -> torch.Tensor:
        return flat[offsets[lo] : offsets[hi]]

    scratch = torch.empty(flat.numel() - flat.numel() // 2 + q, dtype=flat.dtype, device=flat.device)
    lo, hi = 0, q
    mask = q >> 1
    while mask:
        partner = real(vrank ^ mask)
        mid = (lo + hi) // 2
        if vrank & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kept = span(*keep)
        received = comm.recv_reduce(kept, partner, op, scratch=scratch[: kept.numel()])
        comm.wait([*received, *comm.exchange([(span(*give), partner)], [])])
        lo, hi = keep
        mask >>= 1
    # Now vrank holds block vrank; double the owned span each round.
    mask = 1
    while mask < q:
        partner_v = vrank ^ mask
        partner_lo = partner_v & ~(mask - 1)
        comm.wait(comm.exchange(
            [(span(lo, hi), real(partner_v))],
            [(span(partner_lo, partner_lo + mask), real(partner_v))],
        ))
        lo, hi = min(lo, partner_lo), max(hi, partner_lo + mask)
        mask <<= 1
    if r < 2 * extra:
        comm.wait(comm.exchange([(flat, r - 1)], []))
