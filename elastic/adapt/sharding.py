"""Who holds which part of the optimizer state when it is sharded (`ShardingConfig`): the
ownership map of a generation, and what moves between ranks when a new map replaces the old.

A part is one parameter tensor, whole. Whole tensors, not flat slices of the parameter space
(ZeRO) or rows (FSDP2), because then every optimizer that updates each tensor from that
tensor's own gradient and state works sharded with no change to its code: not only the
element-wise ones (SGD, Adam, AdamW) but also those with per-tensor statistics (LAMB and
LARS norms, Adafactor's factored moments, Muon's orthogonalisation), which flat
slices break. Not one that clips by the norm of all its gradients (a LAMB with
`max_grad_norm`): `elastic.trainer.sharding.check_shardable` refuses it. The price is
balance: a rank's load moves in steps of whole tensors, so the
largest tensor bounds how even the map can be (a model whose embedding is a third of its
parameters cannot be spread over more than three owners' worth of ranks); the map reports
its loads and the memory benchmark measures them.

Each part is owned by `replicas` ranks (fewer when the world is smaller). Its owners compute
the same update from the same summed gradient and state, so any `replicas - 1` of them may
be lost and a survivor still holds the part. The first owner listed is the part's primary: it
sends the updated values to the ranks that do not own the part.

A new map keeps every part where it is held already (up to `replicas` holders, and no rank
above the load a fresh map reaches), fills the parts that lost owners onto the least loaded
ranks, and so moves little more than what changed owner: a lost rank's parts, or a joining
rank's fair share. Everything here is plain Python over sizes; the replica moves the tensors.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ownership:
    """The owners of each part in one generation (`owners[part]`: ranks, primary first)."""

    owners: tuple[tuple[int, ...], ...]
    world_size: int

    def owned(self, rank: int) -> tuple[int, ...]:
        """The parts `rank` owns, in part order."""
        return tuple(part for part, ranks in enumerate(self.owners) if rank in ranks)

    def primary(self, part: int) -> int:
        """The owner that sends `part`'s updated values to the ranks without it."""
        return self.owners[part][0]

    def first_alive(self, part: int, absent: Collection[int]) -> int | None:
        """`part`'s first owner that is not among the ranks `absent` (dead since the
        generation formed), None when every owner is."""
        return next((rank for rank in self.owners[part] if rank not in absent), None)

    def loads(self, sizes: Sequence[int]) -> list[int]:
        """Each rank's summed part sizes."""
        loads = [0] * self.world_size
        for part, ranks in enumerate(self.owners):
            for rank in ranks:
                loads[rank] += sizes[part]
        return loads


@dataclass(frozen=True)
class Move:
    """Part `part`'s optimizer state goes from rank `src` (a holder) to rank `dst` (a new
    owner that does not hold it)."""

    part: int
    src: int
    dst: int


def effective_replicas(replicas: int, world_size: int) -> int:
    """Owners per part in a world of `world_size` ranks: `replicas`, or every rank when the
    world is smaller."""
    return max(1, min(replicas, world_size))


