"""A run's events as typed records: one frozen dataclass per kind, the codec of `events.jsonl`,
and the one reader that the CLI, `report` and the benchmarks use.

On disk (and in `FitResult.events`) an event is one JSON object per line,
`{"time": <float>, "event": <kind>, **fields}`; `to_record` and `parse` convert between that
dict and the record class. An optional field (default None) is left out of the dict while it
is None; a required field is always written, even when its value may be None.

Kinds and their classes:

| kind | class |
| --- | --- |
| `batch_planned` | `BatchPlanned` |
| `chaos` | `Chaos` |
| `checkpoint_busy` | `CheckpointBusy` |
| `checkpoint_config_changed` | `CheckpointConfigChanged` |
| `checkpoint_failed` | `CheckpointFailed` |
| `checkpoint_skipped` | `CheckpointSkipped` |
| `checkpoint_written` | `CheckpointWritten` |
| `controller_restarted` | `ControllerRestarted` |
| `detached_exit` | `DetachedExit` |
| `evaluate` | `Evaluate` (its `metrics` are written as top-level fields) |
| `failed` | `Failed` |
| `final_model_written` | `FinalModelWritten` |
| `finish` | `Finish` |
| `generation` | `Generation` |
| `generation_failed` | `GenerationFailed` |
| `kill_requested` | `KillRequested` |
| `logger_behind` | `LoggerBehind` |
| `logger_dropped` | `LoggerDropped` |
| `logger_failed` | `LoggerFailed` |
| `member_unreachable` | `MemberUnreachable` |
| `micro_batch_tuned` | `MicroBatchTuned` |
| `nonfinite` | `Nonfinite` |
| `oom_backoff` | `OomBackoff` |
| `planned` | `Planned` |
| `grouped` | `Grouped` |
| `rebalance_judged` | `RebalanceJudged` |
| `rebalanced` | `Rebalanced` |
| `recovered` | `Recovered` |
| `resized` | `Resized` |
| `restored_from_checkpoint` | `RestoredFromCheckpoint` |
| `resumed` | `Resumed` |
| `scale_requested` | `ScaleRequested` |
| `shards_lost` | `ShardsLost` |
| `start` | `Start` |
| `state` | `StateChanged` |
| `stop_requested` | `StopRequested` |
| `stopping` | `Stopping` |
| `user_error` | `UserError` |
| `worker_failure` | `WorkerFailure` |
| `worker_hung` | `WorkerHung` |
| `worker_joined` | `WorkerJoined` |
| `worker_lost` | `WorkerLost` |
| `worker_removed` | `WorkerRemoved` |
| `worker_start_failed` | `WorkerStartFailed` |
| `worker_starting` | `WorkerStarting` |

A kind this version does not know (written by a newer one) parses to `UnknownEvent`.

Import the names (`from elastic.events import WorkerFailure, read_events`): the attribute
`elastic.events` of the package is the function `elastic.api.events`, not this module.

No Ray and no torch here: the CLI reads events without either.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Literal

from elastic.config import ChaosAction, ChaosPhase

KINDS: dict[str, type[Event]] = {}
"""Every known kind -> its record class (filled as the classes are defined)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event record.

    A subclass names its kind in its class statement (`class Stopping(Event, kind="stopping")`),
    which registers it in `KINDS`.

    Attributes:
        kind: the `event` value on disk (a class attribute).
        time: wall-clock time (`time.time()`) at which the event was written; None for a
            record not written yet (the writer stamps the time).
    """

    kind: ClassVar[str] = ""
    rest: ClassVar[str | None] = None  # the dict field that holds the undeclared keys, if any
    time: float | None = None

    def __init_subclass__(cls, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind:
            assert kind not in KINDS, f"event kind {kind!r} defined twice"
            cls.kind = kind
            KINDS[kind] = cls

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], *, time: float | None = None,
                    strict: bool = True) -> Event:
        """Builds a record of this kind from its fields as they are written on disk.

        Args:
            values: the fields (without `time` and `event`).
            time: the record's time.
            strict: a key that is not a field raises; otherwise it is dropped (a field that a
                newer version added).

        Raises:
            ValueError: a required field is missing.
            TypeError: `strict` and a key is not a field of this kind.
        """
        declared = {f.name for f in fields(cls)} - {"time", cls.rest}
        kwargs = {k: v for k, v in values.items() if k in declared}
        extra = {k: v for k, v in values.items() if k not in declared}
        if cls.rest is not None:
            kwargs[cls.rest] = extra
        elif extra and strict:
            raise TypeError(f"event {cls.kind!r} has no field(s) {', '.join(sorted(extra))}; its "
                            f"fields are {', '.join(sorted(declared)) or 'none'}")
        missing = [f.name for f in fields(cls)
                   if f.name in declared and f.default is MISSING and f.name not in kwargs]
        if missing:
            raise ValueError(f"event {cls.kind!r} lacks field(s) {', '.join(missing)}")
        return cls(time=time, **kwargs)


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """An event of a kind this version does not know (written by a newer version).

    Attributes:
        record: the whole record as read, `time` and `event` included.
    """

    record: dict[str, Any]

    @property  # type: ignore[override]  # the kind of an unknown record is per instance
    def kind(self) -> str:
        return str(self.record["event"])


# --- the run's lifecycle ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Start(Event, kind="start"):
    """The controller starts the run with this configuration (`FitConfig` as JSON);
    `restarted`: True when Ray restarted it (the run goes on: the requests made of the one
    before still stand)."""

    name: str
    config: dict[str, Any]
    restarted: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ControllerRestarted(Event, kind="controller_restarted"):
    """Ray restarted the controller of run `name`; it resumes from the newest checkpoint."""

    name: str


@dataclass(frozen=True, kw_only=True)
class Planned(Event, kind="planned"):
    """The data set's size and the steps that follow from it."""

    dataset_size: int
    steps_per_epoch: int
    total_steps: int


