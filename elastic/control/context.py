"""What the controller's states share: the run's members, cursor, batch state and counters.

No Ray here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from elastic.config import ChaosEvent, FitConfig
from elastic.control.batching import Batching
from elastic.control.checkpoints import CheckpointCoordinator
from elastic.control.cursor import Cursor
from elastic.control.policy import FailurePolicy
from elastic.control.port import Member, Notice, Workers
from elastic.events import StopRequested, iter_jsonl
from elastic.recovery import PendingRecovery
from elastic.runlog import RunLog


def standing_requests(records: Iterable[dict[str, Any]]) -> tuple[bool, int | None]:
    """The stop and scale requests (events `stop_requested`, `scale_requested`) made since the
    run last started (a `start` event; not one a restarted controller wrote, marked
    `restarted`: those requests still stand), from the run's event records: whether
    it was asked to stop, and the world size it was last asked for (None: none). A controller
    Ray restarts takes them up again; before, it forgot them (an `elastic stop` answered
    "stopping", then the run went on to its end)."""
    stop, target = False, None
    for record in records:
        kind = record.get("event")
        if kind == "start" and not record.get("restarted"):  # a restarted controller's goes
            stop, target = False, None                       # on with what was asked before
        elif kind == "stop_requested":
            stop = True
        elif kind == "scale_requested" and isinstance(record.get("num_workers"), int):
            target = record["num_workers"]
    return stop, target


@dataclass
class Requests:
    """Control requests from other threads (`scale`, `kill`, `stop`), read at the next step
    boundary. Every field is read and written under `lock`.

    Attributes:
        target: the world size to reach.
        scaled_by_user: the size was set by `scale` (or fixed by the survivors when lost
            workers are not replaced): no growth into free capacity beyond it.
        stop: end at the next boundary.
        killed_at: time of the last `kill` request, for the next recovery's timing.
        killed_on_purpose: worker ids killed by `kill` (their loss is planned).
        departures: members told to leave, by worker id (`notice`); they leave at the next
            step boundary, or their loss counts as a preemption if they die first.
        overdue: members among `departures` whose deadline passed: they are being killed, so
            a step boundary that comes before their death is seen does not let them go
            (`leaving`); the failure path recovers from their loss.
        save: a checkpoint of the committed state is written at the next boundary (the head
            node drains: the cluster ends with it).
    """

    target: int
    scaled_by_user: bool = False
    stop: bool = False
    killed_at: float | None = None
    killed_on_purpose: set[int] = field(default_factory=set)
    departures: dict[int, Notice] = field(default_factory=dict)
    overdue: set[int] = field(default_factory=set)
    save: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def notice(self, notice: Notice, overdue: bool = False) -> bool:
        """Records that `notice.worker_id` must leave; of several notices for one worker the
        earliest deadline stands (with its source). True if it is new or moved the deadline
        earlier (worth an event), False if an earlier notice already covers it. `overdue`:
        its deadline has passed already (the caller kills the worker), recorded in the same
        breath so that no step boundary lets it go in between."""
        with self.lock:
            known = self.departures.get(notice.worker_id)
            # A notice from outside (a preemption) outranks the run's own straggler swap.
            outranks = known is not None and known.source == "straggler" != notice.source
            if known is not None and not outranks and (notice.deadline is None or (
                    known.deadline is not None and known.deadline <= notice.deadline)):
                return False
            if known is not None:  # an earlier deadline: the first notice's time stands
                notice = replace(notice, received=known.received)
            self.departures[notice.worker_id] = notice
            if overdue:
                self.overdue.add(notice.worker_id)
            return True

    def overdue_now(self, worker_id: int) -> None:
        """The deadline of `worker_id`'s notice passed: it is killed, not let go (`overdue`)."""
        with self.lock:
            self.overdue.add(worker_id)

    def leaving(self, ids: list[int]) -> list[int]:
        """The worker ids among `ids` that were told to leave (and are not being killed for a
        missed deadline)."""
        with self.lock:
            return [w for w in ids if w in self.departures and w not in self.overdue]

    def told(self, ids: list[int]) -> list[int]:
        """The worker ids among `ids` that have a notice, overdue or not: spares and workers
        starting, which have no rank and leave whenever they are looked at."""
        with self.lock:
            return [w for w in ids if w in self.departures]

    def gone(self, ids: list[int]) -> list[Notice]:
        """Forgets the notices of the workers `ids` (they left or died); returns those there
        were."""
        with self.lock:
            self.overdue.difference_update(ids)
            return [n for n in (self.departures.pop(w, None) for w in ids) if n is not None]

    def take_killed_at(self) -> float | None:
        with self.lock:
            killed_at, self.killed_at = self.killed_at, None
        return killed_at


@dataclass(frozen=True)
class Roster:
    """Who trains and who waits to, as `status` reports it.

    Attributes:
        generation: the last generation formed (-1 before the first).
        world: its members still in the run, in rank order: the ranks that train.
        joining: members admitted since it formed, not yet in a generation (the resize at the
            next boundary admits them; until then they hold no state and have no rank).
    """

    generation: int
    world: list[Member]
    joining: list[Member]