def assign(sizes: Sequence[int], world_size: int, replicas: int,
           held: Sequence[Collection[int]] | None = None,
           leaving: Collection[int] = ()) -> Ownership:
    """The ownership map of a generation of `world_size` ranks.

    Args:
        sizes: each part's size (elements; any positive weight).
        world_size: ranks of the generation.
        replicas: owners per part (`effective_replicas` of it).
        held: per part, the ranks of this generation that hold its state already (the
            survivors among its old owners); None or empty sets for a fresh map.
        leaving: ranks on their way out (a planned departure): they own nothing, so the
            parts they hold move to the others (`moves`) before they go. The map is the one
            the others alone would get (same loads), in this generation's ranks.

    Deterministic: every rank computes the same map from the same arguments.
    """
    if leaving:
        return _without(sizes, world_size, replicas, held, frozenset(leaving))
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if any(size < 0 for size in sizes):
        raise ValueError("part sizes must not be negative")
    r = effective_replicas(replicas, world_size)
    cap = max(_lpt_max_load(sizes, world_size, r), -(-r * sum(sizes) // world_size))
    owners: list[list[int]] = [[] for _ in sizes]
    loads = [0] * world_size
    if held is not None:
        if len(held) != len(sizes):
            raise ValueError(f"held names {len(held)} parts, sizes {len(sizes)}")
        for part, ranks in enumerate(held):
            if any(not 0 <= rank < world_size for rank in ranks):
                raise ValueError(f"part {part} is held by ranks {sorted(ranks)}, outside the "
                                 f"world of {world_size}")
        # Keep holders within the cap, the largest parts first: one per part before any part
        # keeps a second, so that a part whose holders are all full still keeps a copy (a
        # newcomer can take only one copy of each part).
        for keep in range(r):
            for part in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
                if len(owners[part]) != keep:
                    continue
                fits = [q for q in sorted(held[part], key=lambda q: (loads[q], q))
                        if q not in owners[part] and loads[q] + sizes[part] <= cap]
                if fits:
                    owners[part].append(fits[0])
                    loads[fits[0]] += sizes[part]
    # Fill what is missing, the largest parts first, onto the least loaded ranks.
    for part in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        while len(owners[part]) < r:
            rank = min((q for q in range(world_size) if q not in owners[part]),
                       key=lambda q: (loads[q], q))
            owners[part].append(rank)
            loads[rank] += sizes[part]
    return Ownership(tuple(tuple(ranks) for ranks in owners), world_size)


def _without(sizes: Sequence[int], world_size: int, replicas: int,
             held: Sequence[Collection[int]] | None, leaving: frozenset[int]) -> Ownership:
    """`assign` over the ranks that stay, its ranks mapped back to this generation's."""
    stay = [q for q in range(world_size) if q not in leaving]
    if not stay:
        raise ValueError(f"every rank of the world of {world_size} is leaving: nobody can "
                         "take their parts")
    index = {q: i for i, q in enumerate(stay)}
    kept = None if held is None else [frozenset(index[q] for q in ranks if q in index)
                                      for ranks in held]
    inner = assign(sizes, len(stay), replicas, kept)
    return Ownership(tuple(tuple(stay[i] for i in ranks) for ranks in inner.owners), world_size)


def _lpt_max_load(sizes: Sequence[int], world_size: int, r: int) -> int:
    """The largest load of a fresh map (each copy, the largest parts first, onto the least
    loaded rank without one): what keeping holders may not exceed, so that a kept map is
    never less even than a fresh one and parts do not move back and forth."""
    heap = [(0, rank) for rank in range(world_size)]
    for part in sorted(range(len(sizes)), key=lambda p: (-sizes[p], p)):
        taken = [heapq.heappop(heap) for _ in range(r)]
        for load, rank in taken:
            heapq.heappush(heap, (load + sizes[part], rank))
    return max(load for load, _ in heap)


def moves(ownership: Ownership, held: Sequence[Collection[int]]) -> list[Move]:
    """What must move for `ownership` to hold: each owner of a part that does not hold it
    receives it from a holder (the one with the fewest sends so far, then the lowest rank).

    Raises:
        ValueError: a part that some rank must receive has no holder (every copy was lost).
    """
    sends = [0] * ownership.world_size
    planned = []
    for part, ranks in enumerate(ownership.owners):
        holders = sorted(held[part])
        for dst in ranks:
            if dst in held[part]:
                continue
            if not holders:
                raise ValueError(f"part {part} has no holder to receive it from")
            src = min(holders, key=lambda q: (sends[q], q))
            sends[src] += 1
            planned.append(Move(part, src, dst))
    return planned


def lost_parts(held: Sequence[Collection[int]]) -> list[int]:
    """The parts no rank holds."""
    return [part for part, ranks in enumerate(held) if not ranks]


def describe(parts: Collection[int]) -> str:
    """Parts by index (`#3, #7`), at most eight named."""
    listed = sorted(parts)
    text = ", ".join(f"#{part}" for part in listed[:8])
    return text + (f" and {len(listed) - 8} more" if len(listed) > 8 else "")