@dataclass(frozen=True, kw_only=True)
class Grouped(Event, kind="grouped"):
    """How the global batch is cut for the math (`batch.groups`): with `groups` on, every
    forward runs one group of `group_size` samples seeded by (seed, step, group); `pinned`:
    the math follows the split (BatchNorm or dropout with groups off), so shares and
    micro-batches are not rebalanced or autotuned. `reason` says which."""

    groups: bool
    group_size: int
    pinned: bool
    batchnorm: int
    dropout: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class StateChanged(Event, kind="state"):
    """The controller's state changed (`RunState` values). A resize names the current
    `world_size` and its `target`; a recovery names the `lost_ranks`."""

    previous: str
    state: str
    lost_ranks: list[int] | None = None
    world_size: int | None = None
    target: int | None = None


@dataclass(frozen=True, kw_only=True)
class Stopping(Event, kind="stopping"):
    """A stop request takes effect at this step boundary."""

    step: int


@dataclass(frozen=True, kw_only=True)
class Finish(Event, kind="finish"):
    """The run ended at `step` (`stopped`: by a stop request) after `samples` samples."""

    step: int
    stopped: bool
    samples: int


@dataclass(frozen=True, kw_only=True)
class Failed(Event, kind="failed"):
    """The run failed with `error` ("Type: message") at `step`."""

    error: str
    step: int


@dataclass(frozen=True, kw_only=True)
class DetachedExit(Event, kind="detached_exit"):
    """A detached run's controller exits (`failed`: the run failed)."""

    failed: bool


@dataclass(frozen=True, kw_only=True)
class FinalModelWritten(Event, kind="final_model_written"):
    """The final model's state dict is at `path`."""

    path: str


@dataclass(frozen=True, kw_only=True)
class FinalModelFailed(Event, kind="final_model_failed"):
    """The final model could not be written to `path` (`error`: why: a full disk, say); the
    run's newest checkpoint, if any, holds its weights."""

    path: str
    error: str


# --- requests from the user --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScaleRequested(Event, kind="scale_requested"):
    """`elastic scale`: resize to `num_workers` at the next step boundary."""

    num_workers: int


