"""The controller: one Ray actor per run that drives the workers through steps and failures.

It hosts the rendezvous store, hands out chunks of steps, detects lost workers (Ray reports
a dead actor to a waiting caller within milliseconds), aborts the survivors' communicators,
forms a new generation from them without restarting their processes, brings every rank to
the newest committed step from a peer, re-plans the batch and goes on. Replacements start in
the background and join at a chunk boundary. Control requests (scale, kill, stop) from other
processes are served on other threads of this actor and take effect at the next boundary.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.experimental import internal_kv

from elastic.actors.checkpointing import CheckpointCoordinator
from elastic.actors.state import RunState
from elastic.actors.worker import ChunkResult, WorkerActor
from elastic.adapt.balance import Rebalancer, ThroughputTracker
from elastic.adapt.lr import LrRamp, global_batch_for, resize
from elastic.adapt.plan import BatchPlan, plan_batch
from elastic.adapt.tuning import MicroBatchTuner, back_off, candidates
from elastic.checkpoint.store import check_root, serialize
from elastic.collective import RendezvousServer
from elastic.config import ChaosEvent, FitConfig
from elastic.control import ControlServer
from elastic.errors import (
    CollectiveError,
    ConfigError,
    ControllerError,
    ElasticError,
    InsufficientWorkersError,
    NonFiniteLossError,
    StartupTimeoutError,
    UserCodeError,
    WorkerLostError,
    WorkerOutOfMemoryError,
)
from elastic.job import TrainJob
from elastic.private import write_private
from elastic.recovery import PendingRecovery
from elastic.registry import RunRegistry, is_terminal, this_host
from elastic.runlog import RunLog
from elastic.trainer.data import Cursor

logger = logging.getLogger(__name__)
T = TypeVar("T")
_NODE_CHECK_S = 0.5  # while a generation forms, how often members' nodes are checked

NAMESPACE = "elastic"
FINAL_MODEL = "final_model.pt"


def controller_name(run_name: str) -> str:
    """The Ray actor name under which a run's controller is registered."""
    return f"elastic-run-{run_name}"


@dataclass
class _Member:
    actor: Any
    worker_id: int
    pid: int
    node_id: str


@dataclass
class Outcome:
    """What `Controller.run` returns (an error is returned, not raised, to keep its type)."""

    model_state: dict[str, Any] | None
    steps: int
    samples: int
    events: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    evaluation: dict[str, float]
    stopped: bool
    error: BaseException | None


class _Failed(Exception):
    """Internal: ends the control loop with a typed error."""

    def __init__(self, error: ElasticError) -> None:
        super().__init__(str(error))
        self.error = error


