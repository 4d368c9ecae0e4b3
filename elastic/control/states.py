"""The controller as a state machine: one small class per state, whose `step` does one
transition and returns the next state.

    Starting --> Running <--> Recovering
                    ^ |
                    | +--> Resizing --> Running
                    | +--> Evaluating --> Running (or Recovering, then Evaluating again)
                    |
                 Running --> Finishing --> Finished
    (any) --(an ElasticError)--> Failed
    (any but Starting) --(every member lost between chunks)--> Recovering

`run` loops until a terminal state, writes a `state` event at every change of label and
turns any error into `Failed` (a bug of ours becomes a `ControllerError` with its cause).
The states act only through the `Workers` port in the context, so the whole machine runs
without Ray (`elastic.control.simulation`).

No Ray here.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from elastic.adapt.plan import BatchPlan, plan_batch
from elastic.config import ChaosEvent
from elastic.control import decisions
from elastic.control.batching import Batching
from elastic.control.context import Context
from elastic.control.cursor import Cursor
from elastic.control.group import (
    admit,
    check_spares,
    drop,
    first_line,
    form,
    hand_over,
    on_any_member,
    promote,
    save_before_failing,
    top_up,
    wait_for_capacity,
)
from elastic.control.policy import BackOff, Fail, Reconfigure, Recover, Retry
from elastic.control.port import (
    ChunkInterrupted,
    ChunkReport,
    EvalDone,
    EvalReport,
    EvalVotedDown,
    Hung,
    Notice,
)
from elastic.control.run_state import RunState
from elastic.errors import (
    CheckpointTimeoutError,
    CollectiveError,
    ConfigError,
    ControllerError,
    ElasticError,
    GenerationOutOfMemoryError,
    MembershipChanged,
    MembersLostError,
    NonFiniteLossError,
    StartupTimeoutError,
    UserCodeError,
    WorkerLostError,
    WorkerOutOfMemoryError,
)
from elastic.events import (
    Chaos,
    ControllerRestarted,
    Evaluate,
    Finish,
    Nonfinite,
    Planned,
    PlannedDeparture,
    Recovered,
    Resized,
    Start,
    StateChanged,
    Stopping,
    StragglerFound,
    UserError,
    WorkerFailure,
    WorkerHung,
    WorkerRemoved,
    WorkerStartFailed,
)
from elastic.events import (
    Failed as RunFailed,
)
from elastic.recovery import PendingRecovery

logger = logging.getLogger(__name__)


class State:
    """One state of the run. `step` does one transition and returns the next state."""

    label: ClassVar[RunState]

    def fields(self) -> dict[str, Any]:
        """Extra fields of the `state` event that enters this state."""
        return {}

    def step(self, ctx: Context) -> State:
        raise NotImplementedError


# --- starting ------------------------------------------------------------------------------


class Starting(State):
    """Starts the workers, reads the data set's size, plans the batch, resumes from the newest
    checkpoint if any, and forms the first generation."""

    label = RunState.STARTING

    def step(self, ctx: Context) -> State:
        config = ctx.config
        if ctx.restarted:
            ctx.log.emit(ControllerRestarted(name=ctx.name))
            if not ctx.checkpoints.enabled:
                raise ControllerError(
                    f"the controller of run {ctx.name!r} died and was restarted, but the "
                    "run has no checkpoints to resume from; set checkpoint.path so that a "
                    "restarted controller can resume")
        ctx.log.emit(Start(name=ctx.name, config=config.model_dump(mode="json"),
                           restarted=True if ctx.restarted else None))
        if config.checkpoint is not None:
            from elastic.checkpoint.store import check_root
            check_root(config.checkpoint.path, config.checkpoint.timeout_s)
            if config.checkpoint.monitor is not None and not ctx.evaluates:
                raise ConfigError(
                    f"checkpoint.monitor is {config.checkpoint.monitor!r}, but the job evaluates "
                    "nothing; give TrainJob eval_dataset and eval_step (or evaluate), or unset "
                    "checkpoint.monitor")
        self._start_workers(ctx)
        problem = decisions.data_set_mismatch(ctx.members)
        if problem is not None:
            raise ConfigError(problem)
        ctx.dataset_size = ctx.checkpoints.dataset_size = ctx.members[0].dataset_size
        traits = on_any_member(ctx, lambda w: ctx.workers.call(w, "traits"))
        ctx.batching = Batching(config, ctx.log, len(ctx.members), traits)
        ctx.policy.unit = ctx.checkpoints.group_size = ctx.batching.grouping.size
        largest = ctx.batch.largest_batch()
        if largest > ctx.dataset_size:
            raise ConfigError(
                f"at scaling.max_workers = {config.scaling.upper} the global batch would be "
                f"{largest}, more than the {ctx.dataset_size} samples of the data set; lower "
                "batch.global_batch_size or scaling.max_workers")
        b = ctx.batch.batch_now
        ctx.total_steps = decisions.total_steps(
            max_steps=config.max_steps, epochs=config.epochs, dataset_size=ctx.dataset_size,
            batch=b, cursor=ctx.cursor)
        ctx.log.emit(Planned(dataset_size=ctx.dataset_size,
                      steps_per_epoch=ctx.dataset_size // b, total_steps=ctx.total_steps))
        if ctx.checkpoints.enabled:
            while True:
                try:
                    ctx.checkpoints.restore(ctx.members[0].worker_id, "resumed", ctx.step,
                                            world_size=len(ctx.members))
                    break
                except GenerationOutOfMemoryError as e:  # once more, as a generation forms
                    action = ctx.policy.decide(e, step=None)  # the step resumed is not known yet
                    if isinstance(action, Fail):
                        raise action.error from e
                    if not isinstance(action, Recover):
                        raise
        form(ctx, "start")
        return Running()

    @staticmethod
    def _start_workers(ctx: Context) -> None:
        scaling, failure = ctx.config.scaling, ctx.config.failure
        for _ in range(scaling.num_workers + scaling.spares):  # spares start with the run
            ctx.workers.spawn()
        # Do not wait for workers the cluster cannot place at all; they stay starting and join
        # when capacity appears.
        wanted = max(min(scaling.num_workers, ctx.workers.placeable()), scaling.lower)
        started = ctx.workers.admit(min(wanted, scaling.num_workers),
                                    failure.startup_timeout.total_seconds())
        for error in started.failed:  # the job's code raised: it would raise again
            if isinstance(error, ConfigError):
                raise error
        for error in started.failed:  # a worker (its node) died as it started: the others go on
            ctx.log.emit(WorkerStartFailed(error=first_line(error)))
        ctx.members = sorted(started.members, key=lambda m: m.worker_id)
        if len(ctx.members) < scaling.lower and started.failed:
            raise WorkerLostError(
                f"only {len(ctx.members)} of {scaling.num_workers} workers started, fewer than "
                f"scaling.min_workers = {scaling.lower}; {len(started.failed)} died while "
                f"starting, the first: {first_line(started.failed[0])}")
        if len(ctx.members) < scaling.lower:
            raise StartupTimeoutError(
                f"only {len(ctx.members)} of {scaling.num_workers} workers started within "
                f"{failure.startup_timeout}; need at least {scaling.lower}. Raise "
                "failure.startup_timeout or add capacity")


# --- running -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    """A chunk handed to the workers: `num` steps from step `start` under `plan` (with the
    micro-batch `trial`, if one runs), firing the scheduled faults in `chaos`."""

    start: int
    num: int
    plan: BatchPlan
    trial: int | None
    chaos: list[ChaosEvent]


@dataclass
class Running(State):
    """Applies control requests at the boundary, then runs one chunk of steps and acts on
    what every rank reports. Right after a resize (`resized`), the boundary was just applied:
    the next chunk runs at the new size before any further request is looked at.

    While a chunk runs, the next one is handed out `ahead` when the boundary between them has
    nothing to do (`decisions.boundary_work`), so the workers go straight on; the controller
    then takes the finished chunk's report while the next one runs. A stop or a scale down
    ends the chunks out after the step in flight (`Workers.yield_chunks`, from the request's
    thread); the one ahead is then drained."""

    resized: bool = False
    ahead: _Chunk | None = None
    label: ClassVar[RunState] = RunState.RUNNING

    def step(self, ctx: Context) -> State:
        if self.ahead is not None:
            current, self.ahead = self.ahead, None
            return self._finish(ctx, current)
        if ctx.pending_evaluation is not None:
            leaving = ctx.requests.leaving(ctx.ids()) if ctx.step < ctx.total_steps else []
            if ctx.pending_evaluation == ctx.step and leaving:
                # Members on notice go first: an evaluation with them would be redone
                # whole if their deadline came before its end (they are killed then).
                return _departure(ctx, leaving)
            if ctx.pending_evaluation == ctx.step:
                return Evaluating(scheduled=ctx.pending_scheduled)
            ctx.pending_evaluation = None  # its step was lost (restored from an older checkpoint)
        if ctx.step >= ctx.total_steps:
            return Finishing()
        if self.resized:
            self.resized = False
            return self._finish(ctx, self._start(ctx, ctx.cursor))
        with ctx.requests.lock:
            stop, target = ctx.requests.stop, ctx.requests.target
        if stop:
            if not ctx.stopped_early:
                ctx.stopped_early = True
                ctx.log.emit(Stopping(step=ctx.step))
            return Evaluating(scheduled=False) if _evaluation_due(ctx, ending=True) else Finishing()
        with ctx.requests.lock:
            save, ctx.requests.save = ctx.requests.save, False
        if save:  # the head node drains: the committed state, written before it goes
            on_any_member(ctx, lambda w: ctx.checkpoints.maybe_write(w, ctx.step,
                                                                     len(ctx.members), final=True))
        leaving = ctx.requests.leaving(ctx.ids())
        if leaving:  # members on notice leave here, at a step boundary
            return _departure(ctx, leaving)
        check_spares(ctx)
        if len(ctx.members) < target and ctx.spares:  # a spare fills a place at once
            return Resizing(world_size=len(ctx.members), target=target)
        shrink = len(ctx.members) > target
        # After a recovery, replacements start once its first step is done: a worker's start
        # (an interpreter, torch, the job) would take CPU from the rebuild, restore and step.
        if not shrink and ctx.recovery is None:
            top_up(ctx)
        if shrink or admit(ctx, timeout=0):
            action = ctx.policy.decide(MembershipChanged(
                f"{len(ctx.members)} members, target {target}"))
            assert isinstance(action, Reconfigure)
            return Resizing(world_size=len(ctx.members), target=target)
        return self._finish(ctx, self._start(ctx, ctx.cursor))

    @staticmethod
    def _start(ctx: Context, cursor: Cursor) -> _Chunk:
        """Plans the chunk that starts at `cursor` and hands it to the workers."""
        ids = ctx.ids()
        plan, trial = ctx.batch.next_plan(ids)
        step = cursor.step
        every = ctx.config.checkpoint.every_steps if ctx.config.checkpoint else None
        num = decisions.chunk_length(
            step=step, steps_per_chunk=ctx.config.steps_per_chunk, total_steps=ctx.total_steps,
            steps_left_in_epoch=cursor.steps_left_in_epoch(ctx.dataset_size, ctx.batch.batch_now),
            trial_steps_left=ctx.batch.trial_steps_left(trial), checkpoint_every=every,
            chaos_steps=[e.step for e in ctx.chaos if e.phase != "evaluate"],
            evaluation_every=ctx.config.evaluation.every_steps if ctx.evaluates else None)
        # Faults of phase 'evaluate' wait for the evaluation at their step.
        chaos = [e for e in ctx.chaos if e.step == step and e.phase != "evaluate"]
        ctx.chaos = [e for e in ctx.chaos if e.step != step or e.phase == "evaluate"]
        ctx.workers.start_chunk(ids, plan, step, num, chaos, ctx.batch.lr_ramp)
        # A notice (or the head's drain) that came while no chunk was out (a resize, a
        # recovery, an evaluation) found nothing to end: this chunk ends after its first
        # step instead.
        with ctx.requests.lock:
            save = ctx.requests.save
        if save or ctx.requests.leaving(ids):
            ctx.workers.yield_chunks()
        return _Chunk(step, num, plan, trial, chaos)

    def _ahead(self, ctx: Context, chunk: _Chunk) -> _Chunk | None:
        """Hands out the chunk after `chunk` now if the boundary between them has nothing to
        do (`decisions.boundary_work`); `chunk` starts at the committed cursor."""
        if not ctx.config.chunks_ahead:
            return None
        batch, size = ctx.batch.batch_now, ctx.dataset_size
        with ctx.requests.lock:
            stop, target, save = ctx.requests.stop, ctx.requests.target, ctx.requests.save
        check_spares(ctx)  # spares are in no generation: one that died is replaced now
        if ctx.recovery is None and not stop and len(ctx.members) <= target:
            top_up(ctx)  # what the boundary would do: free capacity is used at the next one
        end = chunk.start + chunk.num
        evaluation = ctx.config.evaluation
        work = decisions.boundary_work(
            end=end, total_steps=ctx.total_steps,
            ends_epoch=chunk.num >= ctx.cursor.steps_left_in_epoch(size, batch),
            tuning=chunk.trial is not None or ctx.batch.tuner is not None,
            checkpoint_due=ctx.checkpoints.due(end) or save,
            evaluation_due=ctx.evaluates and decisions.evaluation_due(
                step=end, evaluated_at=ctx.evaluated_at, every_steps=evaluation.every_steps,
                every_epochs=None, epoch_ended=False, epochs_done=0, at_end=False, ending=False),
            recovering=ctx.recovery is not None, stop=stop, world_size=len(ctx.members),
            # A ready spare fills a place as a joining worker does (a scale up by the user).
            target=target, joining=ctx.workers.joinable() or (
                len(ctx.members) < target and bool(ctx.spares)),
            departing=bool(ctx.requests.leaving(ctx.ids())))
        if work is not None:
            return None
        cursor = ctx.cursor
        for _ in range(chunk.num):
            cursor = cursor.advance(size, batch)
        ahead = self._start(ctx, cursor)
        with ctx.requests.lock:  # one that came meanwhile ends both chunks early
            late = (ctx.requests.stop or ctx.requests.save
                    or len(ctx.members) > ctx.requests.target)
        if late:  # (a notice that came meanwhile: `_start` ended them already)
            ctx.workers.yield_chunks()
        return ahead

    def _finish(self, ctx: Context, chunk: _Chunk) -> State:
        """Waits for `chunk` (handing out the next one ahead if it can) and acts on it."""
        for event in chunk.chaos:
            ctx.log.emit(Chaos(**event.model_dump()))
        self.ahead = self._ahead(ctx, chunk)
        report = ctx.workers.finish_chunk(ctx.config.failure.hang_timeout.total_seconds(),
                                          _hung(ctx))
        ids = ctx.ids()
        for rank, phase in report.hung:
            ctx.log.emit(WorkerHung(rank=rank, phase=phase, worker_id=ids[rank]))
        records = {rank: o.records for rank, o in report.outcomes.items()}
        self._record(ctx, records, ids)
        error = decisions.chunk_error(list(report.lost), report.outcomes,
                                      [rank for rank, _ in report.hung])
        fired: list[ChaosEvent] = []  # kills of the chunk ahead that fired before its drain
        if error is None:
            self._completed(ctx, report, chunk, records, ids)
            if self.ahead is not None and ctx.step < chunk.start + chunk.num:
                # Ended early for a control request: every rank skips the chunk ahead.
                report, fired = self._drain(ctx, report, ids)
                error = decisions.chunk_error(list(report.lost), {},
                                              [rank for rank, _ in report.hung])
        if error is not None:
            if self.ahead is not None:
                report, fired = self._drain(ctx, report, ids)
                if report.lost:  # a rank died meanwhile: that comes first
                    error = decisions.chunk_error(list(report.lost), report.outcomes,
                                                  [rank for rank, _ in report.hung])
            return self._failed(ctx, error, report, chunk.chaos + fired, chunk.plan.micro_batches,
                                ids)
        if self.ahead is not None:
            return self  # nothing to do at this boundary: the next chunk runs already
        if _evaluation_due(ctx, ending=ctx.step >= ctx.total_steps, after_chunk=True):
            # It writes the checkpoints due at this step after it.
            scheduled = _evaluation_due(ctx, ending=False, after_chunk=True)
            # After the members on notice left (`step`), unless the run ends here.
            if ctx.step < ctx.total_steps and ctx.requests.leaving(ctx.ids()):
                ctx.pending_evaluation, ctx.pending_scheduled = ctx.step, scheduled
                return self
            return Evaluating(scheduled=scheduled)
        on_any_member(ctx, lambda w: ctx.checkpoints.maybe_write(w, ctx.step, len(ctx.members)))
        return self

    def _drain(self, ctx: Context, report: ChunkReport,
               ids: list[int]) -> tuple[ChunkReport, list[ChaosEvent]]:
        """After a chunk that did not complete or was ended early, waits out the one handed
        out ahead (no rank commits a step of it: each skips it, or is released from its first
        collective) and puts back its faults that did not fire. Returns `report` with the
        ranks lost meanwhile, and the kills that fired (a rank that finished the chunk went
        on into the one ahead and died in it before the chunk's answers were in)."""
        ahead, self.ahead = self.ahead, None
        assert ahead is not None
        later = ctx.workers.finish_chunk(ctx.config.failure.hang_timeout.total_seconds(),
                                         _hung(ctx))
        # Steps of it that committed (a rank that died in it took its answer to the chunk
        # before with it, so that one looked failed while the rest went on): recorded, and
        # the newest committed step and the work lost count them.
        self._record(ctx, {rank: o.records for rank, o in later.outcomes.items()}, ids)
        outcomes = decisions.merge_ahead(report.outcomes, later.outcomes)
        fired = [e for e in ahead.chaos
                 if e.action == "kill" and ctx.workers.fired_kill(e.step, e.rank) is not None]
        for event in fired:
            ctx.log.emit(Chaos(**event.model_dump()))
        ctx.chaos = sorted(ctx.chaos + [e for e in ahead.chaos if e not in fired],
                           key=lambda e: e.step)
        for rank, phase in later.hung:
            ctx.log.emit(WorkerHung(rank=rank, phase=phase, worker_id=ids[rank]))
        lost = {**later.lost, **report.lost}
        return replace(report, outcomes=outcomes, lost=lost,
                       detected=report.detected or later.detected,
                       hung=report.hung + [h for h in later.hung if h[0] not in report.lost]), fired

    @staticmethod
    def _record(ctx: Context, records: dict[int, list[Any]], ids: list[int]) -> None:
        by_step = ctx.batch.record(records, ids, ctx.generation)
        if ctx.recovery is not None and by_step:
            first_end = min(r.end_time for r in by_step[min(by_step)].values())
            ctx.log.emit(Recovered(**ctx.recovery.breakdown(first_end)))
            ctx.recovery = None
        ctx.publish()

    @staticmethod
    def _completed(ctx: Context, report: ChunkReport, chunk: _Chunk,
                   records: dict[int, list[Any]], ids: list[int]) -> None:
        cursor = decisions.newest_cursor(report.outcomes)
        assert cursor is not None  # a completed chunk: every rank answered
        ctx.cursor = cursor
        ctx.batch.adapt(chunk.trial, records, ids, ctx.step, chunk.plan)
        _swap_straggler(ctx, ids)

    def _failed(self, ctx: Context, error: ElasticError, report: ChunkReport,
                chaos: list[ChaosEvent], micro_batches: tuple[int, ...], ids: list[int]) -> State:
        """Acts on the failure policy's decision about a chunk that did not complete."""
        if isinstance(error, (WorkerLostError, CollectiveError)):
            # losses are counted when the ranks are dropped; the step is where it broke
            action = ctx.policy.decide(
                error, step=decisions.newest_committed(report.outcomes, ctx.step))
            if isinstance(action, Fail):
                raise action.error
            assert isinstance(action, Recover)
            return Recovering(lost=list(report.lost), report=report, chaos=chaos,
                              detected=report.detected or ctx.workers.now())
        # A voted-down step: every rank is at the same committed step and cursor.
        ctx.cursor = Cursor(**next(iter(report.outcomes.values())).cursor)
        if isinstance(error, ConfigError):  # the job cannot run a step (`ChunkFailed`)
            raise error
        ranks = decisions.voted_ranks(report.outcomes)
        if isinstance(error, UserCodeError):
            action = ctx.policy.decide(error)
            trace = error.traceback.strip().splitlines()
            ctx.log.emit(UserError(step=error.step, ranks=list(ranks),
                          attempt=ctx.policy.user_retries[error.step],
                          error=trace[-1] if trace else ""))
        elif isinstance(error, WorkerOutOfMemoryError):
            action = ctx.policy.decide(error, micro_batches={
                rank: (ids[rank], micro_batches[rank]) for rank in ranks})
            for decision in (action.decisions if isinstance(action, BackOff) else action.backoffs):
                ctx.batch.backed_off(decision)
        else:
            assert isinstance(error, NonFiniteLossError)
            ctx.log.emit(Nonfinite(step=error.step, ranks=list(ranks), policy="stop"))
            action = ctx.policy.decide(NonFiniteLossError(
                f"the loss or gradients of step {error.step} are NaN or infinite on ranks "
                f"{list(ranks)}; the update was not applied (failure.nonfinite='skip' drops "
                "such steps instead)", rank=ranks[0], step=error.step))
        if isinstance(action, Fail):
            raise action.error
        assert isinstance(action, (Retry, BackOff))
        if any(getattr(o, "broken", False) or isinstance(o, ChunkInterrupted)
               for o in report.outcomes.values()):
            # Out of memory in a collective broke the generation: re-form it (nobody is lost).
            return Recovering(lost=[], report=report, chaos=chaos, detected=ctx.workers.now())
        return self


def _departure(ctx: Context, leaving: list[int]) -> Resizing:
    """The resize in which members `leaving` (worker ids, on notice) leave."""
    with ctx.requests.lock:
        target = ctx.requests.target
    return Resizing(world_size=len(ctx.members), target=target, leaving=tuple(leaving))


def _swap_straggler(ctx: Context, ids: list[int]) -> None:
    """The slowest straggler (`Batching.slow`) leaves at the next step boundary when a hot
    spare is ready to take its place: a planned departure of source 'straggler'."""
    slow = [w for w in ctx.batch.slow if w in ids]
    spares = [s.worker_id for s in ctx.spares]
    # A spare on notice leaves at the boundary: the straggler's place would stay empty.
    if not slow or len(ctx.requests.told(spares)) == len(spares) or ctx.requests.leaving(ids):
        return
    worker_id = slow[0]
    tracker, failure = ctx.batch.tracker, ctx.config.failure
    rate = tracker.rate(worker_id) or 0.0
    median = statistics.median(tracker.rate(w) or 0.0 for w in ids if w != worker_id)
    assert failure.straggler_factor is not None
    ctx.log.emit(StragglerFound(rank=ids.index(worker_id), worker_id=worker_id,
                                samples_per_s=round(rate, 2),
                                others_median_samples_per_s=round(median, 2),
                                factor=failure.straggler_factor, window=failure.straggler_window))
    if ctx.requests.notice(Notice(worker_id, "straggler", None, ctx.workers.now(),
                                  f"{rate:.0f} samples/s against {median:.0f}")):
        ctx.workers.yield_chunks()  # a chunk handed out ahead ends after its step


def _hung(ctx: Context) -> Hung:
    """The hang watchdog's verdict under the run's `failure.hang_timeout`."""
    timeout = ctx.config.failure.hang_timeout.total_seconds()
    return lambda where: decisions.hung_ranks(where, timeout)


def _evaluation_due(ctx: Context, ending: bool, after_chunk: bool = False) -> bool:
    """Whether the committed model is evaluated now (`decisions.evaluation_due`): `ending`, the
    run ends here; `after_chunk`, a chunk just completed (so an epoch may have ended)."""
    if not ctx.evaluates:
        return False
    evaluation = ctx.config.evaluation
    epochs_done = ctx.cursor.epochs_done(ctx.dataset_size, ctx.batch.batch_now)
    return decisions.evaluation_due(
        step=ctx.step, evaluated_at=ctx.evaluated_at, every_steps=evaluation.every_steps,
        every_epochs=evaluation.epoch_interval, epoch_ended=after_chunk and epochs_done > ctx.cursor.epoch,
        epochs_done=epochs_done, at_end=evaluation.at_end, ending=ending)


@dataclass
class Evaluating(State):
    """Evaluates the committed model on every member (each over its slice of the evaluation
    set, in proportion to the batch plan for the current members) and with the job's
    `evaluate` on one; records the result (`Evaluate` event, `ctx.evaluation`), then writes the
    checkpoints due at this step (with `checkpoint.monitor`, one that records the value).

    A lost worker or a broken collective recovers as a chunk's would, and the evaluation runs
    again at the same step before training goes on (`ctx.pending_evaluation`); an error of user
    code is retried as a step's is. A part of Running (its label), not a phase users see.

    `scheduled`: due by `FitConfig.evaluation`'s intervals, not only because the run ends or
    stops here; only then does a scheduler of `scheduler_interval` 'evaluation' step after it
    (so that where a run ends does not change its schedule)."""

    scheduled: bool = True
    label: ClassVar[RunState] = RunState.RUNNING

    def step(self, ctx: Context) -> State:
        ctx.pending_evaluation = step = ctx.step
        ctx.pending_scheduled = self.scheduled
        metrics: dict[str, Any] = {}
        if ctx.has_eval_step:
            chaos = [e for e in ctx.chaos if e.step == step and e.phase == "evaluate"]
            ctx.chaos = [e for e in ctx.chaos if e not in chaos]
            for event in chaos:
                ctx.log.emit(Chaos(**event.model_dump()))
            report = self._evaluate(ctx, chaos, self.scheduled)
            error = decisions.evaluation_error(list(report.lost), report.outcomes,
                                               [rank for rank, _ in report.hung], step)
            if error is not None:
                return self._failed(ctx, error, report, chaos)
            done = report.outcomes[min(report.outcomes)]
            assert isinstance(done, EvalDone)
            metrics.update(done.metrics)
            ctx.policy.collective_recoveries.clear()  # it went through: "in a row" ends
        if ctx.has_evaluate:
            legacy = on_any_member(ctx, lambda w: ctx.workers.call(w, "evaluate"))
            clash = sorted(set(legacy) & set(metrics))
            if clash:
                raise ConfigError(f"TrainJob.evaluate and TrainJob.eval_step both return "
                                  f"{', '.join(clash)}; rename one of them")
            metrics.update(legacy)
        self._record(ctx, metrics)
        on_any_member(ctx, lambda w: ctx.checkpoints.after_evaluation(
            w, step, len(ctx.members), metrics))
        return Running()

    @staticmethod
    def _evaluate(ctx: Context, chaos: list[ChaosEvent], scheduled: bool) -> EvalReport:
        ids = ctx.ids()
        shares = plan_batch(ctx.batch.batch_now, len(ids), None, ctx.batch.weights(ids)).shares
        report = ctx.workers.evaluate(ids, shares, chaos,
                                      ctx.config.failure.hang_timeout.total_seconds(),
                                      _hung(ctx), scheduled)
        for rank, phase in report.hung:
            ctx.log.emit(WorkerHung(rank=rank, phase=phase, worker_id=ids[rank]))
        return report

    @staticmethod
    def _record(ctx: Context, metrics: dict[str, Any]) -> None:
        try:
            event = Evaluate(step=ctx.step, metrics=dict(metrics),
                             epoch=ctx.cursor.epochs_done(ctx.dataset_size, ctx.batch.batch_now))
        except ValueError as e:  # a metric named like a field of the event record
            raise ConfigError(str(e)) from None
        ctx.evaluation, ctx.evaluated_at, ctx.pending_evaluation = metrics, ctx.step, None
        ctx.log.emit(event)

    @staticmethod
    def _failed(ctx: Context, error: ElasticError, report: EvalReport,
                chaos: list[ChaosEvent]) -> State:
        """Recovers (the evaluation stays pending and runs again at the same step), retries
        after an error of user code, or fails, as the failure policy decides."""
        action = ctx.policy.decide(error, step=ctx.step)
        if isinstance(action, Fail):
            raise action.error
        if isinstance(error, UserCodeError):
            trace = error.traceback.strip().splitlines()
            ranks = next(list(o.failure.ranks) for o in report.outcomes.values()
                         if isinstance(o, EvalVotedDown))
            ctx.log.emit(UserError(step=error.step, ranks=ranks,
                          attempt=ctx.policy.evaluation_retries[error.step],
                          error=trace[-1] if trace else ""))
            return Running()
        assert isinstance(action, Recover)
        lost = sorted(report.lost)
        return Recovering(lost=lost, report=ChunkReport({}, dict(report.lost), report.detected,
                                                        list(report.hung)),
                          chaos=chaos, detected=report.detected or ctx.workers.now())


# --- recovering and resizing -----------------------------------------------------------------


@dataclass
class Recovering(State):
    """Drops the lost ranks, forms a new generation from the survivors and restores the newest
    committed state; records the timing that the first step after it completes."""

    lost: list[int]
    report: ChunkReport
    chaos: list[ChaosEvent]
    detected: float
    label: ClassVar[RunState] = RunState.RECOVERING

    def fields(self) -> dict[str, Any]:
        return {"lost_ranks": self.lost}

    def step(self, ctx: Context) -> State:
        aborted = ctx.workers.now()
        world_before = len(ctx.members)
        killed_at = ctx.requests.take_killed_at()
        # A scheduled kill counts only if it fired (the worker left its marker with the time):
        # a rank that died of something else first is an unplanned death.
        chaos_kills: set[int] = set()
        for event in self.chaos:
            fired = ctx.workers.fired_kill(event.step, event.rank) if event.action == "kill" else None
            if fired is not None:
                chaos_kills.add(event.rank)
                killed_at = fired
        ids = ctx.ids()
        with ctx.requests.lock:
            killed = set(ctx.requests.killed_on_purpose)
        on_purpose = chaos_kills | {r for r in self.lost if ids[r] in killed}
        ctx.log.emit(WorkerFailure(lost_ranks=self.lost,
                      step=decisions.newest_committed(self.report.outcomes, ctx.step),
                      lost_workers=[ids[r] for r in self.lost],
                      survivors=len(ids) - len(self.lost),
                      planned=bool(self.lost) and set(self.lost) <= on_purpose,
                      reasons=[self.report.lost.get(r, "") for r in self.lost]))
        if self.lost:
            drop(ctx, self.lost, "actor died", replace=False)
        # The newest step a survivor's answer says committed (a chunk that failed may have
        # committed some, the chunk ahead of it too): survivors hold it. With no survivor, the
        # newest any answer says: a restore from a checkpoint counts it as lost.
        answers = self.report.outcomes
        survivors = {r: o for r, o in answers.items() if r not in self.lost}
        newest = decisions.newest_cursor(survivors or answers)
        if newest is not None and newest.step > ctx.step:
            ctx.cursor = newest
        rebuilt, restored = form(ctx, "recovery")
        ctx.recovery = PendingRecovery(
            detected=self.detected, killed_at=killed_at, aborted=aborted, rebuilt=rebuilt,
            restored=restored, lost_ranks=self.lost, world_before=world_before,
            # The step in flight when the worker died is redone; steps already committed by
            # the newest survivor are kept.
            work_lost_steps=int(any(isinstance(o, ChunkInterrupted)
                                    for o in self.report.outcomes.values())),
            world_after=len(ctx.members), step=ctx.step)
        return Running()


@dataclass
class Resizing(State):
    """Lets the members on notice go (`leaving`: a planned departure), removes members above
    the target (handing their sharded optimizer state over first, as leavers do), promotes
    hot spares to places below it, admits started ones, and forms a new generation.

    A planned departure happens at a step boundary: every member holds the committed state,
    so the others go on with it (no collective aborted, no restore, no step redone) and the
    target stays, so a replacement starts. Only when nobody would be left is the committed
    state saved to a checkpoint first (if the run has them), for the replacements to resume."""

    world_size: int
    target: int
    leaving: tuple[int, ...] = ()
    label: ClassVar[RunState] = RunState.RESIZING

    def fields(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "target": self.target}

    def step(self, ctx: Context) -> State:
        before, step = ctx.generation, ctx.step
        if self.leaving:
            hand_over(ctx, self.leaving)  # sharded optimizer state only they may hold
        departed = _depart(ctx, self.leaving) if self.leaving else None
        with ctx.requests.lock:  # free capacity may have raised it since the boundary
            target = ctx.requests.target
        if len(ctx.members) > target:
            surplus = [m.worker_id for m in ctx.members[target:]]
            hand_over(ctx, surplus)  # a scale down: alive at a boundary, as leavers are
            _settle_checkpoints(ctx, surplus)
        while len(ctx.members) > target:
            member = ctx.members.pop()
            ctx.log.emit(WorkerRemoved(worker_id=member.worker_id))
            ctx.workers.kill(member.worker_id)
        promote(ctx)
        top_up(ctx)
        admit(ctx, timeout=0)
        if len(ctx.members) < ctx.config.scaling.lower:
            wait_for_capacity(ctx)
        form(ctx, "departure" if self.leaving else "resize")
        if departed is not None:
            # Steps redone: 0, unless the leavers held state nobody else did (sharded optimizer
            # state, a leaver lost in its hand-over) and the run went back to a checkpoint.
            ctx.log.emit(replace(departed, steps_redone=step - ctx.step))
        ctx.log.emit(Resized(world_size=len(ctx.members), generation=ctx.generation,
                      previous_generation=before))
        return Running(resized=True)


def _settle_checkpoints(ctx: Context, leaving: list[int]) -> None:
    """Before members `leaving` (worker ids) go: waits for the checkpoint writes in flight
    that need them, and logs how they ended. Their own (a writer thread dies with its
    process) and, with sharded optimizer state, every member's: the member writing a manifest
    waits for each member's shard, the leavers' included."""
    for worker_id in (ctx.ids() if ctx.config.sharding.stage else leaving):
        try:
            ctx.checkpoints.flush(worker_id)
        except WorkerLostError:  # it died meanwhile: a write of its own did not report
            ctx.checkpoints.lost([worker_id])


def _settle_before_failing(ctx: Context) -> None:
    """Before the run fails (and its workers end with it): waits for the checkpoint writes
    in flight on the members, up to each write's time limit, and logs how they ended. Before,
    a background write of a step the run had reached died with the worker processes, unsaid:
    a resume went back to the checkpoint before it."""
    if not ctx.checkpoints.enabled:
        return
    for worker_id in ctx.ids():
        try:
            ctx.checkpoints.flush(worker_id)
        except Exception:  # lost, or failing too: the run's own error is what it ends with
            logger.debug("waiting for worker %s's checkpoint writes", worker_id, exc_info=True)


def _depart(ctx: Context, leaving: tuple[int, ...]) -> PlannedDeparture | None:
    """Members `leaving` (worker ids, on notice) leave the run at this step boundary; returns
    the event that says so, to be written once the next generation has formed (it counts the
    steps redone); None if none of them is a member any more (they died meanwhile: counted
    as losses).

    Raises:
        WorkerLostError: more than `failure.max_preemptions` workers preempted.
    """
    ids = ctx.ids()
    ranks = [ids.index(w) for w in leaving if w in ids]
    gone = [ids[r] for r in ranks]
    if not gone:
        ctx.requests.gone(list(leaving))
        return None
    if len(gone) == len(ids):
        # Nobody stays to hand the committed state on: the replacements resume it from a
        # checkpoint (without checkpoints they start over, which `form` refuses below).
        on_any_member(ctx, lambda w: ctx.checkpoints.maybe_write(w, ctx.step, len(ids),
                                                                 final=True))
    _settle_checkpoints(ctx, gone)
    notices = ctx.requests.gone(gone)
    ctx.members = [m for m in ctx.members if m.worker_id not in gone]
    for worker_id in gone:
        ctx.workers.release(worker_id)
    first = min((n.received for n in notices), default=ctx.workers.now())
    departed = PlannedDeparture(
        ranks=ranks, worker_ids=gone, sources=sorted({n.source for n in notices}),
        step=ctx.step, notice_to_gone_s=max(0.0, ctx.workers.now() - first), steps_redone=0)
    # A straggler swapped for a spare is the run's own choice, not a preemption.
    action = ctx.policy.departed(sum(n.source != "straggler" for n in notices), ctx.step)
    if action is not None:
        ctx.log.emit(departed)
        save_before_failing(ctx)  # those who stay hold the committed state
        raise action.error
    return departed


# --- the end -------------------------------------------------------------------------------


class Finishing(State):
    """Writes the final checkpoint and takes the final model."""

    label = RunState.FINISHING

    def step(self, ctx: Context) -> State:
        # Steps a restore went back over and the run did not redo (it stopped first) are not
        # in its weights: their records go.
        ctx.log.drop_from(ctx.step)
        on_any_member(ctx, lambda w: ctx.checkpoints.maybe_write(w, ctx.step, len(ctx.members),
                                                                 final=True))
        model_state = on_any_member(ctx, lambda w: ctx.workers.call(w, "model_state"))
        ctx.log.emit(Finish(step=ctx.step, stopped=ctx.stopped_early,
                      samples=ctx.cursor.samples))
        return Finished(model_state)


@dataclass
class Finished(State):
    """Terminal: the run ended (finished or stopped) with `model_state`."""

    model_state: Any
    label: ClassVar[RunState] = RunState.FINISHED


@dataclass
class Failed(State):
    """Terminal: the run failed with `error`."""

    error: BaseException
    label: ClassVar[RunState] = RunState.FAILED


# --- the loop ------------------------------------------------------------------------------


def _bug(e: Exception) -> ControllerError:
    logger.exception("controller failed")
    error = ControllerError(f"controller failed: {type(e).__name__}: {e}")
    error.__cause__ = e
    return error


@dataclass
class Machine:
    """Runs the states to a terminal one.

    Args:
        ctx: the shared context.
        on_change: called with (previous label, new state) after each change of label, before
            the `state` event is written; the actor publishes the run's state there.
    """

    ctx: Context
    on_change: Callable[[RunState, State], None] = lambda previous, state: None
    state: State = field(default_factory=Starting)
    _lost_between: dict[int, int] = field(default_factory=dict, init=False)  # step -> losses

    def run(self) -> State:
        """Steps until a terminal state; returns it."""
        while self.state.label not in (RunState.FINISHED, RunState.FAILED):
            try:
                following = self.state.step(self.ctx)
            except MembersLostError as e:
                following = self._recover(e)
            except ElasticError as e:
                following = Failed(e)
            except Exception as e:  # a bug of ours: keep the cause
                following = Failed(_bug(e))
            if isinstance(following, Failed) and not isinstance(self.state, Failed) \
                    and not isinstance(following.error, CheckpointTimeoutError):
                _settle_before_failing(self.ctx)  # (storage that hangs: no write will end)
            try:
                self.enter(following)
            except Exception as e:  # writing the change failed: end without more writes
                previous, self.state = self.state.label, Failed(_bug(e))
                self.on_change(previous, self.state)
        return self.state

    def _recover(self, error: MembersLostError) -> State:
        """Every member died between chunks (their whole node, at a checkpoint write): the
        run recovers from its newest checkpoint as from a chunk that lost them all; while
        starting, and past `failure.max_failures`, it fails."""
        ctx = self.ctx
        if isinstance(self.state, Starting) or not ctx.members:
            return Failed(error)
        if not ctx.checkpoints.enabled and ctx.step > 0:
            return Failed(WorkerLostError(
                f"every worker was lost at step {ctx.step} and no checkpoint is available to "
                "restore from; the run cannot continue", step=ctx.step))
        self._lost_between[ctx.step] = self._lost_between.get(ctx.step, 0) + 1
        if self._lost_between[ctx.step] > 1:  # the call itself kills them: no more tries
            return Failed(WorkerLostError(
                f"every worker died twice at step {ctx.step} while the controller asked them "
                f"something between chunks ({error}); their logs say why", step=ctx.step))
        try:
            action = ctx.policy.decide(error)  # the losses are counted as they are dropped
        except ElasticError as e:
            return Failed(e)
        if isinstance(action, Fail):
            return Failed(action.error)
        return Recovering(lost=list(range(len(ctx.members))), report=ChunkReport(outcomes={}),
                          chaos=[], detected=ctx.workers.now())

    def enter(self, state: State) -> None:
        """Makes `state` current; writes the `failed` and `state` events on a change of label."""
        previous, self.state = self.state.label, state
        if isinstance(state, Failed):
            self.ctx.log.emit(RunFailed(error=f"{type(state.error).__name__}: {state.error}",
                               step=self.ctx.step))
        if state.label != previous:
            self.on_change(previous, state)
            self.ctx.log.emit(StateChanged(previous=previous.value, state=state.label.value,
                               **state.fields()))
            if state.label not in (RunState.FINISHED, RunState.FAILED):
                self.ctx.publish()  # the end is published last, by the actor
