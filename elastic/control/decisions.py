"""The control loop's decisions as pure functions over plain data.

Each function here takes numbers and records and returns a decision; none does I/O, waits or
keeps state, so each is tested directly and costs O(world) at most.

No Ray here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.control.cursor import Cursor
from elastic.control.port import (
    ChunkDone,
    ChunkFailed,
    ChunkInterrupted,
    ChunkOutcome,
    ChunkSkipped,
    ChunkVotedDown,
    EvalDone,
    EvalFailed,
    EvalInterrupted,
    EvalOutcome,
    EvalVotedDown,
    Member,
)
from elastic.errors import (
    CollectiveError,
    ElasticError,
    EvaluationError,
    NonFiniteLossError,
    UserCodeError,
    WorkerHangError,
    WorkerLostError,
    WorkerOutOfMemoryError,
)


def chunk_length(*, step: int, steps_per_chunk: int, total_steps: int, steps_left_in_epoch: int,
                 trial_steps_left: int | None, checkpoint_every: int | None,
                 chaos_steps: Sequence[int], evaluation_every: int | None = None) -> int:
    """Steps in the next chunk: up to `steps_per_chunk`, ending at the run's end, the epoch's
    end, the micro-batch trial's end, the next periodic checkpoint, the next periodic
    evaluation, and the next scheduled chaos event (a chunk starts at a chaos event's step, so
    that dispatching it fires it)."""
    num = min(steps_per_chunk, total_steps - step, steps_left_in_epoch)
    if trial_steps_left is not None:
        num = min(num, trial_steps_left)
    for every in (checkpoint_every, evaluation_every):
        if every:
            num = min(num, every - step % every)
    later = [s for s in chaos_steps if s > step]
    if later:
        num = min(num, min(later) - step)
    return num


def boundary_work(*, end: int, total_steps: int, ends_epoch: bool, tuning: bool,
                  checkpoint_due: bool, evaluation_due: bool, recovering: bool, stop: bool,
                  world_size: int, target: int, joining: bool,
                  departing: bool = False) -> str | None:
    """What the chunk boundary at step `end` must do before the next chunk, or None when it
    has nothing to do but start it: then the next chunk is handed out ahead, while the current
    one runs, and the workers go on without waiting for the controller.

    Args:
        end: the step at which the current chunk ends.
        total_steps: the run's last step.
        ends_epoch: the current chunk ends an epoch (per-epoch evaluations, a new order).
        tuning: a micro-batch trial runs (the next plan depends on its result).
        checkpoint_due, evaluation_due: one is due at `end`.
        recovering: the first chunk after a recovery (its timing, then replacements).
        stop, target: the control requests (stop, the world size to reach).
        world_size: members now (above `target`: some leave at the boundary; below it, the
            group grows when a started worker is up: `joining`).
        joining: a started worker is up and waits to be admitted (at a boundary); workers
            still starting, or waiting for capacity that may never come, do not hold
            chunks back.
        departing: members were told to leave (a preemption notice): they leave here.
    """
    reasons = [("the run ends", end >= total_steps), ("the epoch ends", ends_epoch),
               ("a micro-batch trial", tuning), ("a checkpoint", checkpoint_due),
               ("an evaluation", evaluation_due), ("a recovery's first chunk", recovering),
               ("a stop request", stop), ("a shrink", world_size > target),
               ("a worker joins", joining), ("a departure on notice", departing)]
    return next((reason for reason, due in reasons if due), None)


def evaluation_due(*, step: int, evaluated_at: int | None, every_steps: int | None,
                   every_epochs: int | None, epoch_ended: bool, epochs_done: int, at_end: bool,
                   ending: bool) -> bool:
    """Whether the committed model is evaluated at step `step` (a chunk boundary): at every
    multiple of `every_steps`, after every `every_epochs`-th epoch (`epoch_ended`: the chunk
    ended the epoch, `epochs_done` counting it), and with `at_end` when the run ends there
    (`ending`: its last step, or a stop); never twice at one step (`evaluated_at`: the step of
    the last evaluation)."""
    if step == evaluated_at:
        return False
    if every_steps and step > 0 and step % every_steps == 0:
        return True
    if every_epochs and epoch_ended and epochs_done % every_epochs == 0:
        return True
    return at_end and ending


def evaluation_error(lost: Sequence[int], outcomes: Mapping[int, EvalOutcome], hung: Sequence[int],
                     step: int) -> ElasticError | None:
    """What went wrong in an evaluation at step `step`, as the typed error the failure policy
    acts on; None when every rank finished it. As for a chunk: a lost worker first (a
    `WorkerHangError` when the hang watchdog killed it), then the scheduler's error after the
    evaluation (`EvalFailed`), then an error of user code (every rank reports it; the traceback
    is the first rank's that has one), then a collective error."""
    if lost:
        kind = WorkerHangError if set(lost) & set(hung) else WorkerLostError
        return kind(f"ranks {sorted(lost)} lost during the evaluation", rank=min(lost), step=step)
    failed = [o for rank, o in sorted(outcomes.items()) if isinstance(o, EvalFailed)]
    if failed:  # the scheduler after the evaluation: the run cannot go on
        return failed[0].error
    voted = [o.failure for o in outcomes.values() if isinstance(o, EvalVotedDown)]
    if voted:
        trace = next((f.traceback for f in voted if f.traceback), None)
        return EvaluationError(f"the evaluation at step {step} failed", rank=voted[0].ranks[0],
                               step=step, traceback=trace or "")
    broken = [o for o in outcomes.values() if isinstance(o, EvalInterrupted)]
    if broken:
        return CollectiveError(broken[0].error)
    assert all(isinstance(o, EvalDone) for o in outcomes.values())
    return None


def total_steps(*, max_steps: int | None, epochs: int | None, dataset_size: int, batch: int,
                cursor: Cursor) -> int:
    """The step at which the run ends, at global batch `batch` from `cursor` on."""
    limits = [max_steps] if max_steps else []
    if epochs:
        done = cursor.epochs_done(dataset_size, batch)
        if done >= epochs:
            limits.append(cursor.step)
        else:
            limits.append(cursor.step + cursor.steps_left_in_epoch(dataset_size, batch)
                          + (epochs - done - 1) * (dataset_size // batch))
    return min(limits)


@dataclass(frozen=True)
class RestoreSource:
    """Where a new generation takes its state from: rank `rank` (the newest committed step),
    or the newest checkpoint when `from_checkpoint` (no member holds the run's step)."""

    rank: int
    from_checkpoint: bool
    lost_parts: tuple[int, ...] = ()  # sharded state: parts no member holds at the newest step


# Sharded optimizer state, per member: how many parts there are, those it holds at its
# committed step, and the step it holds the sums of unapplied, if any (it applies that step
# if the generation takes it); None: the whole state, unsharded.
Holding = tuple[int, Sequence[int], int | None] | None


def data_set_mismatch(members: Sequence[Member], expected: int | None = None) -> str | None:
    """Why `members` cannot train one run together (None: they can): every worker builds the
    data set itself (`TrainJob.dataset` runs on each), and the public sample order is a
    permutation of its length, so workers that disagree on the length would read other
    samples than the global batch holds (some twice, some never), silently. `expected`: the
    run's size, which joiners must match; None: the members must agree among themselves (the
    size most of them built is taken for the run's)."""
    if expected is None:
        counts = Counter(m.dataset_size for m in members)
        if len(counts) <= 1:
            return None
        expected, whose = counts.most_common(1)[0][0], "most workers'"
    else:
        whose = "the run's"
    odd = [m for m in members if m.dataset_size != expected]
    if not odd:
        return None
    shown = ", ".join(f"worker {m.worker_id} on node {m.node_id[:12]}: {m.dataset_size}"
                      for m in odd[:4]) + (f" and {len(odd) - 4} more" if len(odd) > 4 else "")
    return (f"workers built data sets of different sizes ({whose}: {expected} samples; {shown}); "
            "every worker must build the same data set in the same order (TrainJob.dataset "
            "runs on each worker: read it from storage that every node sees alike, not from a "
            "copy that differs between nodes)")


def on_node(members: Sequence[Member], node_id: str) -> list[int]:
    """The worker ids of `members` on the one Ray node whose id is or starts with `node_id`
    (as `elastic drain --node` takes it); [] if none is.

    Raises:
        ValueError: `node_id` is empty, or the start of several nodes' ids (naming them).
    """
    nodes = sorted({m.node_id for m in members if node_id and m.node_id.startswith(node_id)})
    if not node_id or len(nodes) > 1:
        raise ValueError(f"{node_id!r} is the start of {len(nodes)} nodes' ids ("
                         f"{', '.join(n[:16] for n in nodes)}): give more of the one to drain"
                         if node_id else "the node to drain is empty")
    return [m.worker_id for m in members if nodes and m.node_id == nodes[0]]


def restore_source(steps: Sequence[int], global_step: int,
                   holdings: Sequence[Holding] | None = None) -> RestoreSource:
    """The newest committed step wins (ranks may differ by one step after a failure), the
    lowest rank among equals; when every member is behind the run's step, the survivors that
    held it were lost and only a checkpoint can bring it back (continuing from fresh replicas
    would silently restart training). With sharded optimizer state (`holdings`), every part
    must also be held by a member at the newest step: when every owner of some part was lost
    (`lost_parts`), only a checkpoint holds the whole state."""
    src = max(range(len(steps)), key=lambda r: (steps[r], -r))
    behind = steps[src] < global_step
    lost: tuple[int, ...] = ()
    if not behind and holdings is not None and holdings[src] is not None:
        parts = holdings[src][0]
        covered: set[int] = set()
        for rank, holding in enumerate(holdings):
            if holding is not None and steps[src] in (steps[rank], holding[2]):
                covered.update(holding[1])
        lost = tuple(part for part in range(parts) if part not in covered)
    return RestoreSource(src, behind or bool(lost), lost)


def hung_ranks(where: Mapping[int, tuple[str, float]], timeout: float) -> list[int]:
    """Of the ranks that did not answer within the hang timeout, the ones to kill: those that
    have been in one phase for at least `timeout` seconds (`where`: rank -> (phase, seconds in
    it); a rank that does not say is in it for ever) and are not waiting in a collective (they
    are the ones the others wait for). A long step or evaluation that still moves from phase to
    phase, or from batch to batch, is left alone."""
    return [rank for rank, (phase, age) in where.items()
            if phase not in ("allreduce", "gather") and age >= timeout]


def weights(rates: Mapping[int, float], ids: Sequence[int]) -> list[float] | None:
    """Relative throughput of members `ids` (from the last rebalance's rates), or None for an
    even split. A newcomer counts as a typical (median) worker."""
    known = [rates[w] for w in ids if w in rates]
    if not known:
        return None
    fill = sorted(known)[len(known) // 2]
    return [rates.get(w, fill) for w in ids]


def micro_caps(ids: Sequence[int], common: int | None, caps: Mapping[int, int]) -> list[int | None]:
    """Each member's micro-batch cap: the tuner's trial or decision and the member's own
    out-of-memory cap, whichever is smaller."""
    out: list[int | None] = []
    for w in ids:
        limits = [c for c in (common, caps.get(w)) if c is not None]
        out.append(min(limits) if limits else None)
    return out


def chunk_error(report_lost: Sequence[int], outcomes: Mapping[int, ChunkOutcome],
                hung: Sequence[int] = ()) -> ElasticError | None:
    """What went wrong in a chunk, as the typed error the failure policy acts on; None when
    every rank committed every step.

    A lost worker wins over everything (the ranks that saw it only report collective errors):
    a `WorkerHangError` when the hang watchdog killed it (`hung`); then a vote (user code, out
    of memory, non-finite); a collective error with no loss (a timeout) last.
    """
    if report_lost:
        kind = WorkerHangError if set(report_lost) & set(hung) else WorkerLostError
        return kind(f"ranks {sorted(report_lost)} lost", rank=min(report_lost))
    failed = [o for o in outcomes.values() if isinstance(o, ChunkFailed)]
    if failed:
        return failed[0].error
    voted = [o for o in outcomes.values() if isinstance(o, ChunkVotedDown)]
    if voted:
        return vote_error(voted)
    broken = [o for o in outcomes.values() if isinstance(o, ChunkInterrupted)]
    if broken:
        return CollectiveError(broken[0].error)
    skipped = sorted(rank for rank, o in outcomes.items() if isinstance(o, ChunkSkipped))
    if skipped:  # the ranks disagree on where the chunk starts: form a new generation
        return CollectiveError(f"ranks {skipped} skipped a chunk that others ran")
    assert all(isinstance(o, ChunkDone) for o in outcomes.values())
    return None


def vote_error(voted: Sequence[ChunkVotedDown]) -> ElasticError:
    """The typed error of a voted-down step. Every rank saw the same vote; a user error wins
    over out of memory (as in the step's own verdict), and the traceback is the first rank's
    that had one."""
    kinds = {type(o.failure).__name__ for o in voted}
    failure = voted[0].failure
    rank = failure.ranks[0]
    if "UserFailure" in kinds:
        failure = next(o.failure for o in voted if type(o.failure).__name__ == "UserFailure")
        trace = next((o.failure.traceback for o in voted
                      if type(o.failure).__name__ == "UserFailure" and o.failure.traceback), None)
        return UserCodeError(f"user code raised at step {failure.step}", rank=failure.ranks[0],
                             step=failure.step, traceback=trace or "")
    if "OutOfMemory" in kinds:
        return WorkerOutOfMemoryError(f"out of memory at step {failure.step}", rank=rank,
                                      step=failure.step)
    return NonFiniteLossError(f"non-finite loss or gradients at step {failure.step}", rank=rank,
                              step=failure.step)


def voted_ranks(outcomes: Mapping[int, ChunkOutcome]) -> tuple[int, ...]:
    """The ranks a voted-down step names (every rank reports the same vote)."""
    failed = tuple(rank for rank, o in sorted(outcomes.items()) if isinstance(o, ChunkFailed))
    if failed:  # user code after an applied step: the ranks where it raised
        return failed
    for outcome in outcomes.values():
        if isinstance(outcome, ChunkVotedDown):
            return tuple(outcome.failure.ranks)
    return ()


def newest_committed(outcomes: Mapping[int, ChunkOutcome], default: int) -> int:
    """The newest step any answering rank committed."""
    return max((o.committed_step for o in outcomes.values()), default=default)


def newest_cursor(outcomes: Mapping[int, ChunkOutcome]) -> Cursor | None:
    """The data cursor of the newest step any answering rank committed (None: no answer)."""
    cursors = [o.cursor for o in outcomes.values()]
    return Cursor(**max(cursors, key=lambda c: c["step"])) if cursors else None


def merge_ahead(outcomes: Mapping[int, ChunkOutcome],
                ahead: Mapping[int, ChunkOutcome]) -> dict[int, ChunkOutcome]:
    """Each rank's outcome of a chunk that did not complete, updated with its outcome of the
    chunk handed out behind it (`ahead`), where the rank ran that one: a rank whose answer to
    the chunk was lost with a peer that died in the chunk ahead may have committed steps of
    the chunk ahead before that death (the survivors' answers to it carry them)."""
    merged = dict(outcomes)
    for rank, outcome in ahead.items():
        if not isinstance(outcome, ChunkSkipped):
            merged[rank] = outcome
    return merged


def gpu_worker_slots(node_gpus: list[float], gpus_per_worker: float) -> int:
    """How many workers reserving `gpus_per_worker` GPUs each fit on nodes with `node_gpus`
    GPUs: a fraction must fit within one GPU (Ray places it so), so a node holds
    floor(1 / fraction) such workers per whole GPU, not its GPUs divided by the fraction (two
    GPUs hold four workers of 0.4, not five); whole numbers of GPUs fit floor(GPUs / number)
    times per node."""
    slack = 1e-9
    if gpus_per_worker < 1:
        per_gpu = int(1 / gpus_per_worker + slack)
        return sum(int(n + slack) * per_gpu for n in node_gpus)
    return sum(int(n / gpus_per_worker + slack) for n in node_gpus)