@dataclass(frozen=True, kw_only=True)
class KillRequested(Event, kind="kill_requested"):
    """`elastic kill`: the worker at `rank` is killed now."""

    rank: int
    worker_id: int


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event, kind="stop_requested"):
    """`elastic stop`, or a callback that raised `elastic.StopRun` (`reason`: which, and
    why): the run stops at the next step boundary."""

    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class DrainRequested(Event, kind="drain_requested"):
    """`elastic drain`: the workers `worker_ids` (the rank asked for, or every worker on the
    node asked for) leave at the next step boundary, within `deadline_s` seconds if given."""

    worker_ids: list[int]
    rank: int | None
    node_id: str | None
    deadline_s: float | None


@dataclass(frozen=True, kw_only=True)
class Chaos(Event, kind="chaos"):
    """A fault of `FitConfig.chaos` is dispatched (the fields of `ChaosEvent`)."""

    step: int
    rank: int
    action: ChaosAction
    phase: ChaosPhase
    factor: float
    steps: int | None


# --- membership and generations ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerStarting(Event, kind="worker_starting"):
    """Workers start in the background, to replace lost ones, to use free capacity, or as hot
    spares (`reason`), until the run has `target` workers and its spares."""

    reason: Literal["replacement", "capacity", "spare"]
    target: int


@dataclass(frozen=True, kw_only=True)
class WorkerStartFailed(Event, kind="worker_start_failed"):
    """A worker failed to start (first line of the error)."""

    error: str


@dataclass(frozen=True, kw_only=True)
class WorkerJoined(Event, kind="worker_joined"):
    """A started worker is admitted; it joins at the next generation."""

    worker_id: int
    pid: int


@dataclass(frozen=True, kw_only=True)
class SpareReady(Event, kind="spare_ready"):
    """A started worker waits as a hot spare (`ScalingConfig.spares`): built, training nothing."""

    worker_id: int
    pid: int


@dataclass(frozen=True, kw_only=True)
class SparePromoted(Event, kind="spare_promoted"):
    """Spares took the places of members lost or gone; they join the generation that forms
    next and take the committed state from a peer."""

    worker_ids: list[int]
    world_size: int


@dataclass(frozen=True, kw_only=True)
class SpareLost(Event, kind="spare_lost"):
    """A spare's process died while it waited (nothing of the run is touched); another one
    starts."""

    worker_id: int


@dataclass(frozen=True, kw_only=True)
class WorkerRetired(Event, kind="worker_retired"):
    """A worker on notice that held no rank (`role`: a 'spare', or a worker 'starting') was
    let go before it trained; another one starts elsewhere."""

    worker_id: int
    source: str
    role: Literal["spare", "starting"]


@dataclass(frozen=True, kw_only=True)
class WorkerRemoved(Event, kind="worker_removed"):
    """A worker is removed to shrink the run."""

    worker_id: int


@dataclass(frozen=True, kw_only=True)
class WorkerLost(Event, kind="worker_lost"):
    """The member at `rank` is dropped (`why`: how it was found lost)."""

    rank: int
    worker_id: int
    why: str


@dataclass(frozen=True, kw_only=True)
class MemberUnreachable(Event, kind="member_unreachable"):
    """A member did not answer a call that needs no collective."""

    worker_id: int


@dataclass(frozen=True, kw_only=True)
class WorkerHung(Event, kind="worker_hung"):
    """The worker at `rank` made no progress in `phase` for `failure.hang_timeout`; killed."""

    rank: int
    phase: str
    worker_id: int


@dataclass(frozen=True, kw_only=True)
class Generation(Event, kind="generation"):
    """A new generation formed: `world_size` workers (`workers`, by rank) took the state of
    `source_rank` at `step`; `reason` says why it formed."""

    generation: int
    world_size: int
    reason: str
    source_rank: int
    step: int
    transport: str
    workers: list[int]
    # Sharded optimizer state: owners per parameter in this generation (fewer than
    # sharding.replicas when the world is smaller: every worker owns every parameter).
    shard_copies: int | None = None


@dataclass(frozen=True, kw_only=True)
class GenerationFailed(Event, kind="generation_failed"):
    """Generation `generation` failed to form on attempt `attempt` (one error per rank)."""

    generation: int
    errors: list[str]
    attempt: int


