"""Sharded optimizer state (`ShardingConfig`, stage 1): each rank keeps the optimizer state of
the parameters it owns (`elastic.adapt.sharding`: whole tensors, each owned by `replicas`
ranks), steps only those, and the updated values are gathered so that every rank holds the
whole model again before the next forward pass.

How a step goes (the apply phase, `elastic.trainer.apply`): the gradients are summed as in
stage 0 (by any reducer: flat, bucketed or exact) and clipped over all of them; the gradients
of the parameters this rank does not own are dropped, so the optimizer skips them (no state
is ever created for them); the optimizer steps the owned ones; then each part's primary owner
sends its new values to everyone (`gather`), but for a part every rank owns (a world no
larger than `replicas`), which every rank stepped itself as in stage 0. The owners of a part
compute the same update from the same summed gradient and state, so they hold the same bits
(an optimizer whose update differs by rank, drawing random numbers, parts ways as in stage 0
until the next generation forms, which takes every part's values from one holder).

A rank applies a step only once it knows that every rank holds the step's sums (one more
sum over the control plane first: `elastic.trainer.apply.agree`); where that fails, the rank keeps the
step unapplied (`PendingStep`) and the next generation has it apply or drop it, so that no
owner is left a step behind. The step is committed once the owned parameters are stepped.
If the gather fails (a peer died in it), the rank holds its owned parts at the new step but
not all the others: the generation that forms next takes every part's values from an owner.

How a generation forms (`survey`, `take_values`, `place_state`, on every rank of it): the ranks say
which step they hold and which parts' state they hold at it; every part must be held by a
rank at the newest step (else the controller restores a checkpoint first: `lost_parts`);
the parameters are taken from those holders; a new ownership map keeps parts where they are
held and moves the state of the parts that change owner from a holder to each new owner,
peer to peer over the control plane, and each rank drops the state it no longer owns.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastic.adapt.sharding import Move, Ownership, assign, describe, lost_parts, moves
from elastic.errors import CollectiveError, ConfigError
from elastic.trainer.staging import CudaStreams
from elastic.trainer.state import tensor_bytes

# Largest buffer of parameter values one gather reduces at a time (elements), unless one part
# is larger: the gather allocates one such buffer beside the model (on NCCL two, one summed
# while the other is filled).
_GATHER_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PendingStep:
    """A step whose sums this rank holds but did not apply: its reduce completed, but the
    agreement after it (`elastic.trainer.apply.agree`) failed, so this rank cannot know whether every rank
    holds the sums. If any rank applied the step (the agreement completed there, so every
    rank's reduce did), the next generation takes `step` as its step and this rank applies
    it first (`apply`, with no collective); else it drops it (`drop`). Either way no owner of
    a part is left a step behind the others."""

    step: int  # the committed step once applied
    apply: Callable[[], None]
    drop: Callable[[], None]


@dataclass(frozen=True)
class Survey:
    """What the ranks of a forming generation hold (`OptimizerShards.survey`): the newest
    committed step, per part the ranks that hold its state at that step, and the new map."""

    newest: int
    holders: tuple[frozenset[int], ...]
    ownership: Ownership


class OptimizerShards:
    """This rank's share of the optimizer state.

    Args:
        params: the parameters that train (the parts, in order).
        optimizer: the run's optimizer (over those parameters, in any groups).
        replicas: owners per part (`ShardingConfig.replicas`).
        state_bytes: the most state per element a peer may send this rank when it holds
            none (`ShardingConfig.max_state_bytes_per_element`).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 replicas: int, state_bytes: int = 24) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.replicas = replicas
        self.state_bytes = state_bytes
        self.sizes = [p.numel() for p in self.params]
        # The optimizer's state-dict id of each part (None: the optimizer does not step it).
        ids = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups
                                              for p in group["params"])}
        self.state_ids = [ids.get(id(p)) for p in self.params]
        self.ownership: Ownership | None = None
        # A replica that has never stepped holds every part's state at step 0 (none yet,
        # or what the optimizer made when it was built).
        self.held: frozenset[int] = frozenset(range(len(self.params)))
        self.rank = 0
        self._kept: dict[int, dict[str, Any]] | None = None  # see `keep`
        self.pending: PendingStep | None = None

    @property
    def owned(self) -> frozenset[int]:
        """The parts this rank steps: all of them until a generation has formed."""
        if self.ownership is None:
            return self.held
        return frozenset(self.ownership.owned(self.rank))

    # --- the step -----------------------------------------------------------------------

    def drop_unowned_grads(self) -> None:
        """Before the optimizer step: the parts this rank does not own keep no gradient, so
        the optimizer skips them."""
        owned = self.owned
        for part, p in enumerate(self.params):
            if part not in owned:
                p.grad = None

    def gather(self, comm: Any, streams: Any | None) -> None:
        """After the optimizer step: every rank takes each part's values from its primary
        owner (`_take_from`); a part every rank owns (a world no larger than
        `sharding.replicas`) every rank has stepped itself, as in stage 0, and nothing moves
        (before, such a world summed the whole model once more every step, for nothing)."""
        assert self.ownership is not None, "no ownership map: a generation must form first"
        owners = self.ownership.owners
        self._take_from(comm, [None if len(owners[part]) >= comm.world_size else owners[part][0]
                               for part in range(len(self.params))], streams)

    def _take_from(self, comm: Any, sources: Sequence[int | None], streams: Any | None) -> None:
        """Every rank takes part `p`'s values from rank `sources[p]`: one sum over the ranks
        per window of parts of a dtype, of a buffer that holds the parts this rank is the
        source of and zeros elsewhere (a sum with zeros is exact, so every rank gets the
        source's bits). A generation of one rank is its own source: nothing moves; nor does a
        part whose source is None (every rank holds its values).

        `streams`: GPU parameters on a host plane go through page-locked host memory, with
        these stream operations (`elastic.trainer.staging.CudaStreams`): the copies from the
        GPU are queued, then waited for once per window before the sum reads them (a
        blocking copy would wait for the device once per part); None: the buffer is on the
        parameters' device. There, on NCCL, a window's sum is only started
        (`Communicator.start_allreduce`) and the next window is filled while it runs: two
        windows at a time, in two buffers used in turn (`_Windows`), so that NCCL's stream
        usually has the next sum queued when one ends.

        Raises:
            CollectiveError: the communication failed or was aborted.
        """
        rank = comm.rank
        if comm.world_size == 1:
            return
        windows = (_Windows(comm, functools.partial(self._took, sources=sources, rank=rank))
                   if streams is None and comm.starts_allreduce else None)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for part, p in enumerate(self.params):
            if sources[part] is not None:
                by_dtype.setdefault(p.dtype, []).append(part)
        for dtype, parts in by_dtype.items():
            cut = _windows(parts, self.sizes, _GATHER_ELEMENTS)
            cap = min(_GATHER_ELEMENTS, max(sum(self.sizes[p] for p in window) for window in cut))
            for window in cut:
                device = self.params[window[0]].device
                total = sum(self.sizes[part] for part in window)
                if windows is not None:
                    flat = windows.buffer(total, cap, dtype, device)
                elif streams is not None:
                    flat = streams.pinned(total, dtype)
                else:
                    flat = torch.zeros(total, dtype=dtype, device=device)
                self._fill(flat, window, sources, rank, streams)
                if windows is not None:
                    windows.start(window, flat)
                    continue
                if streams is not None:
                    streams.synchronize()  # the host's sum reads what the device copied
                comm.allreduce(flat)
                if streams is not None:
                    flat = streams.to_device(flat, device)
                self._took(window, flat, sources, rank)
        if windows is not None:
            windows.finish()

    def _fill(self, flat: torch.Tensor, window: list[int], sources: Sequence[int | None], rank: int,
              streams: Any | None) -> None:
        """A window's buffer: this rank's parts (those it is the source of), zeros elsewhere."""
        if streams is not None:
            flat.zero_()
        offset = 0
        for part in window:
            n = self.sizes[part]
            if sources[part] == rank:
                source = self.params[part].detach().reshape(-1)
                if streams is not None:
                    streams.copy(flat[offset : offset + n], source)
                else:
                    flat[offset : offset + n].copy_(source)
            offset += n

    def _took(self, window: list[int], flat: torch.Tensor, sources: Sequence[int | None],
              rank: int) -> None:
        """A window's sum: the parts of others copied into this rank's parameters."""
        offset = 0
        with torch.no_grad():
            for part in window:
                n = self.sizes[part]
                if sources[part] != rank:
                    self.params[part].copy_(flat[offset : offset + n].view_as(self.params[part]))
                offset += n

    # --- forming a generation -------------------------------------------------------------

    def keep(self, current: bool) -> dict[int, dict[str, Any]]:
        """As a generation forms, once the target step is known: the optimizer state of the
        parts this rank holds, by part, if it holds them at that step (`current`), kept here
        until `place_state` installs them (loading the source's replicated state empties the
        optimizer, and an attempt that fails after that must not lose them); else nothing,
        and this rank no longer claims any part."""
        if not current:
            self._kept, self.held = {}, frozenset()
        elif self._kept is None:
            state = self.optimizer.state
            self._kept = {part: state[p] for part, p in enumerate(self.params)
                          if part in self.held and p in state}
        return self._kept

    def survey(self, control: Any, step: int, src: int, leaving: Collection[int] = ()) -> Survey:
        """First as a generation forms, on every rank of it (`step`: the committed step this
        rank held before, -1 for none): which step each rank holds and which parts' state it
        holds at it, and the generation's ownership map from that. The generation takes the
        step of rank `src` (the newest, or a checkpoint's that the controller loaded into it
        when parts of the newest were lost: then the ranks ahead of it drop theirs).
        `leaving`: ranks about to leave (a planned departure), which own nothing in the map:
        the parts they hold move to the others as the generation forms.

        Raises:
            CollectiveError: the communication failed, or some part has no holder at `src`'s
                step (the controller restores a checkpoint first when it sees that:
                `elastic.control.decisions.restore_source`).
        """
        rank, world = control.rank, control.world_size
        table = torch.zeros(world, 2 + len(self.params), dtype=torch.float64)
        table[rank, 0] = step
        table[rank, 1] = self.pending.step if self.pending is not None else -1
        for part in self.held:
            table[rank, 2 + part] = 1.0
        control.allreduce(table)
        steps = [int(s) for s in table[:, 0].tolist()]
        newest = steps[src]
        # A rank holding the newest step unapplied (`PendingStep`) holds its parts at it too.
        at = [q for q in range(world) if newest in (steps[q], int(table[q, 1]))]
        holders = [frozenset(q for q in at if table[q, 2 + part] > 0)
                   for part in range(len(self.params))]
        missing = lost_parts(holders)
        if missing:
            raise CollectiveError(
                f"no rank holds the optimizer state of step {newest} of parameter(s) "
                f"{describe(missing)}: every owner of them was lost", rank=rank)
        return Survey(newest, tuple(holders),
                      assign(self.sizes, world, self.replicas, holders, leaving))

    def take_values(self, data: Any, survey: Survey, streams: Any | None) -> None:
        """Every rank takes each part's values at the newest step from a holder (the new
        primary where it holds the part): a rank whose gather failed, or that is a step
        behind, then holds the whole model of the newest step."""
        ownership, holders = survey.ownership, survey.holders
        sources = [ownership.primary(part) if ownership.primary(part) in holders[part]
                   else min(holders[part]) for part in range(len(self.params))]
        self._take_from(data, sources, streams)

    def place_state(self, control: Any, survey: Survey,
                    kept: dict[int, dict[str, Any]]) -> list[Move]:
        """Last as a generation forms: the state of the parts that change owner moves from a
        holder to each new owner (`_move_state`); once every rank has what it receives (one
        more sum over the control plane), each holds the state of the parts it owns under the
        new map and no other. `kept`: this rank's held parts' state (`keep`) if it holds the
        target step, else empty. Returns what moved.

        A rank where this fails keeps what it held and what it received, and claims both in
        the next attempt; no rank drops a part before every rank has received its own. So a
        rank lost in the middle (a leaver dying in its hand-over) costs at most its own
        parts, never one that was on its way between two others.

        Raises:
            CollectiveError: the communication failed, or a peer announced more bytes than
                the parts it gives can hold.
        """
        rank = control.rank
        plan = moves(survey.ownership, survey.holders)
        received: dict[int, dict[str, Any]] = {}
        try:
            _move_state(control, plan, kept, self.params, self.state_bytes, received)
        finally:  # what arrived before a failure too
            if received:
                self._kept = {**kept, **received}
                self.held = self.held | received.keys()
        _all_received(control)
        owned = frozenset(survey.ownership.owned(rank))
        self._install({**kept, **received}, owned)
        self.ownership, self.rank, self.held = survey.ownership, rank, owned
        self._kept = None
        return plan

    def _install(self, states: dict[int, dict[str, Any]], owned: frozenset[int]) -> None:
        """The optimizer holds `states` for the parts in `owned` and nothing for the others
        (`load_state_dict`: each tensor cast to its parameter's device and dtype as the
        optimizer's own policy says)."""
        whole = self.optimizer.state_dict()
        whole["state"] = {self.state_ids[part]: states[part] for part in sorted(owned)
                          if part in states and self.state_ids[part] is not None}
        self.optimizer.load_state_dict(whole)

    def load_whole(self, states: dict[int, dict[str, Any]]) -> None:
        """A checkpoint was loaded: this rank holds every part, their optimizer state
        (`states`, by state id, as `optimizer.state_dict()['state']` holds them) kept here in
        host memory, not in the optimizer, until the next generation places each part with
        its owners (`keep`, `place_state`)."""
        part_of = {sid: part for part, sid in enumerate(self.state_ids) if sid is not None}
        self.held = frozenset(range(len(self.params)))
        self._kept = {part_of[sid]: dict(state) for sid, state in states.items()
                      if sid in part_of}

    def primary_states(self, absent: Collection[int] = ()) -> dict[int, dict[str, Any]]:
        """The optimizer state of the parts this rank is the first owner of (all it holds
        before a generation has formed), by state id: what it writes as its shard of a
        checkpoint, so that each part is written once. `absent`: ranks of this generation
        that died since it formed; a part whose first owner is one of them is written by its
        first owner that is not."""
        if self.ownership is None:
            return self.part_states(self.held)
        ownership, absent = self.ownership, set(absent)
        return self.part_states([part for part in range(len(self.params))
                                 if ownership.first_alive(part, absent) == self.rank])

    def orphaned(self, absent: Collection[int]) -> list[int]:
        """The parts every owner of which is among the ranks `absent` (none before a
        generation has formed: then every rank holds every part)."""
        if self.ownership is None:
            return []
        ownership, absent = self.ownership, set(absent)
        return [part for part in range(len(self.params))
                if ownership.first_alive(part, absent) is None]

    def part_states(self, parts: Collection[int]) -> dict[int, dict[str, Any]]:
        """The optimizer state of `parts` (which this rank holds) by state-dict id, as
        `optimizer.state_dict()['state']` holds them."""
        state, kept = self.optimizer.state, self._kept or {}
        out: dict[int, dict[str, Any]] = {}
        for part in sorted(parts):
            sid = self.state_ids[part]
            if sid is None:
                continue
            if self.params[part] in state:
                out[sid] = dict(state[self.params[part]])
            elif part in kept:  # a checkpoint's, not placed yet (`load_whole`)
                out[sid] = dict(kept[part])
        return out



