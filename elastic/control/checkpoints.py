"""The controller's side of checkpoints: when rank 0 writes, what a restore finds, events.

Writes and restores run on a worker, reached through the `Workers` port by worker id.

No Ray here.
"""

from __future__ import annotations

import time
from typing import Any

from elastic.adapt.lr import LrRamp
from elastic.checkpoint.retention import monitor_record
from elastic.config import FitConfig
from elastic.control.port import Workers
from elastic.errors import ConfigError, WorkerLostError
from elastic.events import (
    CheckpointBusy,
    CheckpointConfigChanged,
    CheckpointFailed,
    CheckpointSkipped,
    CheckpointWritten,
    Resumed,
)
from elastic.runlog import RunLog


class CheckpointCoordinator:
    """Decides when rank 0 snapshots the committed state and turns its reports into events.

    Args:
        config: the run's configuration (`config.checkpoint` may be None: then it is off).
        log: the run's event log.
        workers: the port through which a worker writes or restores.
    """

    def __init__(self, config: FitConfig, log: RunLog, workers: Workers) -> None:
        self.config = config
        self.log = log
        self.workers = workers
        self._last_step = 0
        self._last_time = time.monotonic()
        self.group_size = 1  # G with groups on (set once the grouping is decided)
        self.dataset_size: int | None = None  # the data set's length (set once it is known)
        # `ShardedSource.layout` of a data set the controller built (a Ray Dataset's blocks)
        self.data_layout: str | None = None
        self._monitored: tuple[int, float] | None = None  # (step, value) of the last evaluation
        self._written: tuple[int, bool] | None = None  # (step, with a monitored value) submitted
        # Writes submitted and not yet reported, by worker id: their step, and the step of the
        # last write reported on disk (`lost`: a writer lost before it reported).
        self._in_flight: dict[int, int] = {}
        self._durable_step = 0
        self.run_name = ""  # recorded in each checkpoint's manifest (who wrote it)
        self.resumed: dict[str, Any] | None = None  # the checkpoint this run resumed from
        # The learning-rate ramp in force (policy 'scale_with_workers'), recorded in each
        # manifest; and the one the checkpoint last restored recorded, until `replan` takes it.
        self.lr_ramp: LrRamp | None = None
        self.restored_ramp: LrRamp | None = None

    @property
    def enabled(self) -> bool:
        return self.config.checkpoint is not None

    def fingerprint(self) -> str:
        """What must match for a checkpoint's data cursor to mean the same samples, and, with
        groups on, for its BatchNorm statistics and dropout streams to mean the same math."""
        base = f"B={self.config.batch.global_batch_size};seed={self.config.seed}"
        return base if self.group_size == 1 else f"{base};G={self.group_size}"

    def restore(self, worker_id: int, event: str, current_step: int,
                world_size: int | None = None) -> int | None:
        """Loads the newest valid checkpoint into worker `worker_id`'s replica; returns its
        step or None. A resume (`event` 'resumed', at `world_size`) says which run wrote the
        checkpoint, at which world size, and what changed since."""
        info = self.workers.call(worker_id, "restore_checkpoint")
        for path, reason in info["skipped"]:
            self.log.emit(CheckpointSkipped(path=path, reason=reason))
        if info["step"] is None:
            unsigned = info["unsigned"]
            if event == "resumed" and unsigned:
                # Starting over would silently throw away the work those checkpoints hold.
                raise ConfigError(
                    f"checkpoint.path {self.config.checkpoint.path!r} holds {len(unsigned)} "
                    f"checkpoint(s) but none signed with this run's key (newest: "
                    f"{unsigned[0][0]}: {unsigned[0][1]}). Set checkpoint.key_file to the key "
                    "that wrote them, checkpoint.sign=False to load unsigned ones from a trusted "
                    "folder, or point checkpoint.path at a new folder"
                )
            damaged = info.get("damaged") or []
            if event == "resumed" and damaged:
                # Nor on top of checkpoints it could not read (a disk that filled, bit rot):
                # their step folders stay for a repair, and retention would delete them.
                raise ConfigError(
                    f"checkpoint.path {self.config.checkpoint.path!r} holds {len(damaged)} "
                    f"checkpoint(s), none of which loads (newest: {damaged[0][0]}: "
                    f"{damaged[0][1]}); the run does not start over on top of them. Repair "
                    "or remove the damaged step folders, or point checkpoint.path at a new "
                    "folder")
            return None
        if info.get("fingerprint") not in (None, self.fingerprint()):
            self.log.emit(CheckpointConfigChanged(path=info["path"],
                           note=f"global batch, seed or group size differ from the run that "
                                f"wrote it ({info['fingerprint']}; this run: "
                                f"{self.fingerprint()})"))
        data_change = self._data_set_change(info.get("dataset_size"), info.get("data_layout"))
        if data_change is not None:
            self.log.emit(CheckpointConfigChanged(path=info["path"], note=data_change))
        if event == "resumed":
            then, changes = info.get("world_size"), []
            if then is not None and world_size is not None and then != world_size:
                changes.append(f"world size {then} -> {world_size}")
            if info.get("fingerprint") not in (None, self.fingerprint()):
                changes.append(f"{info['fingerprint']} -> {self.fingerprint()} (the math of "
                               "a step: global batch, seed or group size)")
            if data_change is not None:
                changes.append(data_change)
            if info.get("environment_change"):
                changes.append(f"{info['environment_change']} (exact mode: the bits from here "
                               "on are this environment's; checkpoint.allow_environment_change)")
            self.resumed = {"step": info["step"], "run": info.get("run"), "path": info["path"]}
            reached = self._reached(info.get("run"))
            self.log.emit(Resumed(step=info["step"], path=info["path"],
                                  work_lost_steps=max(0, (reached or 0) - info["step"]),
                                  reached=reached, from_run=info.get("run"),
                                  world_size_then=then, world_size_now=world_size,
                                  changes=changes))
        else:
            self.log.event(event, step=info["step"], path=info["path"],
                           work_lost_steps=max(0, current_step - info["step"]))
        self.restored_ramp = LrRamp.from_dict(info.get("lr_ramp"))
        self._last_step = self._durable_step = int(info["step"])
        # Its checkpoint is there: a run that ends (or is stopped) at this step writes none.
        self._written = (self._last_step, False)
        return self._last_step

    def _reached(self, writer: str | None) -> int | None:
        """The steps the run that wrote the checkpoint committed, where this run dir's metrics
        say (it is this run, resumed by name: an earlier run of this name wrote them here)."""
        newest = self.log.newest_step() if writer and writer == self.run_name else None
        return None if newest is None else newest + 1

    def _data_set_change(self, then: int | None, layout: str | None = None) -> str | None:
        """What a checkpoint written over a data set of `then` samples (None: by an older
        version, which did not record it) and shard `layout` means for this run's, if they
        differ: its cursor points into the public order of the old length, or into rows laid
        out in other blocks (a Ray Dataset materialised again into blocks of other sizes)."""
        if then is not None and self.dataset_size is not None and then != self.dataset_size:
            return (f"data set {then} -> {self.dataset_size} samples (the checkpoint's place "
                    "in its epoch is read in the new length's order: until that epoch ends, "
                    "samples may be seen twice or skipped)")
        if layout is not None and self.data_layout is not None and layout != self.data_layout:
            return (f"data set blocks {layout} -> {self.data_layout} (the same samples in "
                    "blocks of other sizes: the checkpoint's place in its epoch names other "
                    "rows; until that epoch ends, samples may be seen twice or skipped)")
        return None

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due at `step` (by `every_steps` since the last one
        written, or by `every_seconds` as of now)."""
        ckpt = self.config.checkpoint
        if ckpt is None or step == self._last_step:
            return False
        if ckpt.every_steps and step - self._last_step >= ckpt.every_steps:
            return True
        return bool(ckpt.every_seconds and time.monotonic() - self._last_time >= ckpt.every_seconds)

    def maybe_write(self, worker_id: int, step: int, world_size: int, final: bool = False) -> None:
        """Asks worker `worker_id` (rank 0) to checkpoint `step` if one is due (always when
        `final`, which also waits for the write to finish; unless this step's checkpoint was
        written already with the same manifest record)."""
        if not self.enabled:
            return
        if final:
            # The final checkpoint must not be skipped because an earlier write is in flight.
            self._log_writes(self.workers.call(worker_id, "flush_checkpoints"))
            if self._current(step):
                return
        if final or self.due(step):
            self._write(worker_id, step, world_size)
        if final:
            self._log_writes(self.workers.call(worker_id, "flush_checkpoints"))

    def flush(self, worker_id: int) -> None:
        """Waits for worker `worker_id`'s checkpoint writes in flight (before it leaves the
        run: its writer thread would die with its process) and logs how they ended."""
        if self.enabled:
            self._log_writes(self.workers.call(worker_id, "flush_checkpoints"))

    def after_evaluation(self, worker_id: int, step: int, world_size: int,
                         metrics: dict[str, Any]) -> None:
        """Right after the evaluation at `step`: with `checkpoint.monitor`, records its value
        and has worker `worker_id` write a checkpoint of `step` that carries it in its manifest
        (unless this run wrote one already; a write in flight is waited for, so that this one
        is not skipped); then any periodic checkpoint that is due.

        Raises:
            ConfigError: the evaluation did not return the monitored metric.
        """
        ckpt = self.config.checkpoint
        if ckpt is None:
            return
        if ckpt.monitor is not None:
            self._monitored = (step, monitored(ckpt.monitor, metrics))
            if not self._current(step):
                self._log_writes(self.workers.call(worker_id, "flush_checkpoints"))
                self._write(worker_id, step, world_size)
        self.maybe_write(worker_id, step, world_size)

    def _write(self, worker_id: int, step: int, world_size: int) -> None:
        meta = {"world_size": world_size, "fingerprint": self.fingerprint(), "run": self.run_name,
                "dataset_size": self.dataset_size,
                **({"data_layout": self.data_layout} if self.data_layout is not None else {}),
                **self._monitor_meta(step),
                **({"lr_ramp": self.lr_ramp.to_dict()} if self.lr_ramp is not None else {})}
        for other in [w for w in self._in_flight if w != worker_id]:
            # Another member's write still runs (its writer was told to leave): one write at
            # a time, as on one worker (retention prunes only what no write in flight needs).
            try:
                self.flush(other)
            except WorkerLostError:
                self.lost([other])
        answer = self.workers.call(worker_id, "checkpoint", meta)
        if answer["submitted"]:
            self._last_step, self._last_time = step, time.monotonic()
            self._written = (step, bool(self._monitor_meta(step)))
            self._in_flight[worker_id] = step
        else:
            self.log.emit(CheckpointBusy(step=step, note=answer.get(
                "note", "previous write still in flight; this one was skipped")))
        self._log_writes(answer["reports"])

    def _current(self, step: int) -> bool:
        """Whether this run submitted a checkpoint of `step` with the manifest record it would
        write now (and its write did not fail)."""
        return self._written == (step, bool(self._monitor_meta(step)))

    def _monitor_meta(self, step: int) -> dict[str, Any]:
        """The manifest's record of the monitored value, for a checkpoint of the evaluated step."""
        ckpt = self.config.checkpoint
        if ckpt is None or ckpt.monitor is None or self._monitored is None \
                or self._monitored[0] != step:
            return {}
        return monitor_record(ckpt.monitor, self._monitored[1], ckpt.mode)

    def lost(self, worker_ids: list[int], waited: bool = True) -> None:
        """Members `worker_ids` were lost. `waited`: while the controller waited for their
        writes (`flush`): a checkpoint one of them was writing is reported failed (the newest
        one that loads says whether it reached the disk just before), the next is due as
        counted from the last reported written, not from it, and a final checkpoint of its
        step is written again, not taken as written. Otherwise (a death found by a chunk) a
        background write's report may only have been unasked for: their writes are
        forgotten, unsaid."""
        for worker_id in worker_ids:
            step = self._in_flight.pop(worker_id, None)
            if step is None or not waited:
                continue
            if self._written is not None and self._written[0] == step:
                self._written = None
            self._last_step = self._durable_step
            self.log.emit(CheckpointFailed(step=step, error=(
                f"worker {worker_id} was lost before it reported its write of step {step} "
                "done; if the write did not finish, the newest checkpoint is the one before")))

    def _log_writes(self, reports: list[dict[str, Any]]) -> None:
        for r in reports:
            self._in_flight = {w: s for w, s in self._in_flight.items() if s != r["step"]}
            if r["error"]:
                if self._written is not None and self._written[0] == r["step"]:
                    self._written = None
                self.log.emit(CheckpointFailed(step=r["step"], error=r["error"]))
            else:
                self._durable_step = max(self._durable_step, r["step"])
                self.log.emit(CheckpointWritten(step=r["step"], path=r["path"],
                               seconds=r["seconds"], pruned=list(r["pruned"]),
                               prune_error=r.get("prune_error")))


def monitored(name: str, metrics: dict[str, Any]) -> float:
    """The value of the monitored metric `name` in an evaluation's `metrics`.

    Raises:
        ConfigError: the evaluation did not return it.
    """
    if name not in metrics:
        returned = ", ".join(sorted(metrics)) or "no metrics"
        raise ConfigError(f"checkpoint.monitor is {name!r}, but the evaluation returned "
                          f"{returned}; set checkpoint.monitor to one of them")
    return float(metrics[name])