@dataclass(frozen=True, kw_only=True)
class Resized(Event, kind="resized"):
    """The run now has `world_size` workers, in generation `generation`."""

    world_size: int
    generation: int
    previous_generation: int


@dataclass(frozen=True, kw_only=True)
class BatchPlanned(Event, kind="batch_planned"):
    """Batch policy 'scale_with_workers': the global batch for `world_size` workers and the
    learning-rate ramp towards it."""

    reason: str
    world_size: int
    step: int
    global_batch_size: int
    lr_factor_from: float
    lr_factor_to: float
    warmup_steps: int


# --- failures and recoveries -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PreemptionNotice(Event, kind="preemption_notice"):
    """Members were told to leave (`source`: 'sigterm', 'ray_drain' or 'drain'): they leave at
    the next step boundary (`PlannedDeparture`). `deadline`: wall-clock time by which they must
    be gone (None: the source did not say); `reason`: what the source said."""

    source: str
    ranks: list[int]
    worker_ids: list[int]
    deadline: float | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class HeadDraining(Event, kind="head_draining"):
    """The node of the run's controller (the head node) is draining: the cluster ends with it
    (a Kueue or KubeRay preemption of the head pod). With checkpoints the committed state is
    written at the next step boundary (`checkpoint`: True); the run goes on until then or
    the end. `deadline`: as `PreemptionNotice`'s."""

    deadline: float | None
    checkpoint: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class PlannedDeparture(Event, kind="planned_departure"):
    """Members told to leave left at the step boundary `step`: the others go on with the
    committed state they hold, no collective aborted and no step redone (`steps_redone`: 0).
    `notice_to_gone_s`: from the first notice to their removal."""

    ranks: list[int]
    worker_ids: list[int]
    sources: list[str]
    step: int
    notice_to_gone_s: float
    steps_redone: int


@dataclass(frozen=True, kw_only=True)
class StragglerFound(Event, kind="straggler_found"):
    """The member at `rank` computed at most 1/`factor` of the others' median throughput for
    `window` chunks in a row (`FailureConfig.straggler_factor`): it leaves at the next step
    boundary and a hot spare takes its place."""

    rank: int
    worker_id: int
    samples_per_s: float
    others_median_samples_per_s: float
    factor: float
    window: int


@dataclass(frozen=True, kw_only=True)
class DeadlineMissed(Event, kind="deadline_missed"):
    """A member told to leave was still training at its deadline: it is killed and the run
    recovers as from a failure (nothing committed is lost; the step in flight is redone)."""

    worker_id: int
    deadline: float


@dataclass(frozen=True, kw_only=True)
class WorkerFailure(Event, kind="worker_failure"):
    """Workers were lost at `step` (`planned`: by chaos or `elastic kill`); `reasons` holds
    Ray's reason per lost rank ("" when none)."""

    lost_ranks: list[int]
    step: int
    lost_workers: list[int]
    survivors: int
    planned: bool
    reasons: list[str]


@dataclass(frozen=True, kw_only=True)
class Recovered(Event, kind="recovered"):
    """A recovery's first step completed. Durations in seconds; `detect_s` is None when the
    time of the kill is unknown (only chaos kills and `elastic kill` know it)."""

    lost_ranks: list[int]
    world_before: int
    world_after: int
    step: int
    work_lost_steps: int
    total_s: float
    detect_s: float | None
    abort_s: float
    rebuild_s: float
    restore_s: float
    first_step_s: float


@dataclass(frozen=True, kw_only=True)
class OomBackoff(Event, kind="oom_backoff"):
    """Rank `rank` ran out of memory at `step`: its micro-batch is halved and the step redone
    (`micro_batch_after` None: already 1, the run fails)."""

    step: int
    rank: int
    worker_id: int
    micro_batch_before: int
    micro_batch_after: int | None


@dataclass(frozen=True, kw_only=True)
class UserError(Event, kind="user_error"):
    """User code raised at `step` on `ranks` (`error`: the traceback's last line); the step is
    retried (`attempt`) up to `failure.max_user_retries` times."""

    step: int
    ranks: list[int]
    attempt: int
    error: str


