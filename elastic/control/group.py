"""The worker group: how many workers to start, who is admitted, who is dropped, forming a
generation from the members, and waiting for capacity.

These functions decide; the `Workers` port in the context starts and kills processes.

No Ray here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from elastic.adapt.sharding import describe
from elastic.control import decisions
from elastic.control.context import Context
from elastic.control.cursor import Cursor
from elastic.control.policy import Fail
from elastic.control.port import Gathered, Member
from elastic.errors import (
    CallbackError,
    ConfigError,
    GenerationOutOfMemoryError,
    MembersLostError,
    RendezvousError,
    WorkerLostError,
)
from elastic.events import (
    CheckpointFailed,
    Generation,
    GenerationFailed,
    MemberUnreachable,
    Planned,
    ShardsLost,
    SpareLost,
    SparePromoted,
    SpareReady,
    WorkerJoined,
    WorkerLost,
    WorkerRetired,
    WorkerStartFailed,
    WorkerStarting,
)

T = TypeVar("T")


def top_up(ctx: Context) -> None:
    """Starts workers in the background until members plus starting ones reach the target,
    then hot spares (`ScalingConfig.spares`); then, unless the user set the size with
    `scale`, uses free cluster capacity up to max_workers (a node that joins is used at the
    next boundary)."""
    if ctx.start_failures >= ctx.config.failure.max_start_failures:
        return  # each would fail as the last ones did (said once, by `admit`)
    requests = ctx.requests
    with requests.lock:
        target, grow = requests.target, not requests.scaled_by_user
    spares = ctx.config.scaling.spares
    # A started worker joins the members while they are below the target and waits as a
    # spare otherwise (`admit`): `held` counts both, and those starting.
    while _held(ctx) < target + spares:
        reason = ("replacement" if len(ctx.members) + ctx.workers.starting() < target
                  else "spare")
        ctx.workers.spawn()
        ctx.log.emit(WorkerStarting(reason=reason, target=target))
    scaling = ctx.config.scaling
    upper = scaling.upper
    if scaling.use_gpu and scaling.gpus_per_worker < 1:
        # Free fractions of GPUs may lie on different GPUs: no more workers than fit
        # (`elastic.control.decisions.gpu_worker_slots`).
        upper = min(upper, ctx.workers.placeable())
    while grow and _held(ctx) - spares < upper and ctx.workers.free_slot():
        ctx.workers.spawn()
        with requests.lock:
            grow = not requests.scaled_by_user  # a scale() since: its target stands
            if grow:
                requests.target = max(requests.target, _held(ctx) - spares)
            target = requests.target
        ctx.log.emit(WorkerStarting(reason="capacity", target=target))


def _held(ctx: Context) -> int:
    """Members, spares and workers starting."""
    return len(ctx.members) + len(ctx.spares) + ctx.workers.starting()


def admit(ctx: Context, timeout: float) -> bool:
    """Moves started workers into the members (not yet into a generation) while they are
    below the target, else into the spares while they are short. True if members joined."""
    if not ctx.workers.starting():
        return False
    started = ctx.workers.admit(None, timeout)
    for error in started.failed:
        ctx.log.emit(WorkerStartFailed(error=first_line(error)))
    # Those that would fail again (the job's factories raised, the worker could not be
    # built); not a worker whose node died as it started.
    _count_start_failures(ctx, sum(isinstance(e, ConfigError) for e in started.failed))
    with ctx.requests.lock:
        target = ctx.requests.target
    joined = False
    for member in started.members:
        problem = decisions.data_set_mismatch([member], ctx.dataset_size)
        if problem is not None:  # not one of this run: as a worker whose factory raised
            ctx.workers.release(member.worker_id)
            ctx.log.emit(WorkerStartFailed(error=problem))
            _count_start_failures(ctx, 1)
            continue
        ctx.start_failures = 0
        for notice in ctx.requests.gone([member.worker_id]):  # told to leave while starting
            ctx.workers.release(member.worker_id)
            ctx.log.emit(WorkerRetired(worker_id=member.worker_id, source=notice.source,
                                       role="starting"))
            break
        else:
            joined |= _place(ctx, member, target)
    return joined


def _count_start_failures(ctx: Context, failed: int) -> None:
    """Counts workers that failed to start; at `failure.max_start_failures` in a row no more
    are started (`top_up`), and the run says so once."""
    if not failed:
        return
    limit = ctx.config.failure.max_start_failures
    before, ctx.start_failures = ctx.start_failures, ctx.start_failures + failed
    if before < limit <= ctx.start_failures:
        ctx.log.emit(WorkerStartFailed(error=(
            f"{ctx.start_failures} workers in a row failed to start, failure.max_start_failures"
            f" = {limit}: no more are started; the run goes on with the {len(ctx.members)} "
            "it has (the errors above say why)")))


def _place(ctx: Context, member: Member, target: int) -> bool:
    """A started worker joins the members (True) while they are below `target`, else waits
    as a spare while the spares are short (else it joins)."""
    if len(ctx.members) >= target and len(ctx.spares) < ctx.config.scaling.spares:
        ctx.spares.append(member)
        ctx.workers.park(member.worker_id)
        ctx.log.emit(SpareReady(worker_id=member.worker_id, pid=member.pid))
        return False
    ctx.members.append(member)
    ctx.log.emit(WorkerJoined(worker_id=member.worker_id, pid=member.pid))
    return True


def promote(ctx: Context) -> list[int]:
    """Spares take the places of members up to the target (the generation that forms next
    takes them in); spares that died are dropped first. Returns the promoted worker ids."""
    check_spares(ctx)
    with ctx.requests.lock:
        target = ctx.requests.target
    promoted = []
    while len(ctx.members) < target and ctx.spares:
        member = ctx.spares.pop(0)
        ctx.members.append(member)
        promoted.append(member.worker_id)
    if promoted:
        ctx.log.emit(SparePromoted(worker_ids=promoted, world_size=len(ctx.members)))
    return promoted


def check_spares(ctx: Context) -> None:
    """Drops the spares whose process died while they waited, and retires those on notice
    (their node drains): nothing of the run is touched, and `top_up` starts others."""
    if not ctx.spares:
        return
    for worker_id in ctx.workers.parked_lost():
        ctx.spares = [m for m in ctx.spares if m.worker_id != worker_id]
        ctx.requests.gone([worker_id])
        ctx.workers.kill(worker_id)
        ctx.log.emit(SpareLost(worker_id=worker_id))
    # Overdue ones too: a spare is in no generation, so no step boundary lets it go and its
    # deadline's kill passes it by (it is no member).
    for notice in ctx.requests.gone(ctx.requests.told([m.worker_id for m in ctx.spares])):
        ctx.spares = [m for m in ctx.spares if m.worker_id != notice.worker_id]
        ctx.workers.release(notice.worker_id)
        ctx.log.emit(WorkerRetired(worker_id=notice.worker_id, source=notice.source,
                                   role="spare"))


def drop(ctx: Context, ranks: list[int], why: str, *, replace: bool = True) -> None:
    """Removes dead members, counts them against `max_failures` (`max_preemptions` for those
    told to leave), promotes hot spares to their places, and waits for replacements while
    below `min_workers`. With `replace` False, replacements start only when needed to reach
    `min_workers` (a recovery leaves the others to `Running`, after its first step).

    Raises:
        WorkerLostError: more than `failure.max_failures` workers lost.
        InsufficientWorkersError: below `min_workers` for `capacity_timeout`.
    """
    dropped = []
    for rank in sorted(ranks, reverse=True):
        member = ctx.members.pop(rank)
        dropped.append(member.worker_id)
        ctx.log.emit(WorkerLost(rank=rank, worker_id=member.worker_id, why=why))
        ctx.workers.kill(member.worker_id)
    ctx.checkpoints.lost(dropped, waited=False)
    # Workers told to leave that died before a step boundary count as preemptions; a
    # straggler's swap is the run's own choice, so its death is a failure. So do those whose
    # death Ray put down to their node's preemption (a drain seen too late, or not at all).
    notices = ctx.requests.gone(dropped)
    told = {n.worker_id for n in notices}
    preempted = sum(n.source != "straggler" for n in notices) + sum(
        w not in told for w in ctx.workers.preempted(dropped))
    promote(ctx)  # hot spares take the places at once
    if not ctx.config.failure.replace_lost_workers:
        with ctx.requests.lock:
            # The survivors are the new target; growth waits for a scale request.
            ctx.requests.target = max(ctx.config.scaling.lower,
                                      len(ctx.members) + ctx.workers.starting())
            ctx.requests.scaled_by_user = True
    action = ctx.policy.decide(WorkerLostError(f"{len(ranks)} workers {why}", step=ctx.step),
                               lost=len(ranks) - preempted, preempted=preempted)
    if isinstance(action, Fail):
        raise action.error
    if replace or len(ctx.members) < ctx.config.scaling.lower:
        wait_for_capacity(ctx)


def wait_for_capacity(ctx: Context) -> None:
    """Tops up, then waits for replacements while below `min_workers`; a stop request ends
    the wait (the members there are form a generation only to finish: no step runs).

    Raises:
        InsufficientWorkersError: still below after `failure.capacity_timeout`.
    """
    top_up(ctx)
    minimum = ctx.config.scaling.lower
    deadline = ctx.workers.now() + ctx.config.failure.capacity_timeout.total_seconds()
    while len(ctx.members) < minimum:
        with ctx.requests.lock:
            stopping = ctx.requests.stop
        if stopping and ctx.members:  # before: the stop waited for capacity_timeout, then failed
            return
        remaining = deadline - ctx.workers.now()
        verdict = ctx.policy.capacity(len(ctx.members), minimum, ctx.workers.starting(),
                                      remaining)
        if verdict is not None:
            save_before_failing(ctx)
            raise verdict.error
        admit(ctx, timeout=min(remaining, 1.0))


def save_before_failing(ctx: Context) -> None:
    """A final checkpoint from a surviving worker (its committed state), so that a new run on
    the same checkpoint path resumes where this one stopped."""
    if not ctx.checkpoints.enabled:
        return
    for member in ctx.members:
        try:
            _write_final(ctx, member.worker_id)
            return
        except Exception as e:  # best effort on the way to failing: try the next member
            ctx.log.emit(CheckpointFailed(step=ctx.step, error=first_line(e)))


def _write_final(ctx: Context, worker_id: int) -> None:
    """The final checkpoint from `worker_id`. An `on_checkpoint` hook that raises (on this
    write's event, or on an earlier write's reported first) turns the hooks off: writing again
    saves the step if it is not saved yet, and does nothing if it is. The run fails of its own
    error; the sinks report the callback's at the end."""
    write = ctx.checkpoints.maybe_write
    try:
        write(worker_id, ctx.step, len(ctx.members), final=True)
    except CallbackError:
        write(worker_id, ctx.step, len(ctx.members), final=True)


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name when its message is empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def on_any_member(ctx: Context, call: Callable[[int], T]) -> T:
    """`call(worker_id)` on the first live member, those told to leave last. After a completed
    chunk or a new generation every member holds the committed state, so any will do; a dead
    one is skipped here and found by the next chunk, which recovers as usual.

    Raises:
        MembersLostError: every member is dead (the machine recovers from a checkpoint).
    """
    told = set(ctx.requests.told(ctx.ids()))
    # Members told to leave last: what they start (a checkpoint write) would go with them.
    for member in sorted(ctx.members, key=lambda m: m.worker_id in told):
        try:
            return call(member.worker_id)
        except WorkerLostError:
            ctx.log.emit(MemberUnreachable(worker_id=member.worker_id))
    raise MembersLostError("every worker was lost", step=ctx.step)


