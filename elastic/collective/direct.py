"""The direct shared-memory allreduce, and the hierarchical allreduce built on it.

Direct, for the ranks of one host (the shared-memory allreduce of DeepSpeed and oneCCL): the
message goes through in chunks of `CollectiveConfig.shm_chunk_bytes`, and rank i of the host
owns slice i of each chunk. For each chunk every rank copies the slices it does not own into
its own shared buffer; once all have (stage 1), each rank reduces its slice in place in its own
tensor, reading the peers' parts straight from their buffers with vectorised torch ops, and
copies the result into its buffer; once all have (stage 2), each rank copies every other slice
from its owner's buffer. Every element is reduced once, by one rank, so every rank ends with
the same bits. Each rank has two buffers and alternates between them: it writes one again only
after every peer has passed stage 2 of the next chunk, that is after they all finished reading
it. The synchronisation is the shared-memory transport's (`HostGroup.stage`): a
word per rank, doorbells and futexes, pidfds for liveness.

Registered buffers: a tensor that lies in this rank's shared region (the trainer takes its flat
gradient buffers there, `Communicator.shared_buffers`) needs no copy in and no per-chunk
synchronisation. Once every rank of the host has entered (stage 1, where the ranks also check
that they all reduce the same registered buffer), each rank reduces its slices of every chunk
in place in its own region, reading the peers' parts straight from their regions, and writes
the result into every peer's region (each peer reads that slice of its region only after
stage 2); then stage 2, after which every rank's region holds the sum and no rank touches
another's again. Two synchronisations per allreduce instead of two per chunk, and the caller's
data is read once from where it lies. Only the rank that reduces a slice reads or writes that
slice of the other ranks' regions between the two stages, so nothing races. The one
difference in guarantees: after a failed allreduce a peer that has not noticed yet may still
write into this rank's registered buffer, whose content is then undefined (the trainer drops
it; the next generation lends new regions).

Hierarchical, for ranks on several hosts: the same inside each host, and between the two
stages the rank that reduced a slice allreduces it over the network with the ranks that
reduced the same slice on the other hosts (one stream per slice owner, so a host's ranks use
the network in parallel and each byte crosses it once per host pair). A host with fewer ranks
than the largest one gives its ranks several slices each.

Every wait is a communicator wait: it ends on abort, at the collective timeout, or when a rank
of this host exited or gave up. Only the calling thread writes into the caller's tensor: its
own slices once every peer's part is in shared memory, the others after stage 2; network
transfers land in scratch, never in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from elastic.collective import algorithms
from elastic.collective.transport import Pending, reduce_into
from elastic.config import ReduceOp

if TYPE_CHECKING:
    from elastic.collective.transport import Collective, HostGroup


# The smallest piece of a registered buffer that crosses between hosts in one swap.
_CROSSING_BYTES = 16 << 20
# Blocks a reduced slice is summed and written out in, to stay in a core's cache.
_BLOCK_BYTES = 256 << 10


def allreduce(comm: Collective, host: HostGroup | None, flat: torch.Tensor,
              op: ReduceOp) -> None:
    """Allreduces `flat` in place: direct inside each host, across hosts between slice owners.

    Without shared memory (`host` None) this is the ring allreduce."""
    if host is None:
        algorithms.ring_allreduce(comm, flat, op)
        return
    slices = max(len(ranks) for ranks in host.hosts)
    owned = range(host.local_rank, slices, len(host.local))
    per = max(1, host.chunk // flat.element_size())
    scratch = None
    offset = host.registered(flat) if len(host.local) > 1 else None
    if len(host.hosts) > 1 and not (offset is not None and len(host.hosts) == 2):
        scratch = torch.empty(-(-min(per, flat.numel()) // slices), dtype=flat.dtype)
    if offset is not None:
        _registered(comm, host, flat, offset, op, slices, owned, scratch)
        return
    for start in range(0, flat.numel(), per):
        _chunk(comm, host, flat[start : start + per], op, slices, owned, scratch)


def _registered(comm: Collective, host: HostGroup, flat: torch.Tensor, offset: int,
                op: ReduceOp, slices: int, owned: range, scratch: torch.Tensor | None) -> None:
    """The allreduce of a registered buffer: stage 1, reduce and write out, stage 2.

    Between two hosts the buffer goes in pieces of at least `_CROSSING_BYTES`, and a piece's
    slices cross while the next piece's are reduced: each swap is posted once the slice is
    reduced inside the host, and finished (summed and written out) after the next piece's
    slices were reduced and posted. Every host takes this path or none does (the links'
    region is agreed over the whole generation), so the swaps' sizes and tags match."""
    n = flat.numel()
    regions = host.registered_views(offset, n, flat.dtype)
    me = host.local_rank
    sequence = host.next_sequence()
    comm.wait([host.stage(2 * sequence - 1, (offset + 1, n * flat.element_size()))])
    swap = len(host.hosts) == 2
    # Pieces of at least _CROSSING_BYTES between hosts: fewer, larger swaps (measured on
    # loopback: 1.3x gloo's busbw with 4 MiB pieces, 1.5x with 16 MiB, no better beyond).
    per = max(1, max(host.chunk, _CROSSING_BYTES if swap else 0) // flat.element_size())
    parts = None
    if swap:
        width = -(-min(per, n) // slices)
        parts = host.scratch(2 * len(owned) * width, flat.dtype).view(2, len(owned), width)
        partner = next(ranks for k, ranks in enumerate(host.hosts) if k != host.host)
    flying: list[tuple[torch.Tensor, torch.Tensor, list[Pending]]] = []

    def finish(flights: list[tuple[torch.Tensor, torch.Tensor, list[Pending]]]) -> None:
        for out, part, pending in flights:
            comm.wait(pending)
            lo = (out.data_ptr() - flat.data_ptr()) // flat.element_size()
            peers = [r[lo : lo + out.numel()] for i, r in enumerate(regions) if i != me]
            _reduce_and_spread(out, [part], peers, op)

    for c, start in enumerate(range(0, n, per)):
        bounds = _bounds(min(per, n - start), slices)
        posted = []
        for k, j in enumerate(owned):
            lo, hi = start + bounds[j], start + bounds[j + 1]
            if lo == hi:
                continue
            out = flat[lo:hi]
            peers = [r[lo:hi] for i, r in enumerate(regions) if i != me]
            if parts is not None or scratch is not None:
                _reduce_and_spread(out, peers, [], op)
            else:
                _reduce_and_spread(out, peers, peers, op)
                continue
            if parts is not None:
                # Addition and max commute exactly: both sides of a swap compute the same.
                peer = partner[j % len(partner)]
                part = parts[c % 2, k, : hi - lo]
                pending = comm.exchange([(out, peer)], [(part, peer)], tag=j + slices * (c % 2))
                posted.append((out, part, pending))
                continue
            assert scratch is not None
            _across_hosts(comm, host, j, out, op, scratch)
            _reduce_and_spread(out, [], peers, op)
        finish(flying)
        flying = posted
    finish(flying)
    comm.wait([host.stage(2 * sequence)])


def _reduce_and_spread(out: torch.Tensor, sources: list[torch.Tensor], targets: list[torch.Tensor],
                       op: ReduceOp) -> None:
    """`out = out op source` for every source, then `out` copied into every target, in blocks
    of `_BLOCK_BYTES`, so that each block of `out` is read from the core's cache after it is
    first loaded."""
    step = max(1, _BLOCK_BYTES // out.element_size())
    for lo in range(0, out.numel(), step):
        block = out[lo : lo + step]
        for source in sources:
            reduce_into(block, source[lo : lo + step], op)
        for target in targets:
            target[lo : lo + step].copy_(block)


def _chunk(comm: Collective, host: HostGroup, chunk: torch.Tensor, op: ReduceOp,
           slices: int, owned: range, scratch: torch.Tensor | None) -> None:
    """One chunk: copy in, stage 1, reduce (and cross hosts), stage 2, copy out.

    The slices this rank reduces are reduced in place in its own tensor (they need no copy in
    or copy out: an eighth less memory traffic on 4 ranks), then copied to its buffer for the
    peers."""
    n = chunk.numel()
    bounds = _bounds(n, slices)
    if len(host.local) == 1:  # alone on its host: every slice crosses from the tensor itself
        assert scratch is not None
        for j in owned:
            if bounds[j] < bounds[j + 1]:
                _across_hosts(comm, host, j, chunk[bounds[j] : bounds[j + 1]], op, scratch)
        return
    sequence = host.next_sequence()
    buffers = [b[:n] for b in host.buffers(sequence, chunk.dtype)]
    me = host.local_rank
    mine = buffers[me]
    if len(owned) == 1:
        lo, hi = bounds[me], bounds[me + 1]
        mine[:lo].copy_(chunk[:lo])
        mine[hi:].copy_(chunk[hi:])
    else:
        mine.copy_(chunk)
    comm.wait([host.stage(2 * sequence - 1, (0, 0))])
    for j in owned:
        lo, hi = bounds[j], bounds[j + 1]
        if lo == hi:
            continue
        out = chunk[lo:hi]
        for i, peer in enumerate(buffers):
            if i != me:
                reduce_into(out, peer[lo:hi], op)
        if scratch is not None:
            _across_hosts(comm, host, j, out, op, scratch)
        mine[lo:hi].copy_(out)
    comm.wait([host.stage(2 * sequence)])
    # Every check passed: the peers' slices are final.
    local = len(buffers)
    for j in range(slices):
        lo, hi = bounds[j], bounds[j + 1]
        if lo < hi and j % local != me:
            chunk[lo:hi].copy_(buffers[j % local][lo:hi])


def _bounds(n: int, parts: int) -> list[int]:
    """Boundaries of `torch.tensor_split(n, parts)`: the first `n % parts` parts are longer."""
    q, r = divmod(n, parts)
    return [j * q + min(j, r) for j in range(parts + 1)]


def _across_hosts(comm: Collective, host: HostGroup, j: int, out: torch.Tensor,
                  op: ReduceOp, scratch: torch.Tensor) -> None:
    """Allreduces slice `j` with its owners on the other hosts, over the network."""
    members = [ranks[j % len(ranks)] for ranks in host.hosts]
    part = scratch[: out.numel()]
    if len(members) == 2:
        # One swap: both sides compute a + b (addition and max commute exactly), in one
        # round trip instead of the ring's two.
        partner = members[1 - host.host]
        comm.wait(comm.exchange([(out, partner)], [(part, partner)], tag=j))
        reduce_into(out, part, op)
        return
    # The ring receives into the tensor it reduces: scratch, so that no network transfer
    # ever lands in the caller's tensor.
    part.copy_(out)
    algorithms.ring_allreduce(_Subgroup(comm, members), part, op)  # type: ignore[arg-type]
    out.copy_(part)


class _Subgroup:
    """The slice owners of every host, seen as a communicator of their own for the ring."""

    def __init__(self, comm: Collective, members: list[int]) -> None:
        self._comm = comm
        self._members = members
        self.rank = members.index(comm.rank)
        self.world_size = len(members)
        self.config = comm.config

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], tag: int = 0) -> list[Pending]:
        m = self._members
        return self._comm.exchange([(t, m[p]) for t, p in sends], [(t, m[p]) for t, p in recvs], tag)

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int = 0,
                    scratch: torch.Tensor | None = None) -> list[Pending]:
        return self._comm.recv_reduce(tensor, self._members[src], op, tag, scratch)

    def wait(self, pending: Sequence[Pending]) -> None:
        self._comm.wait(pending)