@dataclass(frozen=True, kw_only=True)
class Nonfinite(Event, kind="nonfinite"):
    """The loss or gradients of `step` were NaN or infinite on `ranks`; `policy` is
    `failure.nonfinite`."""

    step: int
    ranks: list[int]
    policy: Literal["stop", "skip"]


# --- adaptation --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MicroBatchTuned(Event, kind="micro_batch_tuned"):
    """The micro-batch tuner chose `micro_batch`; `samples_per_s` per candidate (as a string)."""

    step: int
    reason: str
    micro_batch: int
    samples_per_s: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class RebalanceJudged(Event, kind="rebalance_judged"):
    """The previous re-split, judged: the saving it `delivered` against the prediction, and
    the `threshold` and observation `window` (chunks) for the next one."""

    step: int
    delivered: bool
    predicted_saving_s: float
    realised_saving_s: float
    window: int
    threshold: float


@dataclass(frozen=True, kw_only=True)
class Rebalanced(Event, kind="rebalanced"):
    """Per-rank shares of the global batch re-split by measured speed (`samples_per_s`)."""

    step: int
    shares_before: list[int]
    shares_after: list[int]
    samples_per_s: list[float]
    predicted_before_s: float
    predicted_after_s: float


@dataclass(frozen=True, kw_only=True)
class Evaluate(Event, kind="evaluate"):
    """An evaluation of the committed model at step `step`, `epoch` epochs done: the metrics
    of `TrainJob.eval_step` over the whole evaluation set and of `TrainJob.evaluate`.

    On disk `metrics` are top-level fields beside `step` and `epoch`.
    """

    rest = "metrics"
    step: int
    epoch: int
    metrics: dict[str, float]

    def __post_init__(self) -> None:
        clash = sorted({"time", "event", "step", "epoch"} & set(self.metrics))
        if clash:
            raise ValueError(f"evaluate() returned metric(s) named {', '.join(clash)}, which the "
                             "event record uses itself; rename them")


# --- checkpoints -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _CheckpointLoaded(Event):
    """A checkpoint was loaded: the state of `step` from `path`; `work_lost_steps` steps run
    since then are redone."""

    step: int
    path: str
    work_lost_steps: int


@dataclass(frozen=True, kw_only=True)
class Resumed(_CheckpointLoaded, kind="resumed"):
    """The run resumed from the newest checkpoint at its start: written by run `from_run` at
    world size `world_size_then` (None: a checkpoint of an older version), resumed at
    `world_size_now`; `changes` says what differs (the world size, the math of a step).
    `reached`: the steps that run had committed, where its metrics in this run dir say (a
    resume by name; None: not known, and `work_lost_steps` is 0)."""

    reached: int | None = None
    from_run: str | None = None
    world_size_then: int | None = None
    world_size_now: int | None = None
    changes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ShardsLost(Event, kind="shards_lost"):
    """Sharded optimizer state: every owner of the parameters `parts` (indices among the
    parameters that train) was lost at `step`, so the run restores its newest checkpoint."""

    step: int
    parts: list[int]


@dataclass(frozen=True, kw_only=True)
class RestoredFromCheckpoint(_CheckpointLoaded, kind="restored_from_checkpoint"):
    """No survivor held the run's state; the newest checkpoint was restored instead."""


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten(Event, kind="checkpoint_written"):
    """The checkpoint of `step` is at `path`, written in `seconds`; `pruned`: steps removed;
    `prune_error`: the older step folders retention could not remove (they stay; the
    checkpoint stands)."""

    step: int
    path: str
    seconds: float
    pruned: list[int]
    prune_error: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event, kind="checkpoint_failed"):
    """The checkpoint of `step` failed (first line of the error); the run goes on."""

    step: int
    error: str


@dataclass(frozen=True, kw_only=True)
class CheckpointBusy(Event, kind="checkpoint_busy"):
    """The checkpoint due at `step` was skipped: the previous write is still in flight."""

    step: int
    note: str


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(Event, kind="checkpoint_skipped"):
    """A checkpoint found at restore was not loaded (`reason`: unsigned, corrupt, ...)."""

    path: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class CheckpointConfigChanged(Event, kind="checkpoint_config_changed"):
    """The restored checkpoint was written with another global batch, seed or group size, or
    over a data set of another length (`note` says which)."""

    path: str
    note: str