class _Windows:
    """The gather's windows on NCCL: each window's sum started, at most two at a time, in two
    buffers used in turn, each finished in order (`comm.wait`, after which the caller's
    stream sees the sum) before its buffer is filled again. A buffer holds `cap` elements
    (the largest window of its dtype, up to `_GATHER_ELEMENTS`): the gather holds two such
    beside the model. A part larger than that goes alone in a buffer of its own once the
    windows before it are finished (beside at most one window after it), and is not kept;
    buffers of another dtype or too small are let go only once every running sum has
    finished, so that the allocator can reuse their memory at once (memory a running NCCL
    sum may still read is held back until it ends)."""

    def __init__(self, comm: Any, took: Callable[[list[int], torch.Tensor], None]) -> None:
        self.comm, self.took = comm, took
        # (window, its slice of the buffer, the buffer to keep or None, the sum's handles),
        # oldest first
        self.running: list[tuple[list[int], torch.Tensor, torch.Tensor | None, list[Any]]] = []
        self.free: list[torch.Tensor] = []  # buffers whose window is finished
        # The buffer of the window `buffer` gave, to keep once its sum ends (None: a large
        # part's, let go).
        self._keep: torch.Tensor | None = None

    def buffer(self, total: int, cap: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """A zeroed buffer of `total` elements for the next window (the oldest running one
        finished first when two run)."""
        if len(self.running) == 2:
            self._finish_oldest()
        fits = [b for b in self.free if b.dtype == dtype and b.device == device
                and b.numel() >= total]
        if fits:
            self.free.remove(fits[0])
            base = fits[0]
        else:
            if self.free or total > cap:  # let go of them with no sum running behind them
                self.finish()
                self.free.clear()
            base = torch.empty(max(total, cap), dtype=dtype, device=device)
        self._keep = base if base.numel() <= cap else None
        flat = base[:total]
        flat.zero_()
        return flat

    def start(self, window: list[int], flat: torch.Tensor) -> None:
        """Starts the sum of the window `buffer` gave, filled."""
        self.running.append((window, flat, self._keep, self.comm.start_allreduce(flat)))
        self._keep = None

    def finish(self) -> None:
        while self.running:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        window, flat, base, started = self.running.pop(0)
        self.comm.wait(started)  # the caller's stream then follows the sum
        self.took(window, flat)
        if base is not None:  # a large part's buffer is not kept
            self.free.append(base)


def _windows(parts: Sequence[int], sizes: Sequence[int], limit: int) -> list[list[int]]:
    """`parts` in runs of at most `limit` elements (a larger part alone)."""
    windows: list[list[int]] = []
    current: list[int] = []
    total = 0
    for part in parts:
        if current and total + sizes[part] > limit:
            windows.append(current)
            current, total = [], 0
        current.append(part)
        total += sizes[part]
    if current:
        windows.append(current)
    return windows


def _move_state(control: Any, plan: Sequence[Move], mine: dict[int, dict[str, Any]],
                params: Sequence[torch.nn.Parameter], state_bytes: int = 24,
                received: dict[int, dict[str, Any]] | None = None) -> dict[int, dict[str, Any]]:
    """Carries out `plan` over the control plane in rounds: in round k each rank sends to the
    rank k after it and receives from the rank k before it (a pair with nothing to move skips
    the round; both sides read that from the plan), the size first, then one message with
    every part it gives that receiver. So a rank holds its state, one payload it makes and
    one it receives at a time, however many peers it gives to or takes from (before, every
    payload was made first: a rank giving most of its parts at a resize held them twice).
    Returns the parts this rank received, their tensors in host memory; with `received`, adds
    them there as they arrive (what came before a failure is kept).

    Raises:
        CollectiveError: the communication failed, or a peer announced more bytes than the
            parts it gives can hold (refused before they are allocated).
    """
    rank, world = control.rank, control.world_size
    received = {} if received is None else received
    outgoing: dict[int, list[int]] = {}
    incoming: dict[int, list[int]] = {}
    for m in plan:
        if m.src == rank:
            outgoing.setdefault(m.dst, []).append(m.part)
        if m.dst == rank:
            incoming.setdefault(m.src, []).append(m.part)
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        gives, takes = dst in outgoing, src in incoming
        if not gives and not takes:
            continue
        data = (_serialise({part: mine[part] for part in outgoing[dst] if part in mine})
                if gives else memoryview(b""))
        size = torch.zeros(1, dtype=torch.int64)
        _exchange(control, [(torch.tensor([len(data)], dtype=torch.int64), dst)] if gives else [],
                  [(size, src)] if takes else [])
        buf = torch.empty(_announced(size, src, incoming.get(src, []), params, mine, state_bytes,
                                     rank) if takes else 0, dtype=torch.uint8)
        _exchange(control,
                  [(torch.frombuffer(data, dtype=torch.uint8), dst)] if len(data) else [],  # no copy
                  [(buf, src)] if buf.numel() else [])
        del data
        if buf.numel():
            parts = torch.load(_Reader(buf), weights_only=True, map_location="cpu")
            received.update({part: parts[part] for part in incoming[src] if part in parts})
    return received


def _announced(size: torch.Tensor, src: int, parts: Sequence[int],
               params: Sequence[torch.nn.Parameter], mine: dict[int, dict[str, Any]],
               state_bytes: int, rank: int) -> int:
    """The byte count rank `src` announced for `parts`, checked against what they can hold.

    Raises:
        CollectiveError: it announced more.
    """
    announced = int(size.item())
    limit = _state_bound(params, parts, mine, state_bytes)
    if not 0 <= announced <= limit:
        raise CollectiveError(
            f"rank {src} announced {announced} bytes of optimizer state for "
            f"{len(parts)} parameter(s) of at most {limit}; refused (an optimizer "
            "that keeps more state per parameter element than "
            f"sharding.max_state_bytes_per_element = {state_bytes}: raise it)", rank=rank)
    return announced


class _Reader(io.RawIOBase):
    """A file over a received byte tensor, read where it lies (before, `torch.load` read a
    copy of all of it: the receiver held its parts' bytes twice before loading them)."""

    def __init__(self, data: torch.Tensor) -> None:
        self._view = memoryview(data.numpy()).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _all_received(control: Any) -> None:
    """One sum over the control plane that completes on a rank only once every rank has
    received its parts (each adds its one after `_move_state`).

    Raises:
        CollectiveError: the sum failed.
    """
    control.allreduce(torch.ones(1, dtype=torch.float64))


def _exchange(control: Any, sends: list[tuple[torch.Tensor, int]],
              recvs: list[tuple[torch.Tensor, int]]) -> None:
    if sends or recvs:
        control.wait(control.exchange(sends, recvs))


def _serialise(parts: dict[int, dict[str, Any]]) -> memoryview:
    """Parts' optimizer state, tensors in host memory: a writable view of the serialised
    bytes, sent as it is (before, the bytes were copied twice more: `getvalue`, then a
    bytearray for the tensor to send; a checkpoint restored at stage 1 had the loading worker
    hold about five times the optimizer state)."""
    host = {part: {key: (value.detach().cpu() if isinstance(value, torch.Tensor) else value)
                   for key, value in state.items()} for part, state in parts.items()}
    buffer = io.BytesIO()
    torch.save(host, buffer)
    return buffer.getbuffer()


# Room for what is not a parameter-sized tensor (step counters, pickling).
_STATE_SLACK = 1 << 20


def _state_bound(params: Sequence[torch.nn.Parameter], parts: Sequence[int],
                 mine: dict[int, dict[str, Any]], state_bytes: int = 24) -> int:
    """The most bytes a peer may announce for the optimizer state of `parts`, checked before
    they are allocated: `state_bytes` per element of each part (24: Adam with amsgrad, three
    float64 tensors), or, for an optimizer that keeps more (preconditioners), twice what this
    rank's own parts' state takes per element."""
    held = sum(tensor_bytes(state) for state in mine.values())
    elements = sum(params[part].numel() for part in mine) or 1
    per_element = max(state_bytes, 2 * held / elements)
    return int(sum(per_element * params[part].numel() + _STATE_SLACK // 16 for part in parts)
               + _STATE_SLACK)


class ShardedHost(Protocol):
    """What forming a generation with sharded state reads and changes of a replica."""

    shards: OptimizerShards
    device: torch.device
    # The end of a committed step whose gather failed (`elastic.trainer.apply`), run once the
    # parameters are whole again.
    unfinished: Callable[[], None] | None

    @property
    def restorable_step(self) -> int: ...


def sync_sharded(host: ShardedHost, comm: Any, src: int,
                 sync_replicated: Callable[[], None], leaving: Collection[int] = ()) -> list[Move]:
    """Every rank of a new generation calls this (sharded state); afterwards all hold the
    committed step of rank `src`: a step this rank holds unapplied applied or dropped
    (`PendingStep`), the parameters from the parts' holders (`take_values`), a step left
    unfinished by a failed gather completed, `src`'s replicated state
    (`sync_replicated`: everything but the optimizer's per-parameter state), and each rank
    the optimizer state of the parts it owns under the new map (`place_state`; the ranks in
    `leaving` own none: they hand theirs over before a planned departure). Returns what
    moved.

    Raises:
        CollectiveError: the communication failed, or some part has no holder at the newest
            step.
    """
    shards = host.shards
    step = host.restorable_step
    survey = shards.survey(comm.control, step, src, leaving)
    pending, shards.pending = shards.pending, None
    if pending is not None and pending.step == survey.newest and step >= 0:
        pending.apply()  # its parts at the generation's step, the rest to come below
        step = host.restorable_step
    elif pending is not None:
        pending.drop()
    current = step == survey.newest
    kept = shards.keep(current)
    shards.take_values(comm, survey, staged_streams(host.device, comm))
    unfinished, host.unfinished = host.unfinished, None
    if unfinished is not None and current:
        unfinished()
    sync_replicated()
    return shards.place_state(comm.control, survey, kept)


def staged_streams(device: torch.device, comm: Any) -> Any | None:
    """The stream operations through which GPU parameters move on a host plane (the
    communicator is its own control plane: no NCCL), or None."""
    return CudaStreams() if device.type == "cuda" and comm.control is comm else None


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuses optimizers whose step is not one update per parameter from that parameter's
    own gradient and state (what owning whole tensors needs).

    Raises:
        ConfigError: the optimizer needs a closure over the whole model (L-BFGS), shards
            state itself, or clips by the norm of every gradient it steps (`max_grad_norm`
            above 0, as timm's and apex's LAMB by default): each owner would clip by the
            norm of its own parts, and the owners of a part would part ways.
    """
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS) or name == "ZeroRedundancyOptimizer":
        raise ConfigError(
            f"sharding.stage 1 steps each parameter on its owners only, but {name} "
            + ("re-evaluates the loss over the whole model in its step"
               if isinstance(optimizer, torch.optim.LBFGS) else "shards its state itself")
            + "; set sharding.stage=0")
    clipped = [g.get("max_grad_norm") for g in optimizer.param_groups]
    if any(isinstance(v, int | float) and v > 0 for v in clipped):
        raise ConfigError(
            f"sharding.stage 1 steps each parameter on its owners only, but {name} clips by the "
            f"norm of all the gradients it steps (max_grad_norm = {max(v or 0 for v in clipped)}):"
            " each owner would see only its own parts. Give the optimizer max_grad_norm=0 and "
            "set training.clip_grad_norm instead (computed over every gradient), or set "
            "sharding.stage=0")