@dataclass
class Context:
    """The state every controller state reads and changes.

    Attributes:
        config: the run's configuration.
        name: the run's name.
        log: the run's events and metrics.
        workers: the port to the worker processes.
        has_evaluate: the job has an `evaluate` function.
        has_eval_step: the job has an evaluation set and `eval_step` (distributed evaluation).
        restarted: this controller is a restarted one (it must resume from a checkpoint).
        publish: writes the run's record to the index (after every state change and chunk).
        members: the current members in rank order.
        spares: hot spares (`ScalingConfig.spares`): started workers that train nothing until
            one takes a member's place (`elastic.control.group.promote`).
        generation: the current generation (-1 before the first); it counts up as a
            generation starts to form.
        formed: the last generation formed and its members' worker ids, set once every rank
            holds the committed state (what `roster` reports as training).
        cursor: the committed data cursor.
        total_steps: the step at which the run ends, at the global batch in force.
        dataset_size: samples in the data set.
        batching: the batch state (None until the run has started).
        policy: the failure policy and its counters.
        checkpoints: when and where checkpoints are written.
        requests: control requests from other threads.
        chaos: scheduled faults not yet fired, by step.
        recovery: the timing of a recovery whose first step has not completed.
        evaluation: the last evaluation's metrics (`eval_step`'s and `evaluate`'s).
        evaluated_at: the step of the last evaluation (None before the first).
        pending_evaluation: the step of an evaluation that is due and not yet done (a failure
            interrupted it, or a user error is retried); it runs before training goes on.
        pending_scheduled: that evaluation is one of `FitConfig.evaluation`'s intervals (not
            only the run's end or a stop): the scheduler of `scheduler_interval` 'evaluation'
            steps after it.
        stopped_early: the run ended on a stop request.
        start_failures: workers in a row that failed to start since one last joined (at
            `failure.max_start_failures`, no more are started: `group.top_up`).
    """

    config: FitConfig
    name: str
    log: RunLog
    workers: Workers
    has_evaluate: bool = False
    has_eval_step: bool = False
    restarted: bool = False
    publish: Callable[[], None] = lambda: None
    members: list[Member] = field(default_factory=list)
    spares: list[Member] = field(default_factory=list)
    generation: int = -1
    formed: tuple[int, frozenset[int]] = (-1, frozenset())
    cursor: Cursor = field(default_factory=Cursor)
    total_steps: int = 0
    dataset_size: int = 0
    batching: Batching | None = None
    policy: FailurePolicy = field(init=False)
    checkpoints: CheckpointCoordinator = field(init=False)
    requests: Requests = field(init=False)
    chaos: list[ChaosEvent] = field(init=False)
    recovery: PendingRecovery | None = None
    evaluation: dict[str, Any] = field(default_factory=dict)
    evaluated_at: int | None = None
    pending_evaluation: int | None = None
    pending_scheduled: bool = False
    stopped_early: bool = False
    start_failures: int = 0

    def __post_init__(self) -> None:
        self.policy = FailurePolicy(self.config.failure)
        self.checkpoints = CheckpointCoordinator(self.config, self.log, self.workers)
        self.checkpoints.run_name = self.name
        self.requests = Requests(target=self.config.scaling.num_workers)
        if self.restarted:  # what the controller that died was asked still stands
            stop, target = standing_requests(
                iter_jsonl(os.path.join(self.log.run_dir, "events.jsonl")))
            self.requests.stop = stop
            if target is not None:
                self.requests.target, self.requests.scaled_by_user = target, True
        self.chaos = sorted(self.config.chaos, key=lambda e: e.step)

    @property
    def step(self) -> int:
        """The committed global step."""
        return self.cursor.step

    def request_stop(self, reason: str | None = None) -> None:
        """Ends the run gracefully at the next step boundary (`elastic stop`, or a callback's
        `StopRun`: `reason`): chunks handed out already end after the step they are in."""
        with self.requests.lock:
            self.requests.stop = True
        self.log.emit(StopRequested(reason=reason))
        self.workers.yield_chunks()

    @property
    def evaluates(self) -> bool:
        """The job has something to evaluate (`eval_step` or `evaluate`)."""
        return self.has_evaluate or self.has_eval_step

    def ids(self) -> list[int]:
        """The members' worker ids in rank order."""
        return [m.worker_id for m in self.members]

    def roster(self) -> Roster:
        """The ranks of the generation that trains, and the members waiting to join it. A
        worker admitted at a boundary is a member before the resize forms its generation: it
        counts here only once that generation has formed. Safe from other threads (it reads
        `formed` once and copies `members`)."""
        generation, ids = self.formed
        members = list(self.members)
        return Roster(generation, [m for m in members if m.worker_id in ids],
                      [m for m in members if m.worker_id not in ids])

    @property
    def batch(self) -> Batching:
        assert self.batching is not None, "the run has not started"
        return self.batching