def form(ctx: Context, reason: str, leaving: Sequence[int] = ()) -> tuple[float, float]:
    """Forms a new generation of the members and brings every rank to the newest committed
    state. Returns the times at which the ring was rebuilt and the state restored.
    `leaving`: members (worker ids) on their way out, which hand their sharded optimizer state
    over to the others as the generation forms and own none of it (`hand_over`).

    Raises:
        WorkerLostError: no member and no checkpoint holds the run's step, too many workers
            lost, or the generation failed to form too often.
        InsufficientWorkersError: below `min_workers` for `capacity_timeout`.
    """
    while True:
        ctx.generation += 1
        ids = ctx.ids()
        joined = ctx.workers.connect(ids, ctx.generation)
        if not _formed(ctx, joined, "connecting"):
            continue
        rebuilt = ctx.workers.now()
        steps = [value[0] for value in joined.values if value is not None]
        holdings = [value[2] if len(value) > 2 else None
                    for value in joined.values if value is not None]
        transport = joined.values[0][1] if joined.values[0] else ""
        try:
            src = _source(ctx, steps, ids, holdings)
        except GenerationOutOfMemoryError as e:  # loading a checkpoint
            _formed(ctx, Gathered([], out_of_memory=[e]), "loading a checkpoint")
            continue
        if src is None:  # half-updated members were replaced: form with the fresh ones
            continue
        handing = [ids.index(w) for w in leaving if w in ids]
        if len(handing) == len(ids):  # those who were to take their parts died meanwhile
            handing = []
        synced = ctx.workers.sync(ids, src, handing)
        if not _formed(ctx, synced, "restoring"):
            continue
        cursor = synced.values[src]
        assert cursor is not None
        ctx.cursor = Cursor(**cursor)
        restored = ctx.workers.now()
        ctx.formed = (ctx.generation, frozenset(ids))
        ctx.policy.formed()
        sharding = ctx.config.sharding
        ctx.log.emit(Generation(generation=ctx.generation, world_size=len(ids), reason=reason,
                      source_rank=src, step=ctx.step, transport=transport, workers=ids,
                      shard_copies=(min(sharding.replicas, len(ids)) if sharding.stage
                                    else None)))
        if reason != "hand_over":  # no step runs in that one: the departure's plans next
            replan(ctx, reason)
        return rebuilt, restored