# --- loggers ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoggerFailed(Event, kind="logger_failed"):
    """Logger `logger` (`csv`, `tensorboard` or `mlflow`, `LoggingConfig`) raised `error` (its
    first line) at `step` (None: opening or closing it); it is off for the rest of the run,
    which goes on. The traceback is in the controller's log."""

    logger: str
    error: str
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class LoggerBehind(Event, kind="logger_behind"):
    """Logger `logger` has `queued` points waiting (its destination answers slowly or not
    at all; `LoggingConfig.queue_points`): the points from `step` on are dropped until it
    catches up. Training goes on; metrics.jsonl has every point."""

    logger: str
    step: int
    queued: int


@dataclass(frozen=True, kw_only=True)
class LoggerDropped(Event, kind="logger_dropped"):
    """Logger `logger` did not get `points` points of the run, at steps `first_step` to
    `last_step` (it fell behind: `logger_behind`); written as the run ends."""

    logger: str
    points: int
    first_step: int
    last_step: int


# --- the codec ---------------------------------------------------------------------------------


def to_record(event: Event, time: float | None = None) -> dict[str, Any]:
    """The JSON dict of `event`: `{"time": ..., "event": kind, **fields}`.

    Args:
        event: the record.
        time: the time to stamp; default `event.time`.

    Raises:
        ValueError: neither `time` nor `event.time` is set.
    """
    time = event.time if time is None else time
    if time is None:
        raise ValueError(f"event {event.kind!r} has no time; pass one")
    if isinstance(event, UnknownEvent):
        return {**event.record, "time": time}
    record: dict[str, Any] = {"time": time, "event": event.kind}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name == "time" or (value is None and f.default is None):
            continue
        if f.name == event.rest:
            record.update(value)
        else:
            record[f.name] = value
    return record


def record_fields(event: Event) -> dict[str, Any]:
    """The fields of `event` as written on disk, without `time` and `event`."""
    return {k: v for k, v in to_record(event, 0.0).items() if k not in ("time", "event")}


def build(kind: str, **values: Any) -> Event:
    """The record of kind `kind` with `values` as its fields (no time yet).

    Raises:
        ValueError: `kind` is not a known kind, or a required field is missing.
        TypeError: a key is not a field of `kind`.
    """
    cls = KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}; the kinds are those of elastic.events.KINDS")
    return cls.from_fields(values)


def parse(record: Mapping[str, Any]) -> Event:
    """The typed record of one JSON dict as written by `to_record`.

    A kind this version does not know gives an `UnknownEvent`; keys a known kind does not
    declare (added by a newer version) are dropped.

    Raises:
        ValueError: `record` has no kind or time, or lacks a field its kind requires.
    """
    kind, time = record.get("event"), record.get("time")
    if not isinstance(kind, str) or not isinstance(time, int | float):
        raise ValueError(f"not an event record (needs 'event' and 'time'): {dict(record)!r:.200}")
    cls = KINDS.get(kind)
    if cls is None:
        return UnknownEvent(time=time, record=dict(record))
    values = {k: v for k, v in record.items() if k not in ("time", "event")}
    return cls.from_fields(values, time=time, strict=False)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads a JSON-lines file written by `elastic.runlog.RunLog`; a last line still being
    written (no newline yet) is left for the next read, and a line a crash tore (a full disk,
    a host that went down mid-write, then more lines after it) is passed over with a warning:
    one torn record must not make the run's whole history unreadable."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """`read_jsonl`, a record at a time (a file of gigabytes is never held whole)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip() or not line.endswith("\n"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                logger.warning("%s: line %d is not a whole record (torn by a crash?); passed "
                               "over", path, number)
                continue
            yield record


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """The events of a run so far, typed.

    Args:
        path: a run directory, or its `events.jsonl`. A missing file reads as no events.

    Raises:
        ValueError: a complete line is not an event record.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "events.jsonl")
    return [parse(record) for record in read_jsonl(path)]
