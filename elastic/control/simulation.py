"""Simulated workers: the `Workers` port without processes, for tests and the decision bench.

Members are records with a committed step and data cursor; time is a number that advances by
a fixed step time per step and a start delay per worker. Scheduled kills (`ChaosEvent` with
action 'kill', from the run's configuration) make a rank die inside its step, as a real
worker would: the others report the step as interrupted, and the control loop recovers.
Any control request (scale, stop, kill) can be made between chunks through `before_chunk`.

No Ray, no torch workers: the whole control loop runs at hundreds of members in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.adapt.lr import LrRamp
from elastic.adapt.plan import BatchPlan
from elastic.config import ChaosEvent
from elastic.control.cursor import Cursor
from elastic.control.port import (
    ChunkDone,
    ChunkInterrupted,
    ChunkOutcome,
    ChunkReport,
    ChunkSkipped,
    ChunkVotedDown,
    EvalDone,
    EvalInterrupted,
    EvalOutcome,
    EvalReport,
    EvalVotedDown,
    Gathered,
    Hung,
    Member,
    Started,
)
from elastic.errors import (
    ElasticError,
    GenerationOutOfMemoryError,
    HalfUpdatedError,
    WorkerLostError,
)
from elastic.trainer.outcomes import EvalFailure, StepRecord


@dataclass
class _Worker:
    worker_id: int
    ready_at: float
    step: int = 0
    cursor: Cursor = field(default_factory=Cursor)
    alive: bool = True
    torn: bool = False  # half updated (out of memory in its apply phase): offers no state
    completed: bool = True  # the last chunk it ran completed (else it skips those queued)
    unreported: list[int] = field(default_factory=list)  # steps of its writes in flight


class SimulatedWorkers:
    """The `Workers` port over simulated members.

    Args:
        dataset_size: samples in the simulated data set.
        capacity: workers the simulated cluster can host at once.
        step_time_s: simulated duration of one step.
        start_delay_s: simulated time from spawning a worker to its being up.
        before_chunk: called with the committed step before each chunk (to make requests).
        votes: step -> failures: the first time each step runs, every rank votes it down
            with the first failure of its list (`UserFailure`, `OutOfMemory` or `NonFinite`
            of `elastic.trainer.replica`), the next time with the next one, and so on; the
            failure "collective": every rank's collective fails in the step, nobody died.
        traits: what the workers report of the model (`Replica.traits`; default: no
            BatchNorm or dropout layers).
        metrics: what an evaluation of the committed step returns (default: {"score": step}).
        oom_in_collective: an `OutOfMemory` vote happens in the step's communication: the
            ranks it names abort their communicators (`ChunkVotedDown(broken=True)`) and the
            others report the chunk interrupted.
        oom_in_apply: as `oom_in_collective`, in the apply phase: the ranks it names are also
            left half updated and offer no state (`Replica.restorable_step`) until they sync.
        slow: worker id -> factor by which its compute is slower (a straggler).
        writing: worker ids whose checkpoint write runs beside every step (`StepRecord.writing`;
            give them a `slow` factor too for the competition it makes).
        oom_forming: (step, doing, worker id): when a generation forms whose newest member
            holds `step`, that worker runs out of memory while `doing` ('connecting',
            'restoring', or 'loading a checkpoint' in `restore_checkpoint`;
            `GenerationOutOfMemoryError`); each entry once, in order.
        dataset_sizes: worker id -> the length of the data set that worker builds (default:
            `dataset_size`; another builds a different data set, as a node with other files).
        start_errors: worker id -> the error that worker fails to start with (a
            `WorkerLostError` for one whose node died, a `ConfigError` for a factory that
            raised), at the time it would have been up.
        store: where checkpoints are kept (the step, cursor and manifest fields of each
            write) and restored from, newest first; share one list between two simulations
            to resume one run's checkpoints in another (default: none is ever found).
        async_writes: a checkpoint write is reported done by its worker's next checkpoint
            or flush call (in the background), not in its own answer; a worker that dies
            first never reports it.
        on_preempted_nodes: worker ids whose death, however it comes (a chaos kill), Ray puts
            down to their node's preemption (`preempted`).
    """

    def __init__(self, dataset_size: int, capacity: int, step_time_s: float = 0.01,
                 start_delay_s: float = 1.0,
                 before_chunk: Callable[[int], None] | None = None,
                 votes: dict[int, list[Any]] | None = None,
                 traits: dict[str, int] | None = None,
                 metrics: Callable[[int], dict[str, float]] | None = None,
                 oom_in_collective: bool = False, oom_in_apply: bool = False,
                 slow: dict[int, float] | None = None,
                 oom_forming: Sequence[tuple[int, str, int]] = (),
                 dataset_sizes: Mapping[int, int] | None = None,
                 start_errors: Mapping[int, ElasticError] | None = None,
                 writing: Collection[int] = (),
                 store: list[dict[str, Any]] | None = None,
                 async_writes: bool = False,
                 on_preempted_nodes: Collection[int] = ()) -> None:
        self.writing = set(writing)
        self.async_writes = async_writes
        self._preempted = set(on_preempted_nodes)
        self.store = store
        self.start_errors = dict(start_errors or {})
        self.oom_forming = list(oom_forming)
        self.dataset_sizes = dict(dataset_sizes or {})
        self._generation = 0  # the one forming, or formed last
        self.dataset_size = dataset_size
        self.oom_in_collective = oom_in_collective or oom_in_apply
        self.oom_in_apply = oom_in_apply
        self.slow = dict(slow or {})
        self.capacity = capacity
        self.step_time_s = step_time_s
        self.start_delay_s = start_delay_s
        self.before_chunk = before_chunk
        self.votes = {step: list(failures) for step, failures in (votes or {}).items()}
        self.traits = traits or {"batchnorm": 0, "dropout": 0}
        self.metrics = metrics or (lambda step: {"score": float(step)})
        self.evaluations: list[tuple[int, tuple[int, ...]]] = []  # (step, shares) of each
        self.scheduled: list[bool] = []  # whether each evaluation steps an evaluation scheduler
        self.checkpoints: list[int] = []  # the step of each checkpoint written
        self.handed_over: list[tuple[int, ...]] = []  # workers that handed their parts over
        self.fired: set[tuple[int, int]] = set()  # (step, rank) of each kill that fired
        self.clock = 1_000_000.0
        self.workers: dict[int, _Worker] = {}
        self._starting: list[int] = []
        self.chunks = 0
        # [ids, plan, start, steps, chaos, handed out while another chunk was queued, yielded]
        self._queued: list[list[Any]] = []
        self.ahead = 0  # chunks handed out while another one was queued
        self.parked: set[int] = set()  # hot spares, until a generation takes them in

    def now(self) -> float:
        return self.clock

    # --- processes -----------------------------------------------------------------------------

    def spawn(self) -> int:
        worker_id = len(self.workers)
        # A worker the cluster has no room for never comes up.
        room = sum(w.alive for w in self.workers.values()) < self.capacity
        ready_at = self.clock + self.start_delay_s if room else float("inf")
        self.workers[worker_id] = _Worker(worker_id, ready_at=ready_at)
        self._starting.append(worker_id)
        return worker_id

    def starting(self) -> int:
        return len(self._starting)

    def joinable(self) -> bool:
        return any(self.workers[w].ready_at <= self.clock for w in self._starting)

    def admit(self, wanted: int | None, timeout: float) -> Started:
        by_time = sorted(self._starting, key=lambda w: self.workers[w].ready_at)
        count = len(by_time) if wanted is None else min(wanted, len(by_time))
        ready = [w for w in by_time[:count] if self.workers[w].ready_at <= self.clock + timeout]
        if ready and len(ready) == count:
            self.clock = max(self.clock, self.workers[ready[-1]].ready_at)
        else:
            self.clock += timeout
        for w in ready:
            self._starting.remove(w)
            if w in self.start_errors:
                self.workers[w].alive = False
        return Started([Member(w, pid=10_000 + w, node_id="sim",
                               dataset_size=self.dataset_sizes.get(w, self.dataset_size))
                        for w in ready if w not in self.start_errors],
                       [self.start_errors[w] for w in ready if w in self.start_errors])

    def placeable(self) -> int:
        return self.capacity

    def free_slot(self) -> bool:
        return sum(w.alive for w in self.workers.values()) < self.capacity

    def kill(self, worker_id: int) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.alive = False
            if worker_id in self._starting:
                self._starting.remove(worker_id)

    def park(self, worker_id: int) -> None:
        self.parked.add(worker_id)

    def parked_lost(self) -> list[int]:
        lost = sorted(w for w in self.parked if not self.workers[w].alive)
        self.parked -= set(lost)
        return lost

    def release(self, worker_id: int) -> None:
        self.parked.discard(worker_id)
        self.kill(worker_id)  # a simulated worker that leaves simply ends

    def shutdown(self) -> None:
        for worker_id in list(self.workers):
            self.kill(worker_id)

    # --- generations -------------------------------------------------------------------------

    def connect(self, ids: Sequence[int], generation: int) -> Gathered[tuple[int, str]]:
        self.parked -= set(ids)
        self._generation = generation
        dead = [r for r, w in enumerate(ids) if not self.workers[w].alive]
        self.clock += 0.05
        values: list[tuple[int, str] | None] = [
            None if r in dead else (-1 if self.workers[w].torn else self.workers[w].step, "sim")
            for r, w in enumerate(ids)]
        failed = self._out_of_memory(ids, "connecting")
        return Gathered(values if failed is None else [None] * len(ids), dead,
                        out_of_memory=[failed] if failed is not None else [])

    def sync(self, ids: Sequence[int], src: int,
             leaving: Sequence[int] = ()) -> Gathered[dict[str, int]]:
        if leaving:
            self.handed_over.append(tuple(ids[r] for r in leaving))
        source = self.workers[ids[src]]
        assert not source.torn, "a half-updated worker was taken as the source"
        failed = self._out_of_memory(ids, "restoring")
        if failed is not None:
            return Gathered([None] * len(ids), out_of_memory=[failed])
        for w in ids:
            self.workers[w].step, self.workers[w].cursor = source.step, source.cursor
            self.workers[w].torn = False
        self.clock += 0.05
        return Gathered([source.cursor.to_dict() for _ in ids])

    def _out_of_memory(self, ids: Sequence[int], doing: str) -> GenerationOutOfMemoryError | None:
        """The error of the member that runs out of memory `doing` this time (`oom_forming`)."""
        step = max(self.workers[w].step for w in ids)
        if not self.oom_forming or self.oom_forming[0][:2] != (step, doing):
            return None
        _, _, worker_id = self.oom_forming.pop(0)
        if worker_id not in ids:
            return None
        rank = list(ids).index(worker_id)
        return GenerationOutOfMemoryError(
            f"rank {rank} (worker {worker_id}) ran out of memory while generation "
            f"{self._generation} formed ({doing})", rank=rank, generation=self._generation,
            doing=doing)

    # --- chunks ------------------------------------------------------------------------------

    def start_chunk(self, ids: Sequence[int], plan: BatchPlan, start: int, num_steps: int,
                    chaos: list[ChaosEvent], lr_ramp: LrRamp | None) -> None:
        if self.before_chunk is not None:
            self.before_chunk(start)
        self.ahead += bool(self._queued)
        self._queued.append([list(ids), plan, start, num_steps, chaos, bool(self._queued), False,
                             lr_ramp])

    def yield_chunks(self) -> None:
        """The chunks queued so far end after their first step."""
        for entry in self._queued:
            entry[6] = True

    def finish_chunk(self, hang_timeout: float, hung: Hung) -> ChunkReport:
        ids, plan, start, num_steps, chaos, ahead, yielded, lr_ramp = self._queued.pop(0)
        first = self.workers[ids[0]]
        if ahead and any(not self.workers[w].completed or self.workers[w].step != start
                         for w in ids):
            # Behind a chunk that did not complete: every rank skips it (the dead report so).
            lost = {r: "simulated kill" for r, w in enumerate(ids) if not self.workers[w].alive}
            skipped = ChunkSkipped([], first.step, first.cursor.to_dict())
            return ChunkReport({r: skipped for r in range(len(ids)) if r not in lost}, lost)
        report = self._run(ids, plan, 1 if yielded else num_steps, chaos, lr_ramp)
        done = all(isinstance(o, ChunkDone) for o in report.outcomes.values()) and not report.lost
        for w in ids:
            self.workers[w].completed = done
        return report

    def _run(self, ids: Sequence[int], plan: BatchPlan, num_steps: int,
             chaos: list[ChaosEvent], lr_ramp: LrRamp | None = None) -> ChunkReport:
        self.chunks += 1
        world = len(ids)
        batch = plan.global_batch_size
        shares = tuple(plan.shares)
        first = self.workers[ids[0]]
        kills = {e.rank for e in chaos if e.action == "kill" and e.rank < world}
        cursor, step = first.cursor, first.step
        records: list[list[StepRecord]] = [[] for _ in range(world)]
        for i in range(num_steps):
            if i == 0 and kills:
                return self._killed(ids, kills, cursor, step)
            if self.votes.get(step):
                failure = self.votes[step].pop(0)
                if failure == "collective":  # every rank's collective fails; nobody died
                    self._commit(ids, cursor)
                    return ChunkReport({r: ChunkInterrupted(records[r], step, cursor.to_dict(),
                                                            "simulated connection reset")
                                        for r in range(world)})
                return self._voted(ids, failure, records, cursor, step)
            self.clock += self.step_time_s
            epoch = cursor.start(self.dataset_size, batch)[0]
            for rank in range(world):
                records[rank].append(StepRecord(
                    step=step, epoch=epoch, loss=1.0 / (step + 1), world_size=world,
                    global_batch_size=batch, shares=shares, micro_batch=plan.micro_batches[rank],
                    step_time_s=self.step_time_s,
                    compute_time_s=self.step_time_s / 2 * self.slow.get(ids[rank], 1.0),
                    end_time=self.clock,
                    lr=0.1 * (lr_ramp.factor(step) if lr_ramp is not None else 1.0),
                    writing=ids[rank] in self.writing))
            cursor, step = cursor.advance(self.dataset_size, batch), step + 1
        self._commit(ids, cursor)
        return ChunkReport({rank: ChunkDone(records[rank], step, cursor.to_dict())
                            for rank in range(world)})

    def _commit(self, ids: Sequence[int], cursor: Cursor) -> None:
        for w in ids:
            self.workers[w].step, self.workers[w].cursor = cursor.step, cursor

    def _voted(self, ids: Sequence[int], failure: Any, records: list[list[StepRecord]],
               cursor: Cursor, step: int) -> ChunkReport:
        """Every rank votes step `step` down with `failure`; the steps before it committed."""
        self._commit(ids, cursor)
        if self.oom_in_collective and type(failure).__name__ == "OutOfMemory":
            for rank in failure.ranks if self.oom_in_apply else ():
                self.workers[ids[rank]].torn = True
            return ChunkReport({
                rank: ChunkVotedDown(records[rank], step, cursor.to_dict(), failure, broken=True)
                if rank in failure.ranks else
                ChunkInterrupted(records[rank], step, cursor.to_dict(), "aborted")
                for rank in range(len(ids))})
        return ChunkReport({rank: ChunkVotedDown(records[rank], step, cursor.to_dict(), failure)
                            for rank in range(len(ids))})

    def _killed(self, ids: Sequence[int], kills: set[int], cursor: Cursor,
                step: int) -> ChunkReport:
        """Ranks in `kills` die in the chunk's first step; the others report it interrupted."""
        for rank in kills:
            self.workers[ids[rank]].alive = False
            self.fired.add((step, rank))
        self.clock += self.step_time_s / 2
        interrupted = ChunkInterrupted([], step, cursor.to_dict(), "simulated peer loss")
        outcomes: dict[int, ChunkOutcome] = {
            r: interrupted for r in range(len(ids)) if r not in kills}
        return ChunkReport(outcomes, {r: "simulated kill" for r in sorted(kills)}, self.clock)

    def evaluate(self, ids: Sequence[int], shares: Sequence[int], chaos: list[ChaosEvent],
                 hang_timeout: float, hung: Hung, scheduled: bool = True) -> EvalReport:
        """Every member evaluates (`metrics` of the committed step); scheduled kills of phase
        'evaluate' make their ranks die in it and 'raise' fails it on every rank."""
        step = self.workers[ids[0]].step
        self.evaluations.append((step, tuple(shares)))
        self.scheduled.append(scheduled)
        self.clock += self.step_time_s
        kills = {e.rank for e in chaos if e.action == "kill" and e.rank < len(ids)}
        raised = tuple(sorted(e.rank for e in chaos if e.action == "raise"))
        if kills:
            for rank in kills:
                self.workers[ids[rank]].alive = False
                self.fired.add((step, rank))
            survivors: dict[int, EvalOutcome] = {
                r: EvalInterrupted("simulated peer loss") for r in range(len(ids)) if r not in kills}
            return EvalReport(survivors, {r: "simulated kill" for r in sorted(kills)}, self.clock)
        outcome: EvalOutcome = (EvalVotedDown(EvalFailure(raised, "InjectedFault")) if raised
                                else EvalDone(self.metrics(step)))
        return EvalReport(dict.fromkeys(range(len(ids)), outcome))

    # --- single calls ------------------------------------------------------------------------

    def call(self, worker_id: int, method: str, *args: Any) -> Any:
        worker = self.workers[worker_id]
        if not worker.alive:
            raise WorkerLostError(f"worker {worker_id} is dead")
        if method == "traits":
            return dict(self.traits)
        if method in ("model_state", "checkpoint") and worker.torn:
            raise HalfUpdatedError(f"worker {worker_id} is half updated")
        if method == "model_state":
            return {"step": worker.step}
        if method == "evaluate":
            return {}
        # Checkpoints: every write is taken; none is ever found unless a `store` was given.
        if method == "checkpoint":
            self.checkpoints.append(worker.step)
            if self.store is not None:
                self.store.append({"step": worker.step, "cursor": worker.cursor,
                                   "meta": dict(args[0])})
            if self.async_writes:  # in the background: reported by its next call
                done, worker.unreported = worker.unreported, [worker.step]
                return {"submitted": True, "reports": _reports(done)}
            return {"submitted": True, "reports": _reports([worker.step])}
        if method == "flush_checkpoints":
            done, worker.unreported = worker.unreported, []
            return _reports(done)
        if method == "restore_checkpoint":
            failed = self._out_of_memory([worker_id], "loading a checkpoint")
            if failed is not None:
                raise failed
            if not self.store:
                return {"step": None, "path": None, "skipped": [], "unsigned": []}
            newest = max(self.store, key=lambda c: c["step"])
            worker.step, worker.cursor, worker.torn = newest["step"], newest["cursor"], False
            return {"step": newest["step"], "path": f"sim/step-{newest['step']}", "skipped": [],
                    **newest["meta"]}
        raise NotImplementedError(f"the simulation has no {method!r}")

    def preempted(self, ids: Sequence[int]) -> list[int]:
        found = [w for w in ids if w in self._preempted and not self.workers[w].alive]
        self._preempted.difference_update(found)
        return found

    def fired_kill(self, step: int, rank: int) -> float | None:
        return self.clock if (step, rank) in self.fired else None


def _reports(steps: list[int]) -> list[dict[str, Any]]:
    """What a worker reports of its finished checkpoint writes of `steps`."""
    return [{"step": step, "error": None, "path": f"sim/step-{step}", "seconds": 0.0,
             "pruned": []} for step in steps]