def hand_over(ctx: Context, leaving: Sequence[int]) -> None:
    """Sharded optimizer state, before members `leaving` (worker ids, on notice) go: when
    they could hold every copy of some part (they are at least `sharding.replicas`, or every
    owner in a smaller world), a generation of every member forms first in which they own
    nothing, so that their parts move to the others, peer to peer, and the departure needs no
    checkpoint and redoes no step. When every member leaves, ready hot spares join them in
    that generation first and take the whole state, sharded or not (`_take_over`); with no
    spare, nothing (the committed state goes to a checkpoint then).

    Raises:
        WorkerLostError, InsufficientWorkersError: as `form`.
    """
    sharding = ctx.config.sharding
    ids = ctx.ids()
    gone = [w for w in leaving if w in ids]
    if not gone:
        return
    if len(gone) == len(ids):
        if not _take_over(ctx):
            return
    elif not sharding.stage or len(gone) < min(sharding.replicas, len(ids)):
        return
    form(ctx, "hand_over", gone)


def _take_over(ctx: Context) -> bool:
    """Every member is leaving: ready hot spares (up to the target) join them first, so that
    the generation `hand_over` forms gives the spares the committed state from the leavers,
    peer to peer (no checkpoint written or read, no step redone). False without a spare."""
    check_spares(ctx)
    if not ctx.spares:
        return False
    with ctx.requests.lock:
        target = ctx.requests.target
    promoted, ctx.spares = ctx.spares[:target], ctx.spares[target:]
    ctx.members.extend(promoted)
    ctx.log.emit(SparePromoted(worker_ids=[m.worker_id for m in promoted],
                               world_size=len(ctx.members)))
    return True


