"""The seam between the control loop and the workers: plain records and the `Workers` port.

The states and the failure policy (`elastic.control.states`, `elastic.control.policy`) never
touch Ray. Everything they ask of the worker processes goes through `Workers`, which the
controller actor implements with Ray actors (`elastic.actors.workers.RayWorkers`) and tests
and benchmarks implement with simulated members (`elastic.control.simulation`). Members are
named by worker id, never by actor handle, so the port is the only holder of handles and the
only code that starts or kills a process.

No Ray here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, Union

from elastic.errors import ElasticError, GenerationOutOfMemoryError

if TYPE_CHECKING:
    from elastic.adapt.lr import LrRamp
    from elastic.adapt.plan import BatchPlan
    from elastic.config import ChaosEvent

# The hang watchdog's verdict: rank -> (phase, seconds in it) of the ranks that did not answer
# within the hang timeout, to the ranks to kill (`decisions.hung_ranks`).
Hung = Callable[[dict[int, tuple[str, float]]], list[int]]

T = TypeVar("T")


@dataclass(frozen=True)
class Member:
    """A started worker: its id (never reused in a run), process id, Ray node, and the
    length of the data set it built."""

    worker_id: int
    pid: int
    node_id: str
    dataset_size: int


@dataclass(frozen=True)
class Gathered(Generic[T]):
    """One call on every member of a generation, in rank order.

    Attributes:
        values: each rank's answer (None for ranks in `dead` or `broken`).
        dead: ranks whose process died (or whose node did) before answering.
        broken: one line per live rank whose call raised a `CollectiveError`.
        out_of_memory: the errors of the live ranks that ran out of memory in the call.
    """

    values: list[T | None]
    dead: list[int] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    out_of_memory: list[GenerationOutOfMemoryError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.dead and not self.broken and not self.out_of_memory


NoticeSource = Literal["sigterm", "ray_drain", "drain", "straggler"]
"""Where a departure notice came from: the worker's process got SIGTERM (Kubernetes, Slurm,
a spot notice), Ray marked its node draining (the autoscaler's scale-in, `ray drain-node`,
KubeRay's pod deletion), `elastic drain`, or the run itself swaps a straggler for a hot spare
(`FailureConfig.straggler_factor`; not a preemption)."""


@dataclass(frozen=True)
class Notice:
    """A member is told to leave the run by a deadline (a preemption, a scale-in).

    Attributes:
        worker_id: the member that leaves.
        source: where the notice came from.
        deadline: wall-clock time (`Workers.now()`) by which it is gone; None when the source
            does not say (a SIGTERM: the grace period is the scheduler's).
        received: when the controller learned of it.
        reason: what the source said (Ray's drain message, the caller of `elastic drain`).
    """

    worker_id: int
    source: NoticeSource
    deadline: float | None
    received: float
    reason: str = ""


# --- what one worker reports after a chunk of steps (one union, no status strings) ----------


@dataclass(frozen=True)
class ChunkDone:
    """Every step of the chunk committed on this rank.

    Attributes:
        records: one per committed step (`elastic.trainer.replica.StepRecord`).
        committed_step: the replica's step after the chunk.
        cursor: the committed data cursor (`Cursor.to_dict()`).
    """

    records: list[Any]
    committed_step: int
    cursor: dict[str, int]


@dataclass(frozen=True)
class ChunkInterrupted:
    """A collective raised (a peer died, a timeout, or the controller aborted): the steps in
    `records` committed, the next one did not. `error` is the collective error's text."""

    records: list[Any]
    committed_step: int
    cursor: dict[str, int]
    error: str


@dataclass(frozen=True)
class ChunkVotedDown:
    """The ranks voted a step down (`failure` says why: `UserFailure`, `OutOfMemory` or
    `NonFinite` from `elastic.trainer.replica`); no rank applied it. `broken`: this rank ran
    out of memory in the step's communication itself and aborted its communicator, so the
    generation must be re-formed (its peers are released at once)."""

    records: list[Any]
    committed_step: int
    cursor: dict[str, int]
    failure: Any
    broken: bool = False


@dataclass(frozen=True)
class ChunkFailed:
    """User code that runs after a step is applied raised (`elastic.errors.AfterStepError`), or
    the job cannot run a step (a `ConfigError`): the steps in `records` committed; the run
    cannot go on."""

    records: list[Any]
    committed_step: int
    cursor: dict[str, int]
    error: Any


@dataclass(frozen=True)
class ChunkSkipped:
    """A chunk handed out ahead (`Workers.start_chunk`) that this rank did not run: the chunk
    before it did not complete, or did not end at this one's first step. `records` is empty."""

    records: list[Any]
    committed_step: int
    cursor: dict[str, int]


ChunkOutcome = Union[ChunkDone, ChunkInterrupted, ChunkVotedDown, ChunkFailed, ChunkSkipped]  # noqa: UP007


@dataclass(frozen=True)
class ChunkReport:
    """Every rank's answer to one chunk.

    Attributes:
        outcomes: rank -> outcome, for ranks that answered.
        lost: rank -> Ray's reason, for ranks whose process died during the chunk.
        detected: when the first loss was seen (`Workers.now()`), 0.0 if none.
        hung: (rank, phase) of workers killed by the hang watchdog.
    """

    outcomes: dict[int, ChunkOutcome]
    lost: dict[int, str] = field(default_factory=dict)
    detected: float = 0.0
    hung: list[tuple[int, str]] = field(default_factory=list)


# --- what one worker reports after an evaluation -------------------------------------------


@dataclass(frozen=True)
class EvalDone:
    """The evaluation finished; `metrics` ({name: value}) are the same on every rank."""

    metrics: dict[str, float]


@dataclass(frozen=True)
class EvalVotedDown:
    """User code raised during the evaluation on some rank, or the ranks disagree (metric
    names, evaluation set size): every rank reports it (`failure`:
    `elastic.trainer.evaluation.EvalFailure`)."""

    failure: Any


@dataclass(frozen=True)
class EvalInterrupted:
    """A collective of the evaluation raised (a peer died, a timeout, or the controller
    aborted); `error` is its text. The committed state is untouched."""

    error: str


@dataclass(frozen=True)
class EvalFailed:
    """The evaluation finished, but the scheduler stepped after it raised
    (`elastic.errors.AfterStepError`, `training.scheduler_interval` 'evaluation'): the run
    cannot go on."""

    error: Any


EvalOutcome = Union[EvalDone, EvalVotedDown, EvalInterrupted, EvalFailed]  # noqa: UP007


@dataclass(frozen=True)
class EvalReport:
    """Every rank's answer to one evaluation (fields as in `ChunkReport`)."""

    outcomes: dict[int, EvalOutcome]
    lost: dict[int, str] = field(default_factory=dict)
    detected: float = 0.0
    hung: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Started:
    """Workers whose start finished since the last look: admitted members, and the errors of
    those that failed to start (a `ConfigError` when the job's factories raised, else a
    `WorkerLostError` with Ray's reason)."""

    members: list[Member]
    failed: list[ElasticError] = field(default_factory=list)


class Workers(Protocol):
    """What the control loop may ask of the worker processes.

    Each call that addresses a generation takes the members' worker ids in rank order. A call
    that waits on several members aborts every other member's communicator at the first death
    or collective error, so that nobody waits out a timeout for a peer that will never come.
    """

    def now(self) -> float:
        """Wall-clock time (`time.time()` for real workers; simulated time in a simulation)."""
        ...

    def spawn(self) -> int:
        """Starts one worker in the background; returns its worker id."""
        ...

    def starting(self) -> int:
        """Workers started and not yet admitted or failed."""
        ...

    def joinable(self) -> bool:
        """Whether a started worker is up (or failed to start) and `admit` would hand it over
        now; a worker still starting (or waiting for capacity) is not."""
        ...

    def admit(self, wanted: int | None, timeout: float) -> Started:
        """Waits up to `timeout` for started workers (for `wanted` of them, or every one if
        None) and hands over those that are up."""
        ...

    def placeable(self) -> int:
        """How many workers the whole cluster could host, by its total resources."""
        ...

    def free_slot(self) -> bool:
        """True if the cluster has the resources for one more worker now."""
        ...

    def kill(self, worker_id: int) -> None:
        """Kills a worker (member or starting); idempotent."""
        ...

    def park(self, worker_id: int) -> None:
        """Keeps a started worker as a hot spare: it trains nothing and holds no share until a
        generation takes it in (`connect`); its death meanwhile shows in `parked_lost`."""
        ...

    def parked_lost(self) -> list[int]:
        """Spares (`park`) whose process died since the last look, by worker id."""
        ...

    def preempted(self, ids: Sequence[int]) -> list[int]:
        """Those of the dead workers `ids` whose death Ray put down to their node's preemption
        (a drain whose node went before its notice was seen); each is said once."""
        ...

    def release(self, worker_id: int) -> None:
        """Lets a worker that left the run at a step boundary (a planned departure) end its
        process on its own, as a clean exit; killed if it has not within a few seconds."""
        ...

    def shutdown(self) -> None:
        """Kills every worker, members and starting ones."""
        ...

    def connect(self, ids: Sequence[int], generation: int) -> Gathered[tuple[int, str]]:
        """Forms `generation` (through the run's authenticated rendezvous, whose bookkeeping
        for the generation is deleted afterwards): each member's (committed step, transport)."""
        ...

    def sync(self, ids: Sequence[int], src: int,
             leaving: Sequence[int] = ()) -> Gathered[dict[str, int]]:
        """Every member takes rank `src`'s state; each member's data cursor. `leaving`: ranks
        about to leave (a planned departure), which hand their sharded optimizer state over
        to the others and own none of it."""
        ...

    def start_chunk(self, ids: Sequence[int], plan: BatchPlan, start: int, num_steps: int,
                    chaos: list[ChaosEvent], lr_ramp: LrRamp | None) -> None:
        """Hands every member `num_steps` steps from step `start`, without waiting. A member
        runs a chunk once every chunk handed to it before in this generation has ended, and
        only if the last of them completed at `start`; otherwise it reports `ChunkSkipped`.
        So the next chunk can be handed out while the current one runs, and no rank idles at
        the boundary between them."""
        ...

    def finish_chunk(self, hang_timeout: float, hung: Hung) -> ChunkReport:
        """Waits for every member's answer to the oldest chunk handed out and not finished.
        When no member answers for `hang_timeout` seconds, asks the waiting ones where they
        are and kills the ranks that `hung(phases)` names (the normal loss path follows)."""
        ...

    def yield_chunks(self) -> None:
        """Ends the chunks handed out so far early, for a control request (from any thread):
        the running one after the step whose metadata first carries the request, on every
        rank after the same step (`ChunkDone` with fewer steps), and the ones queued behind it
        are skipped. Nothing if no chunk is out."""
        ...

    def evaluate(self, ids: Sequence[int], shares: Sequence[int], chaos: list[ChaosEvent],
                 hang_timeout: float, hung: Hung, scheduled: bool) -> EvalReport:
        """Evaluates the committed model on every member, each over its slice of the
        evaluation set (in proportion to `shares`); hangs are handled as in `finish_chunk`.
        `scheduled`: a scheduler of `scheduler_interval` 'evaluation' steps after it."""
        ...

    def call(self, worker_id: int, method: str, *args: Any) -> Any:
        """Calls a worker method that needs no collective (`dataset_size`, `traits`, `evaluate`,
        `model_state`, `checkpoint`, `flush_checkpoints`, `restore_checkpoint`).

        Raises:
            WorkerLostError: the worker is dead.
        """
        ...

    def fired_kill(self, step: int, rank: int) -> float | None:
        """When a scheduled chaos kill of (step, rank) fired (the worker left a marker with
        the time), else None."""
        ...