class Controller:
    """Drives one run. Created by `elastic.fit` as a named Ray actor."""

    def __init__(self, job: TrainJob, config: FitConfig, name: str, run_dir: str,
                 detached: bool = False, home: str | None = None,
                 checkpoint_key: bytes | None = None) -> None:
        self.job = job
        self.config = config
        self.name = name
        self.log = RunLog(run_dir)
        self.run_dir = run_dir
        self.state = RunState.STARTING
        self.members: list[_Member] = []
        self.pending: dict[Any, Any] = {}  # info() ref -> actor, replacements starting
        self.generation = -1
        self.cursor = Cursor()
        self.total_steps = 0
        self.dataset_size = 0
        # Batch policy state: the global batch in force, the learning-rate ramp (policy
        # 'scale_with_workers'), per-worker throughput and the decisions taken on it.
        self.batch_now = config.batch.global_batch_size
        self.lr_ramp: LrRamp | None = None
        self.tracker = ThroughputTracker()
        self.rebalancer = Rebalancer(config.batch.rebalance_threshold)
        self.weights: dict[int, float] = {}  # worker id -> rate of the last rebalance
        self.micro_caps: dict[int, int] = {}  # worker id -> cap after out-of-memory errors
        self.tuned_micro: int | None = None
        self.tuner: MicroBatchTuner | None = None
        self.plan: BatchPlan | None = None
        self.failures = 0
        self.user_retries: dict[int, int] = {}
        self.chaos = sorted(config.chaos, key=lambda e: e.step)
        self._next_worker_id = 0
        self._lock = threading.Lock()
        self._target = config.scaling.num_workers
        self._scaled_by_user = False
        self._stop_requested = False
        self._stopped_early = False  # the loop ended on a stop request, before its last step
        self._recovery: PendingRecovery | None = None
        self._killed_at: float | None = None  # time of the last kill() request
        self._killed_on_purpose: set[int] = set()  # worker ids killed by kill()
        self._death_reasons: dict[int, str] = {}  # rank -> Ray's reason, for the next recovery
        self.checkpoints = CheckpointCoordinator(config, self.log)
        self._checkpoint_key = checkpoint_key  # signs manifests; only ever sent in Ray calls
        self._evaluation: dict[str, float] = {}
        self.server = RendezvousServer(host=ray.util.get_node_ip_address())
        self._restarted = detached and ray.get_runtime_context().was_current_actor_reconstructed
        # The run's record in the index (found by name, live or ended) and its fast control
        # channel; `home` is the starting process's ELASTIC_HOME, if it set one.
        self.detached = detached
        self.started_at = time.time()
        self.ended_at: float | None = None
        self._ended = False  # run() has written everything the run leaves behind
        self.error: BaseException | None = None
        self.registry = RunRegistry(home)
        self.control = ControlServer(self._on_control)
        self._publish()
        if detached:
            # A detached run drives itself: it must not depend on the process that started it
            # (that process may exit at once), so the loop starts here, not from a caller.
            threading.Thread(target=self._run_detached, name="elastic-detached-run",
                             daemon=True).start()

    # --- detached runs -------------------------------------------------------------------------

    def _run_detached(self) -> None:
        self.run()
        # The record of the run stays in run_dir and the index; the named actor goes away.
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _write_final_model(self, model_state: dict[str, Any]) -> None:
        path = os.path.join(self.run_dir, FINAL_MODEL)
        write_private(path, serialize(model_state))
        self.log.event("final_model_written", path=path)

    @property
    def global_step(self) -> int:
        return self.cursor.step

    def events(self) -> list[dict[str, Any]]:
        """Every event so far (for `elastic logs`)."""
        return list(self.log.events)

    # --- control requests (other threads) ---------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A snapshot of the run for `elastic status`: the fields of its record in the index.

        The state reads "finishing" from the moment training ended until the end is complete
        (workers shut down, the final model and the last events written): a caller that sees
        "finished", "stopped" or "failed" may read everything the run leaves behind."""
        last_loss = self.log.metrics[-1].get("loss") if self.log.metrics else None
        error = self.error
        with self._lock:
            state = self.state.value
            if self.state == RunState.FINISHED and self._stopped_early:
                state = "stopped"
            if self.state.is_terminal and not self._ended:
                state = "finishing"
            return {
                "name": self.name, "state": state, "step": self.global_step,
                "total_steps": self.total_steps, "generation": self.generation,
                "world_size": len(self.members), "target_workers": self._target,
                "global_batch_size": self.batch_now,
                "shares": list(self.plan.shares) if self.plan else None,
                "micro_batches": list(self.plan.micro_batches) if self.plan else None,
                "starting_workers": len(self.pending), "failures": self.failures,
                "workers": [{"rank": r, "worker_id": m.worker_id, "pid": m.pid, "node_id": m.node_id}
                            for r, m in enumerate(self.members)],
                "run_dir": self.run_dir, "started_at": self.started_at, "ended_at": self.ended_at,
                "last_loss": last_loss, "detached": self.detached,
                "error_type": type(error).__name__ if error is not None else None,
                "error_message": str(error) if error is not None else None,
                "host": this_host(), "pid": os.getpid(), "control": self.control.address,
                "updated_at": time.time(),
            }

    def _on_control(self, method: str, args: list[Any]) -> Any:
        """A request on the fast control channel (`elastic.control`): the same methods."""
        return getattr(self, method)(*args)

    def _publish(self) -> None:
        """Writes the run's record to the index; a failure to write never fails the run."""
        record = self.status()
        try:
            self.registry.write(record)
        except OSError as e:
            logger.warning("cannot write the record of run %s to %s: %s", self.name,
                           self.registry.directory, e)
        if is_terminal(record):
            _cache_record(record)

    def scale(self, num_workers: int) -> None:
        """Sets the target world size; applied at the next chunk boundary.

        Raises:
            ConfigError: outside [min_workers, max_workers].
        """
        low, high = self.config.scaling.lower, self.config.scaling.upper
        if not low <= num_workers <= high:
            raise ConfigError(
                f"cannot scale run {self.name!r} to {num_workers} workers: it must stay within "
                f"[min_workers, max_workers] = [{low}, {high}]"
            )
        with self._lock:
            self._target = num_workers
            self._scaled_by_user = True
        self.log.event("scale_requested", num_workers=num_workers)

    def kill(self, rank: int) -> None:
        """Kills the worker at `rank` now, as a failure would (for drills and tests).

        Raises:
            ConfigError: no such rank.
        """
        with self._lock:
            if not 0 <= rank < len(self.members):
                raise ConfigError(f"run {self.name!r} has no rank {rank} (world size {len(self.members)})")
            member = self.members[rank]
        self.log.event("kill_requested", rank=rank, worker_id=member.worker_id)
        with self._lock:
            self._killed_at = time.time()
            self._killed_on_purpose.add(member.worker_id)
        ray.kill(member.actor, no_restart=True)

    def stop(self) -> None:
        """Ends the run gracefully at the next chunk boundary (nothing once it has ended)."""
        with self._lock:
            if self.state.is_terminal:
                return
            self._stop_requested = True
        self.log.event("stop_requested")

    # --- the control loop ----------------------------------------------------------------------

    def _set_state(self, state: RunState, **fields: Any) -> None:
        with self._lock:
            previous, self.state = self.state, state
            if state.is_terminal:
                self.ended_at = time.time()
        self.log.event("state", previous=previous.value, state=state.value, **fields)
        if not state.is_terminal:  # the end is published last, by `run`
            self._publish()

    def run(self) -> Outcome:
        """Runs the whole training; returns when finished, stopped or failed."""
        error: BaseException | None = None
        model_state = None
        try:
            self._start()
            while self.global_step < self.total_steps:
                if self._boundary():
                    break
                self._chunk()
            model_state = self._finish()
        except _Failed as failed:
            error = failed.error
        except ElasticError as e:
            error = e
        except Exception as e:  # a bug of ours: keep the cause
            logger.exception("controller failed")
            error = ControllerError(f"controller failed: {type(e).__name__}: {e}")
            error.__cause__ = e
        if error is not None:
            self.log.event("failed", error=f"{type(error).__name__}: {error}", step=self.global_step)
            self.error = error
            self._set_state(RunState.FAILED)
        try:
            self._shutdown_workers()
            self.server.close()
            if self.detached:
                if model_state is not None:
                    self._write_final_model(model_state)
                self.log.event("detached_exit", failed=error is not None)
        finally:
            # The end is published once everything it points to is written, and before the
            # channel closes: a caller that finds nobody answering reads the record again.
            with self._lock:
                self._ended = True
            self._publish()
            self.control.close()
            self.log.close()  # a later event (a status call's) opens the file again
        return Outcome(
            model_state=model_state, steps=self.global_step,
            samples=self.cursor.samples,
            events=list(self.log.events), metrics=list(self.log.metrics),
            evaluation=self._evaluation, stopped=self._stopped_early, error=error,
        )

    # --- start-up ------------------------------------------------------------------------------

    def _spawn(self) -> tuple[Any, Any]:
        worker_id = self._next_worker_id
        self._next_worker_id += 1
        scaling = self.config.scaling
        actor = WorkerActor.options(
            num_cpus=scaling.cpus_per_worker, num_gpus=1 if scaling.use_gpu else 0,
            max_concurrency=4,
        ).remote(self.job, self.config, self.run_dir, worker_id, self._checkpoint_key)
        return actor.info.remote(), actor

    def _start(self) -> None:
        if self._restarted:
            self.log.event("controller_restarted", name=self.name)
            if not self.checkpoints.enabled:
                raise _Failed(ControllerError(
                    f"the controller of run {self.name!r} died and was restarted, but the run "
                    "has no checkpoints to resume from; set checkpoint.path so that a restarted "
                    "controller can resume"
                ))
        self.log.event("start", name=self.name, config=self.config.model_dump(mode="json"))
        if self.config.checkpoint is not None:
            check_root(self.config.checkpoint.path)
        spawned = dict(self._spawn() for _ in range(self.config.scaling.num_workers))
        timeout = self.config.failure.startup_timeout.total_seconds()
        # Do not wait for workers the cluster cannot place at all; they stay pending and join
        # when capacity appears.
        wanted = max(min(len(spawned), self._placeable()), self.config.scaling.lower)
        ready, _ = ray.wait(list(spawned), num_returns=min(wanted, len(spawned)), timeout=timeout)
        for ref in ready:
            try:
                info = ray.get(ref)
            except RayTaskError as e:
                raise _Failed(_user_start_error(e)) from e
            except RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    raise _Failed(_init_error(e)) from e
                raise
            self.members.append(_Member(spawned[ref], info["worker_id"], info["pid"], info["node_id"]))
        for ref in set(spawned) - set(ready):
            self.pending[ref] = spawned[ref]
        self.members.sort(key=lambda m: m.worker_id)
        if len(self.members) < self.config.scaling.lower:
            raise _Failed(StartupTimeoutError(
                f"only {len(self.members)} of {self.config.scaling.num_workers} workers started "
                f"within {self.config.failure.startup_timeout}; need at least "
                f"{self.config.scaling.lower}. Raise failure.startup_timeout or add capacity"
            ))
        self.dataset_size = self._on_any_member(lambda a: ray.get(a.dataset_size.remote()))
        batch = self.config.batch
        largest = global_batch_for(batch.policy, batch.global_batch_size,
                                   self.config.scaling.num_workers, self.config.scaling.upper)
        if largest > self.dataset_size:
            raise _Failed(ConfigError(
                f"at scaling.max_workers = {self.config.scaling.upper} the global batch would be "
                f"{largest}, more than the {self.dataset_size} samples of the data set; lower "
                "batch.global_batch_size or scaling.max_workers"
            ))
        self.batch_now = global_batch_for(batch.policy, batch.global_batch_size,
                                          self.config.scaling.num_workers, len(self.members))
        self.total_steps = self._total_steps()
        self.log.event("planned", dataset_size=self.dataset_size,
                       steps_per_epoch=self.dataset_size // self.batch_now,
                       total_steps=self.total_steps)
        if self.checkpoints.enabled:
            self.checkpoints.restore(self.members[0].actor, "resumed", self.global_step)
        self._form("start")
        self._set_state(RunState.RUNNING)

    # --- generations ---------------------------------------------------------------------------

    def _form(self, reason: str) -> tuple[float, float]:
        """Forms a new generation of `self.members` and syncs state from the newest rank.
        Returns the times at which the ring was rebuilt and the state restored."""
        attempts = 0
        while True:
            self.generation += 1
            n = len(self.members)
            endpoint = str(self.server.endpoint)
            refs = [m.actor.connect.remote(r, n, endpoint, self.generation, self.server.secret)
                    for r, m in enumerate(self.members)]
            joined, dead, broken = self._gather(refs)
            self.server.forget(self.generation)
            if dead:
                self._drop(dead, "lost while connecting")
                continue
            if broken:
                attempts = self._retry_generation(attempts, broken)
                continue
            rebuilt = time.time()
            steps = [step for step, _ in joined]
            transport = joined[0][1]  # every rank agrees (a shared-memory offer is all or none)
            # The newest committed step wins (ranks may differ by one step after a failure);
            # joiners and laggards take it from that rank.
            src = max(range(n), key=lambda r: (steps[r], -r))
            if steps[src] < self.global_step:
                # No survivor holds the state: the newest checkpoint is the source of truth.
                # Continuing from fresh replicas would silently restart training.
                restored = (self.checkpoints.restore(self.members[0].actor,
                                                     "restored_from_checkpoint", self.global_step)
                            if self.checkpoints.enabled else None)
                if restored is None:
                    raise _Failed(WorkerLostError(
                        f"every worker holding the state of step {self.global_step} was lost and "
                        "no checkpoint is available to restore from; the run cannot continue",
                        step=self.global_step,
                    ))
                steps[0], src = restored, 0
            cursors, dead, broken = self._gather([m.actor.sync.remote(src) for m in self.members])
            if dead:
                self._drop(dead, "lost while restoring")
                continue
            if broken:
                attempts = self._retry_generation(attempts, broken)
                continue
            self.cursor = Cursor(**cursors[src])
            restored = time.time()
            self.log.event("generation", generation=self.generation, world_size=n, reason=reason,
                           source_rank=src, step=self.global_step, transport=transport,
                           workers=[m.worker_id for m in self.members])
            self._replan(reason)
            return rebuilt, restored

    def _replan(self, reason: str) -> None:
        """After a new generation: the global batch and learning-rate ramp for its size (policy
        'scale_with_workers'), the step count that follows, and a new micro-batch tuning."""
        batch = self.config.batch
        n = len(self.members)
        if batch.policy != "fixed":
            decision = resize(batch.policy, batch.lr_scaling, batch.warmup_steps,
                              batch.global_batch_size, self.config.scaling.num_workers, n,
                              self.global_step, self.lr_ramp)
            if decision.global_batch_size != self.batch_now or self.lr_ramp is None \
                    or decision.ramp.to_factor != self.lr_ramp.to_factor:
                self.log.event("batch_planned", reason=reason, world_size=n, step=self.global_step,
                               global_batch_size=decision.global_batch_size,
                               lr_factor_from=decision.ramp.from_factor,
                               lr_factor_to=decision.ramp.to_factor,
                               warmup_steps=decision.ramp.warmup_steps)
            self.batch_now = decision.global_batch_size
            self.lr_ramp = decision.ramp
        self.total_steps = self._total_steps()
        self.rebalancer.membership_changed()
        self.tuner = None
        if batch.autotune:
            largest = max(plan_batch(self.batch_now, n, batch.max_micro_batch,
                                     self._weights()).shares)
            options = candidates(largest, batch.max_micro_batch, batch.autotune_candidates)
            if len(options) > 1:
                self.tuner = MicroBatchTuner(options, batch.autotune_steps, reason)
                self.tuned_micro = None

    def _total_steps(self) -> int:
        """The step at which the run ends, at the global batch now in force."""
        limits = [self.config.max_steps] if self.config.max_steps else []
        if self.config.epochs:
            n, b, cursor = self.dataset_size, self.batch_now, self.cursor
            done = cursor.epochs_done(n, b)
            if done >= self.config.epochs:
                limits.append(cursor.step)
            else:
                limits.append(cursor.step + cursor.steps_left_in_epoch(n, b)
                              + (self.config.epochs - done - 1) * (n // b))
        return min(limits)

    def _weights(self) -> list[float] | None:
        """Relative throughput of the members (for shares), or None for an even split."""
        if not self.config.batch.rebalance or not self.weights:
            return None
        known = [self.weights[m.worker_id] for m in self.members if m.worker_id in self.weights]
        if not known:
            return None
        fill = sorted(known)[len(known) // 2]  # a newcomer counts as a typical worker
        return [self.weights.get(m.worker_id, fill) for m in self.members]

    def _make_plan(self, trial: int | None) -> BatchPlan:
        """The plan of the next chunk: shares from the measured rates, micro-batches capped by
        the tuner's trial (or its decision) and each worker's out-of-memory cap."""
        common = trial if trial is not None else self.tuned_micro
        caps = []
        for m in self.members:
            limits = [c for c in (common, self.micro_caps.get(m.worker_id)) if c is not None]
            caps.append(min(limits) if limits else None)
        return plan_batch(self.batch_now, len(self.members), self.config.batch.max_micro_batch,
                          self._weights(), caps)

    def _on_any_member(self, call: Callable[[Any], T]) -> T:
        """`call(actor)` on the first live member. After a completed chunk or a new generation
        every member holds the committed state, so any will do; a dead one is skipped here and
        found by the next chunk, which recovers as usual."""
        for member in list(self.members):
            try:
                return call(member.actor)
            except RayActorError:
                self.log.event("member_unreachable", worker_id=member.worker_id)
        raise _Failed(WorkerLostError("every worker was lost", step=self.global_step))

    def _gather(self, refs: list[Any]) -> tuple[list[Any], list[int], list[str]]:
        """Waits for one ref per member, in completion order. Returns the values, the ranks
        whose actor died, and the collective errors of live ranks. At the first death or error
        every other member is aborted, so that nobody waits out a rendezvous or broadcast
        timeout for a peer that will never come (a lost node's workers, say)."""
        values: list[Any] = [None] * len(refs)
        dead: list[int] = []
        broken: list[str] = []
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        aborted = False
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_NODE_CHECK_S)
            if not ready:
                # A worker process can outlive its node's raylet for a while and keep answering;
                # the node's death in Ray's membership is what counts.
                gone = self._on_dead_nodes([index[ref] for ref in pending])
                if not gone:
                    continue
                for rank in gone:
                    dead.append(rank)
                    ray.kill(self.members[rank].actor, no_restart=True)
                pending = [ref for ref in pending if index[ref] not in gone]
                rank = gone[0]
            else:
                rank = index[ready[0]]
                try:
                    values[rank] = ray.get(ready[0])
                    continue
                except RayActorError:
                    dead.append(rank)
                except RayTaskError as e:
                    if not isinstance(e.cause, CollectiveError):
                        raise
                    broken.append(f"rank {rank}: {str(e.cause).splitlines()[0]}")
            if not aborted:
                aborted = True
                for r, m in enumerate(self.members):
                    if r != rank:
                        m.actor.abort.remote()
        return values, dead, broken

    def _on_dead_nodes(self, ranks: list[int]) -> list[int]:
        """The ranks among `ranks` whose node Ray's membership reports dead."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return [r for r in ranks if self.members[r].node_id not in alive]

    def _retry_generation(self, attempts: int, broken: list[str]) -> int:
        """A generation failed to form although no member is known dead: try again (a few
        times), then fail with the errors."""
        attempts += 1
        self.log.event("generation_failed", generation=self.generation, errors=broken,
                       attempt=attempts)
        if attempts > 3:
            raise _Failed(WorkerLostError(
                f"generation {self.generation} could not form after {attempts} attempts: "
                f"{broken[0]}", step=self.global_step,
            ))
        return attempts

    def _drop(self, ranks: list[int], why: str) -> None:
        for rank in sorted(ranks, reverse=True):
            member = self.members.pop(rank)
            self.log.event("worker_lost", rank=rank, worker_id=member.worker_id, why=why)
            ray.kill(member.actor, no_restart=True)
            self.failures += 1
        if not self.config.failure.replace_lost_workers:
            with self._lock:
                # The survivors are the new target; growth waits for a scale request.
                self._target = max(self.config.scaling.lower, len(self.members) + len(self.pending))
                self._scaled_by_user = True
        self._check_capacity()

    def _check_capacity(self) -> None:
        """Waits for replacements while below min_workers; fails after capacity_timeout."""
        limit = self.config.failure.max_failures
        if limit is not None and self.failures > limit:
            raise _Failed(WorkerLostError(
                f"{self.failures} workers lost, more than failure.max_failures = {limit}"
            ))
        self._top_up()
        deadline = time.monotonic() + self.config.failure.capacity_timeout.total_seconds()
        while len(self.members) < self.config.scaling.lower:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.pending:
                self._save_before_failing()
                raise _Failed(InsufficientWorkersError(
                    f"{len(self.members)} workers alive, fewer than scaling.min_workers = "
                    f"{self.config.scaling.lower}, for {self.config.failure.capacity_timeout}; "
                    "add capacity or lower scaling.min_workers"
                ))
            self._admit(timeout=min(remaining, 1.0))

    def _save_before_failing(self) -> None:
        """A final checkpoint from a surviving worker (its committed state), so that a new run
        on the same checkpoint path resumes where this one stopped."""
        if not self.checkpoints.enabled:
            return
        for member in self.members:
            try:
                self.checkpoints.maybe_write(member.actor, self.global_step, len(self.members),
                                             final=True)
                return
            except (RayActorError, RayTaskError) as e:
                self.log.event("checkpoint_failed", step=self.global_step, error=str(e).splitlines()[0])

    def _top_up(self) -> None:
        """Starts workers in the background until members + starting reach the target; then,
        unless the user set the size with `scale`, uses free cluster capacity up to
        max_workers (a node that joins is used at the next boundary)."""
        with self._lock:
            target = self._target
            grow = not self._scaled_by_user
        while len(self.members) + len(self.pending) < target:
            ref, actor = self._spawn()
            self.pending[ref] = actor
            self.log.event("worker_starting", reason="replacement", target=target)
        while grow and len(self.members) + len(self.pending) < self.config.scaling.upper \
                and self._free_slot():
            ref, actor = self._spawn()
            self.pending[ref] = actor
            with self._lock:
                self._target = max(self._target, len(self.members) + len(self.pending))
            self.log.event("worker_starting", reason="capacity", target=self._target)

    def _placeable(self) -> int:
        """How many workers the whole cluster could host, by its total resources."""
        total = ray.cluster_resources()
        scaling = self.config.scaling
        count = int(total.get("CPU", 0.0) // scaling.cpus_per_worker)
        if scaling.use_gpu:
            count = min(count, int(total.get("GPU", 0.0)))
        return count

    def _free_slot(self) -> bool:
        """True if the cluster has the resources for one more worker right now."""
        free = ray.available_resources()
        scaling = self.config.scaling
        if free.get("CPU", 0.0) < scaling.cpus_per_worker:
            return False
        return not scaling.use_gpu or free.get("GPU", 0.0) >= 1

    def _admit(self, timeout: float) -> bool:
        """Moves started replacements into `members` (not yet into a generation)."""
        if not self.pending:
            return False
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout)
        admitted = False
        for ref in ready:
            actor = self.pending.pop(ref)
            try:
                info = ray.get(ref)
            except (RayActorError, RayTaskError) as e:
                self.log.event("worker_start_failed", error=str(e).splitlines()[0])
                continue
            self.members.append(_Member(actor, info["worker_id"], info["pid"], info["node_id"]))
            self.log.event("worker_joined", worker_id=info["worker_id"], pid=info["pid"])
            admitted = True
        return admitted

    # --- boundaries ----------------------------------------------------------------------------

    def _boundary(self) -> bool:
        """Applies control requests at a step boundary. Returns True to stop the run."""
        with self._lock:
            stop, target = self._stop_requested, self._target
        if stop:
            self._stopped_early = True
            self.log.event("stopping", step=self.global_step)
            return True
        changed = False
        if len(self.members) > target:
            self._set_state(RunState.RESIZING, world_size=len(self.members), target=target)
            while len(self.members) > target:
                member = self.members.pop()
                self.log.event("worker_removed", worker_id=member.worker_id)
                ray.kill(member.actor, no_restart=True)
            changed = True
        self._top_up()
        if self._admit(timeout=0):
            if self.state != RunState.RESIZING:
                self._set_state(RunState.RESIZING, world_size=len(self.members), target=target)
            changed = True
        if changed:
            before = self.generation
            self._form("resize")
            self.log.event("resized", world_size=len(self.members), generation=self.generation,
                           previous_generation=before)
            self._set_state(RunState.RUNNING)
        return False

    # --- chunks --------------------------------------------------------------------------------

    def _chunk(self) -> None:
        step = self.global_step
        trial = self.tuner.next_trial() if self.tuner is not None else None
        plan = self.plan = self._make_plan(trial)
        num = min(self.config.steps_per_chunk, self.total_steps - step,
                  self.cursor.steps_left_in_epoch(self.dataset_size, self.batch_now))
        if trial is not None:
            num = min(num, self.tuner.steps_left(trial))
        # A chunk starts at a chaos event's step, so that dispatching it is firing it.
        every = self.config.checkpoint.every_steps if self.config.checkpoint else None
        if every:
            num = min(num, every - step % every)
        later = [e.step for e in self.chaos if e.step > step]
        if later:
            num = min(num, later[0] - step)
        chaos = [e for e in self.chaos if e.step == step]
        self.chaos = [e for e in self.chaos if e.step != step]
        for event in chaos:
            self.log.event("chaos", **event.model_dump())
        refs = {m.actor.run_chunk.remote(plan, num, chaos, self.lr_ramp): r
                for r, m in enumerate(self.members)}
        results, lost, detected = self._wait_chunk(refs)
        self._record(results)
        if lost:
            self._recover(lost, results, detected, chaos)
            return
        statuses = {r.status for r in results.values()}
        if statuses == {"ok"}:
            self.cursor = Cursor(**max((r.cursor for r in results.values()),
                                       key=lambda c: c["step"]))
            self._adapt(trial, results)
            epoch_over = self.cursor.start(self.dataset_size, self.batch_now)[0] > self.cursor.epoch
            if epoch_over or self.global_step == self.total_steps:
                self._evaluate()
            self._on_any_member(lambda a: self.checkpoints.maybe_write(a, self.global_step,
                                                                       len(self.members)))
            return
        if "user_error" in statuses:
            self._user_error(results)
            return
        if "oom" in statuses:
            self._out_of_memory(plan, results)
            return
        if "nonfinite" in statuses:
            failure = next(r.failure for r in results.values() if r.failure is not None)
            self.cursor = Cursor(**next(iter(results.values())).cursor)
            self.log.event("nonfinite", step=failure.step, ranks=list(failure.ranks), policy="stop")
            raise _Failed(NonFiniteLossError(
                f"the loss or gradients of step {failure.step} are NaN or infinite on ranks "
                f"{list(failure.ranks)}; the update was not applied (failure.nonfinite='skip' "
                "drops such steps instead)", rank=failure.ranks[0], step=failure.step,
            ))
        # A collective error without a lost worker (a timeout): rebuild as after a failure.
        self._recover([], results, time.time(), chaos)

    def _wait_chunk(self, refs: dict[Any, int]) -> tuple[dict[int, ChunkResult], list[int], float]:
        results: dict[int, ChunkResult] = {}
        lost: list[int] = []
        detected = 0.0
        remaining = list(refs)
        hang = self.config.failure.hang_timeout.total_seconds()
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=hang)
            if not ready:
                self._kill_hung([refs[r] for r in remaining])
                continue
            rank = refs[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:
                self._death_reasons[rank] = _death_reason(e)
                lost.append(rank)
                if len(lost) == 1:
                    detected = time.time()
                    # Release every survivor blocked in a collective with the dead worker.
                    for r, m in enumerate(self.members):
                        if r != rank:
                            m.actor.abort.remote()
        return results, lost, detected

    def _kill_hung(self, ranks: list[int]) -> None:
        """Workers that made no progress for hang_timeout and are not waiting in a collective
        (they are the ones the others wait for) are killed; the normal failure path follows."""
        refs = {r: self.members[r].actor.progress.remote() for r in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        for rank, ref in refs.items():
            phase = ray.get(ref).get("phase") if ref in ready else "unresponsive"
            if phase != "allreduce":
                self.log.event("worker_hung", rank=rank, phase=phase,
                               worker_id=self.members[rank].worker_id)
                ray.kill(self.members[rank].actor, no_restart=True)

    def _adapt(self, trial: int | None, results: dict[int, ChunkResult]) -> None:
        """After a chunk that completed on every rank: the micro-batch trial's result, and a
        rebalance of the shares if the measured throughputs call for one."""
        batch = self.config.batch
        step_times: dict[int, float] = {}  # a step lasts as long as its slowest rank
        compute_times: dict[int, float] = {}
        for result in results.values():
            for record in result.records:
                step_times[record.step] = max(step_times.get(record.step, 0.0), record.step_time_s)
                compute_times[record.step] = max(compute_times.get(record.step, 0.0),
                                                 record.compute_time_s)
        if trial is not None and self.tuner is not None:
            self.tuner.observe(trial, self.batch_now, list(step_times.values()))
            decision = self.tuner.decision()
            if decision is not None:
                self.tuner, self.tuned_micro = None, decision.micro_batch
                self.log.event("micro_batch_tuned", step=self.global_step, reason=decision.reason,
                               micro_batch=decision.micro_batch,
                               samples_per_s={str(k): round(v, 2)
                                              for k, v in decision.samples_per_s.items()})
            return
        if not batch.rebalance or len(self.members) < 2 or self.plan is None or not step_times:
            return
        compute = statistics.median_low(compute_times.values())
        judgement = self.rebalancer.observe(compute)
        if judgement is not None:
            self.log.event("rebalance_judged", step=self.global_step, delivered=judgement.delivered,
                           predicted_saving_s=judgement.predicted_saving_s,
                           realised_saving_s=judgement.realised_saving_s,
                           window=judgement.window, threshold=judgement.threshold)
        ids = [m.worker_id for m in self.members]
        if any(self.tracker.count(w) < 2 for w in ids):
            return
        rates = [self.tracker.rate(w) or 0.0 for w in ids]
        if min(rates) <= 0:
            return
        decision = self.rebalancer.decide(self.batch_now, self.plan.shares, rates,
                                          step_time_s=statistics.median_low(step_times.values()),
                                          compute_s=compute)
        if decision is None:
            return
        self.weights = dict(zip(ids, decision.samples_per_s, strict=True))
        self.log.event("rebalanced", step=self.global_step, shares_before=list(decision.shares_before),
                       shares_after=list(decision.shares_after),
                       samples_per_s=[round(r, 2) for r in decision.samples_per_s],
                       predicted_before_s=decision.predicted_before_s,
                       predicted_after_s=decision.predicted_after_s)

    def _record(self, results: dict[int, ChunkResult]) -> None:
        by_step: dict[int, dict[int, Any]] = {}
        for rank, result in results.items():
            worker_id = self.members[rank].worker_id
            for record in result.records:
                by_step.setdefault(record.step, {})[rank] = record
                self.tracker.observe(worker_id, record.shares[rank], record.compute_time_s)
        for step in sorted(by_step):
            ranks = by_step[step]
            records = list(ranks.values())
            first = records[0]
            b = first.global_batch_size
            step_time = max(r.step_time_s for r in records)
            slowest = max(records, key=lambda r: r.step_time_s)
            _, data_s, compute_s, comm_s, optimizer_s = slowest.timeline
            self.log.metric(step=step, epoch=first.epoch, loss=first.loss,
                            world_size=first.world_size, global_batch_size=b,
                            shares=list(first.shares), micro_batch=max(r.micro_batch for r in records),
                            micro_batches=[ranks[r].micro_batch if r in ranks else None
                                           for r in range(first.world_size)],
                            step_time_s=step_time,
                            compute_time_s=max(r.compute_time_s for r in records),
                            samples_per_s=b / step_time if step_time > 0 else None, lr=first.lr,
                            generation=self.generation, time=max(r.end_time for r in records),
                            data_s=data_s, forward_backward_s=compute_s, comm_s=comm_s,
                            optimizer_s=optimizer_s,
                            timeline=[[round(x, 6) for x in ranks[r].timeline] if r in ranks else None
                                      for r in range(first.world_size)])
            skipped = sorted({r for rec in records for r in rec.skipped_ranks})
            if skipped:
                self.log.event("nonfinite", step=step, ranks=skipped, policy="skip")
            if self.config.ledger and first.indices is not None:
                self.log.ledger(step, first.epoch, list(first.indices))
        if self._recovery is not None and by_step:
            first_end = min(r.end_time for r in by_step[min(by_step)].values())
            self.log.event("recovered", **self._recovery.breakdown(first_end))
            self._recovery = None
        self._publish()

    def _recover(self, lost: list[int], results: dict[int, ChunkResult], detected: float,
                 chaos: list[ChaosEvent]) -> None:
        self._set_state(RunState.RECOVERING, lost_ranks=lost)
        aborted = time.time()
        world_before = len(self.members)
        with self._lock:
            killed_at, self._killed_at = self._killed_at, None
        # A scheduled kill counts only if it fired (the worker left its marker with the time):
        # a rank that died of something else first is an unplanned death.
        chaos_kills: set[int] = set()
        for event in chaos:
            path = os.path.join(self.run_dir, "chaos", f"kill-{event.step}-{event.rank}")
            if event.action == "kill" and os.path.exists(path):
                chaos_kills.add(event.rank)
                with open(path) as f:
                    killed_at = float(f.read())
        newest = max((r.committed_step for r in results.values()), default=self.global_step)
        lost_workers = [self.members[r].worker_id for r in lost]
        with self._lock:
            killed = self._killed_on_purpose
            on_purpose = chaos_kills | {r for r in lost if self.members[r].worker_id in killed}
        planned = bool(lost) and set(lost) <= on_purpose
        reasons, self._death_reasons = self._death_reasons, {}
        self.log.event("worker_failure", lost_ranks=lost, step=newest, lost_workers=lost_workers,
                       survivors=len(self.members) - len(lost), planned=planned,
                       reasons=[reasons.get(r, "") for r in lost])
        if lost:
            self._drop(lost, "actor died")
        rebuilt, restored = self._form("recovery")
        self._recovery = PendingRecovery(
            detected=detected or aborted, killed_at=killed_at, aborted=aborted, rebuilt=rebuilt,
            restored=restored, lost_ranks=lost, world_before=world_before,
            # The step in flight when the worker died is redone; steps already committed by
            # the newest survivor are kept.
            work_lost_steps=int(any(r.status == "collective_error" for r in results.values())),
            world_after=len(self.members), step=self.global_step,
        )
        self._set_state(RunState.RUNNING)

    def _out_of_memory(self, plan: BatchPlan, results: dict[int, ChunkResult]) -> None:
        """Halves the micro-batch of each rank that ran out of memory; the step is redone."""
        failure = next(r.failure for r in results.values() if r.failure is not None)
        self.cursor = Cursor(**next(iter(results.values())).cursor)
        for rank in failure.ranks:
            member = self.members[rank]
            decision = back_off(failure.step, rank, member.worker_id, plan.micro_batches[rank])
            self.log.event("oom_backoff", step=decision.step, rank=rank, worker_id=member.worker_id,
                           micro_batch_before=decision.before, micro_batch_after=decision.after)
            if decision.after is None:
                raise _Failed(WorkerOutOfMemoryError(
                    f"rank {rank} ran out of memory at step {failure.step} with micro-batch 1; "
                    "use a smaller model, more memory per worker or more workers",
                    rank=rank, step=failure.step,
                ))
            self.micro_caps[member.worker_id] = decision.after

    def _user_error(self, results: dict[int, ChunkResult]) -> None:
        failures = [r.failure for r in results.values() if r.failure is not None]
        failure = failures[0]
        step = failure.step
        self.cursor = Cursor(**next(iter(results.values())).cursor)
        rank = failure.ranks[0]
        trace = next((f.traceback for f in failures if f.traceback), None) or ""
        self.user_retries[step] = self.user_retries.get(step, 0) + 1
        attempt = self.user_retries[step]
        self.log.event("user_error", step=step, ranks=list(failure.ranks), attempt=attempt,
                       error=trace.strip().splitlines()[-1] if trace else "")
        if attempt > self.config.failure.max_user_retries:
            raise _Failed(UserCodeError(
                f"user code raised at step {step} on {attempt} attempts "
                f"(failure.max_user_retries = {self.config.failure.max_user_retries})",
                rank=rank, step=step, traceback=trace,
            ))

    def _evaluate(self) -> None:
        if self.job.evaluate is None:
            return
        result = self._on_any_member(lambda a: ray.get(a.evaluate.remote()))
        self._evaluation = result
        self.log.event("evaluate", step=self.global_step,
                       epoch=self.cursor.epochs_done(self.dataset_size, self.batch_now), **result)

    # --- the end -------------------------------------------------------------------------------

    def _finish(self) -> dict[str, Any]:
        if self._stopped_early and self.job.evaluate is not None and not self._evaluation:
            self._evaluate()
        self._on_any_member(lambda a: self.checkpoints.maybe_write(a, self.global_step,
                                                                   len(self.members), final=True))
        state = self._on_any_member(lambda a: ray.get(a.model_state.remote()))
        self.log.event("finish", step=self.global_step, stopped=self._stopped_early,
                       samples=self.cursor.samples)
        self._set_state(RunState.FINISHED)
        return state

    def _shutdown_workers(self) -> None:
        for member in self.members:
            ray.kill(member.actor, no_restart=True)
        for actor in self.pending.values():
            ray.kill(actor, no_restart=True)
        self.members = []
        self.pending = {}


RECORD_KEY_PREFIX = "run-record:"


def _death_reason(e: RayActorError) -> str:
    """Ray's reason for an actor's death, in one line (its exit detail when it gives one)."""
    text = " ".join(str(getattr(e, "error_msg", None) or e).split())
    marker = "Worker exit detail: "
    if marker in text:
        text = text[text.index(marker) + len(marker):]
    return text[:300]


def _cache_record(record: dict[str, Any]) -> None:
    """Keeps an ended run's record in the cluster's key-value store too, for callers on other
    hosts than the controller's (the index is a file on the controller's host)."""
    try:
        internal_kv._internal_kv_put(
            RECORD_KEY_PREFIX + record["name"], json.dumps(record), overwrite=True, namespace=NAMESPACE)
    except Exception as e:  # a cache: never fail the run over it
        logger.warning("cannot cache the record of run %s in Ray: %s", record["name"], e)


def _user_start_error(e: RayTaskError) -> ElasticError:
    cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
    if isinstance(cause, ElasticError):
        return cause
    text = str(e).strip().splitlines()
    return ConfigError(
        "a worker could not build the job (model, optimizer, scheduler or dataset factory "
        f"raised): {text[-1] if text else e}"
    )


def _init_error(e: RayActorError) -> ElasticError:
    """The error a worker's constructor raised (Ray passes it on as text only)."""
    lines = [line.strip() for line in str(getattr(e, "error_msg", e)).strip().splitlines()]
    last = next((line for line in reversed(lines) if line), "")
    own = "elastic.errors.ConfigError: "
    if last.startswith(own):
        return ConfigError(last[len(own):])
    return ConfigError(
        "a worker could not build the job (model, optimizer, scheduler or dataset factory "
        f"raised): {last}"
    )


RemoteController = ray.remote(Controller)