def _formed(ctx: Context, gathered: Gathered[Any], doing: str) -> bool:
    """False (try again) if members died, ran out of memory, or the generation broke while
    `doing`.

    Raises:
        the policy's error when it ends the run; when a member ran out of memory connecting,
        after a final checkpoint (every member is alive and no state has moved yet: a member
        that ran out while restoring may hold part of another's).
    """
    dead, broken = gathered.dead, gathered.broken
    if dead:
        drop(ctx, dead, f"lost while {doing}")
        return False
    if gathered.out_of_memory:
        error = gathered.out_of_memory[0]
        action = ctx.policy.decide(error, step=ctx.step)
        ctx.log.emit(GenerationFailed(generation=ctx.generation,
                      errors=[first_line(e) for e in gathered.out_of_memory] + broken,
                      attempt=ctx.policy.forming_oom.get(ctx.step, 0)))
        if isinstance(action, Fail):
            if doing == "connecting":
                save_before_failing(ctx)
            raise action.error
        return False
    if broken:
        action = ctx.policy.decide(RendezvousError(broken[0], generation=ctx.generation),
                                   step=ctx.step)
        ctx.log.emit(GenerationFailed(generation=ctx.generation, errors=broken,
                      attempt=ctx.policy.generation_attempts))
        if isinstance(action, Fail):
            raise action.error
        return False
    return True


