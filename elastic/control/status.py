"""A run's status: what `elastic.status` shows and what the run index records.

The controller builds a `RunStatus` from its state; callers and the index see its record,
`RunStatus.to_dict()`, a plain dict of JSON values whose keys are the field names in order.
The index's files keep that shape, so records written by earlier versions read the same.

No Ray here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

StateName = Literal["starting", "running", "recovering", "resizing", "finishing", "finished",
                    "stopped", "failed"]
"""A live controller's state as `status` shows it: a `RunState` value, "stopped" for a run
that finished early on request, "finishing" until everything a run leaves behind is written
(the index adds "lost", `elastic.registry.LOST`)."""


@dataclass(frozen=True)
class RankedWorker:
    """A worker of the generation that trains: its rank, id (never reused in a run), process
    id and Ray node."""

    rank: int
    worker_id: int
    pid: int
    node_id: str


@dataclass(frozen=True)
class SpareWorker:
    """A hot spare (`ScalingConfig.spares`): started, training nothing, no rank."""

    worker_id: int
    pid: int
    node_id: str


@dataclass(frozen=True)
class RunStatus:
    """A snapshot of a run, as its controller sees it.

    Attributes:
        name: the run's name.
        state: where the run stands (`StateName`).
        step: steps committed.
        total_steps: the step at which the run ends, at the global batch in force.
        generation: the generation that trains (-1 before the first).
        world_size: its number of ranks.
        target_workers: the world size the run aims for (`scale` sets it).
        global_batch_size: the global batch in force (the configured one before the start).
        shares: each rank's samples of a step (None before the first plan).
        micro_batches: each rank's micro-batch size (None before the first plan).
        starting_workers: workers started and not yet up.
        joining_workers: workers up and admitted, in no generation yet (no rank).
        failures: workers lost so far.
        workers: the ranks that train, in order (none once the run is abandoned).
        run_dir: the run's directory (events, metrics, final model).
        started_at: when the controller started (seconds since the epoch).
        ended_at: when the run ended (None while it is live).
        last_loss: the loss of the last recorded step (None before the first).
        detached: the run was started with `elastic.start`.
        error_type: the class name of the error a failed run ended with.
        error_message: that error's message.
        host: the controller's host.
        pid: the controller's process id.
        control: the name of the controller's control channel (None where there is none).
        updated_at: when this snapshot was taken.
        preemptions: workers let go on notice so far (at a step boundary, or dead before
            one), counted apart from `failures`.
        spare_workers: hot spares ready (`ScalingConfig.spares`), in no generation.
        spares: those spares.
        resumed_from: the checkpoint the run resumed from at its start ({"step", "run",
            "path"}; None: it started fresh).
        cluster: the address of the Ray cluster the controller runs on (its GCS), by which
            another host tells a run that is lost from one live on a cluster it cannot see.
    """

    name: str
    state: StateName
    step: int
    total_steps: int
    generation: int
    world_size: int
    target_workers: int
    global_batch_size: int
    shares: tuple[int, ...] | None
    micro_batches: tuple[int, ...] | None
    starting_workers: int
    joining_workers: int
    failures: int
    workers: tuple[RankedWorker, ...]
    run_dir: str
    started_at: float
    ended_at: float | None
    last_loss: float | None
    detached: bool
    error_type: str | None
    error_message: str | None
    host: str
    pid: int
    control: str | None
    updated_at: float
    preemptions: int = 0
    spare_workers: int = 0
    spares: tuple[SpareWorker, ...] = ()
    resumed_from: dict[str, Any] | None = None
    cluster: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record: a plain dict whose sequences are lists, as `elastic.status` returns it
        and the run index stores it."""
        record = asdict(self)
        for key in ("shares", "micro_batches", "workers", "spares"):
            if record[key] is not None:
                record[key] = list(record[key])
        return record