def _source(ctx: Context, steps: list[int], ids: list[int],
            holdings: list[decisions.Holding] | None = None) -> int | None:
    """The rank whose state everyone takes; loads the newest checkpoint into rank 0 when no
    member holds the run's step. None when no member holds step 0 because every one is half
    updated (`Replica.restorable_step` -1: out of memory in the first optimizer step) and
    there is no checkpoint: step 0's state is the model built from the seed, which fresh
    workers hold, so those members are replaced.

    Raises:
        WorkerLostError: no member and no checkpoint holds it.
    """
    source = decisions.restore_source(steps, ctx.step, holdings)
    if not source.from_checkpoint:
        return source.rank
    if source.lost_parts:
        ctx.log.emit(ShardsLost(step=ctx.step, parts=list(source.lost_parts)))
    restored = (ctx.checkpoints.restore(ids[0], "restored_from_checkpoint", ctx.step)
                if ctx.checkpoints.enabled else None)
    if restored is None and ctx.step == 0 and all(step < 0 for step in steps):
        drop(ctx, list(range(len(steps))), "half updated by out of memory in the first "
             "optimizer step (step 0's state is rebuilt by fresh workers)")
        return None
    if restored is None:
        torn = (" (a member that ran out of memory in its optimizer step is half updated and "
                "holds none)" if any(step < 0 for step in steps) else "")
        if source.lost_parts:
            torn += (f" (sharded optimizer state: every owner of parameter(s) "
                     f"{describe(source.lost_parts)} was lost)")
        raise WorkerLostError(
            f"every worker holding the state of step {ctx.step} was lost{torn} and no checkpoint "
            "is available to restore from; the run cannot continue", step=ctx.step)
    if ctx.evaluated_at is not None and ctx.evaluated_at > restored:
        # The replay reaches that step again: it is evaluated again (and the scheduler that
        # steps after evaluations, whose state went back with the checkpoint, steps again).
        ctx.evaluated_at = None
    return 0


def replan(ctx: Context, reason: str) -> None:
    """After a new generation: the batch for its size and the step count that follows (the
    learning-rate ramp goes on from the one a checkpoint restored in forming it recorded)."""
    checkpoints = ctx.checkpoints
    if checkpoints.restored_ramp is not None:
        ctx.batch.restore_ramp(checkpoints.restored_ramp, ctx.step)
        checkpoints.restored_ramp = None
    ctx.batch.replan(reason, ctx.ids(), ctx.step)
    checkpoints.lr_ramp = ctx.batch.lr_ramp
    before, b = ctx.total_steps, ctx.batch.batch_now
    ctx.total_steps = decisions.total_steps(
        max_steps=ctx.config.max_steps, epochs=ctx.config.epochs,
        dataset_size=ctx.dataset_size, batch=b, cursor=ctx.cursor)
    if ctx.total_steps != before:  # a global batch that follows the world size: say so
        ctx.log.emit(Planned(dataset_size=ctx.dataset_size, steps_per_epoch=ctx.dataset_size // b,
                             total_steps=ctx.total_steps))
