"""The controller: one Ray actor per run, a thin shell around the state machine.

The states, decisions and failure policy live in `elastic.control` and act through the
`Workers` port, which `elastic.actors.workers.RayWorkers` implements with worker actors. This
actor holds the run's context, hosts the rendezvous server, answers control requests (the
records of `elastic.control.requests`: status, events, scale, kill, stop, drain) on other
threads (they take effect at the next chunk boundary), turns departure notices (a worker's
SIGTERM, a Ray node draining, `elastic drain`) into planned departures, publishes the run's
record, and writes what the run leaves behind when it ends. The process that waits for an attached run turns a
Ctrl-C into `interrupt` (a stop) and a second one into `abandon` (`elastic.actors.client`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv

from elastic.actors.raydata import adopt_ray_dataset, data_layout
from elastic.actors.workers import RayWorkers
from elastic.checkpoint.store import serialize
from elastic.collective import RendezvousServer
from elastic.config import FitConfig
from elastic.control import ControlServer, decisions
from elastic.control.context import Context
from elastic.control.port import Notice, NoticeSource
from elastic.control.requests import Drain, Events, Kill, Request, Scale, Status, Stop
from elastic.control.run_state import RunState
from elastic.control.states import Failed, Finished, Machine, State
from elastic.control.status import RankedWorker, RunStatus, SpareWorker, StateName
from elastic.errors import ConfigError
from elastic.events import (
    DeadlineMissed,
    DetachedExit,
    DrainRequested,
    FinalModelFailed,
    FinalModelWritten,
    HeadDraining,
    KillRequested,
    PreemptionNotice,
    ScaleRequested,
)
from elastic.events import Failed as RunFailed
from elastic.job import TrainJob
from elastic.private import write_private
from elastic.registry import RunRegistry, is_terminal, this_host
from elastic.runlog import RunLog
from elastic.shipping import check_origin
from elastic.sinks import RunSinks

logger = logging.getLogger(__name__)

NAMESPACE = "elastic"
FINAL_MODEL = "final_model.pt"


def controller_name(run_name: str) -> str:
    """The Ray actor name under which a run's controller is registered."""
    return f"elastic-run-{run_name}"


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


class Controller:
    """Drives one run. Created by `elastic.fit` as a named Ray actor."""

    def __init__(self, job: TrainJob, config: FitConfig, name: str, run_dir: str,
                 detached: bool = False, home: str | None = None,
                 checkpoint_key: bytes | None = None,
                 origin: tuple[str, str] | None = None) -> None:
        if origin is not None:  # the driver's elastic (`elastic.shipping.package_origin`)
            check_origin(origin, "the controller")
        self.config = config
        self.name = name
        self.run_dir = run_dir
        self.log = RunLog(run_dir, config.logging.result_metrics)
        # This actor owns the blocks for as long as the run lives; a detached one copies those
        # another process made (they would be lost as that process ends).
        job = adopt_ray_dataset(job, own=detached)
        self.server = RendezvousServer(host=ray.util.get_node_ip_address())
        self._node = ray.get_runtime_context().get_node_id()
        self.workers = RayWorkers(job, config, run_dir, checkpoint_key, self.server,
                                  controller=ray.get_runtime_context().current_actor,
                                  origin=origin)
        restarted = detached and ray.get_runtime_context().was_current_actor_reconstructed
        self.ctx = Context(config, name, self.log, self.workers, has_evaluate=job.evaluate is not None,
                           has_eval_step=job.eval_step is not None,
                           restarted=restarted, publish=self._publish)
        self.ctx.checkpoints.data_layout = data_layout(job)
        self.machine = Machine(self.ctx, on_change=self._on_state)
        self.sinks = RunSinks(config.logging, job.callbacks, self.machine)  # loggers, callbacks
        self._lock = threading.Lock()
        # The run's record in the index (found by name, live or ended) and its fast control
        # channel; `home` is the starting process's ELASTIC_HOME, if it set one.
        self.detached = detached
        self.started_at = time.time()
        self.cluster = _cluster_address()
        self.ended_at: float | None = None
        self._ended = False  # run() has written everything the run leaves behind
        self._interrupted = False  # stopped by a Ctrl-C of an attached run's caller (`interrupt`)
        self._model_decided = False  # run() has decided whether to write final_model.pt
        self._abandoned = False  # a second Ctrl-C: the record says failed (`abandon`)
        self._publish_lock = threading.Lock()  # one record write at a time, the newest last
        self._cached = False  # this run's first record replaced an earlier run's in Ray's cache
        self.error: BaseException | None = None
        self.registry = RunRegistry(home)
        self.control = ControlServer(self.answer)
        self._publish()
        # Ray marks a node draining (scale-in, `ray drain-node`, a pod deleted under KubeRay)
        # but tells its processes nothing: the controller looks.
        self._watching = threading.Event()
        threading.Thread(target=self._watch_drains, name="elastic-drains", daemon=True).start()
        if detached:
            # A detached run drives itself: it must not depend on the process that started it
            # (that process may exit at once), so the loop starts here, not from a caller.
            threading.Thread(target=self._run_detached, name="elastic-detached-run",
                             daemon=True).start()

    # --- detached runs -------------------------------------------------------------------------

    def _run_detached(self) -> None:
        try:
            self.run()
        finally:
            # The record of the run stays in run_dir and the index; the named actor goes away
            # (also if run() raised: a name held by a dead run could not be resumed or reused).
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _write_final_model(self, model_state: dict[str, Any]) -> None:
        """Writes final_model.pt; a failure (a full disk, no memory to serialise) is an event,
        not the run's end: the run did finish, and its newest checkpoint holds the weights."""
        path = os.path.join(self.run_dir, FINAL_MODEL)
        try:
            write_private(path, serialize(model_state))
        except (OSError, MemoryError) as e:
            logger.error("run %s: cannot write %s: %s", self.name, path, e)
            self.log.emit(FinalModelFailed(path=path, error=f"{type(e).__name__}: {e}"))
            return
        self.log.emit(FinalModelWritten(path=path))

    def events(self) -> list[dict[str, Any]]:
        """Every event so far (for `elastic logs`)."""
        return list(self.log.events)

    # --- control requests (other threads) ---------------------------------------------------

    def status(self) -> RunStatus:
        """A snapshot of the run for `elastic status`: its record in the index is `to_dict()`.

        The state reads "finishing" from the moment training ended until the end is complete
        (final checkpoint, workers shut down, the final model and the last events written): a
        caller that sees "finished", "stopped" or "failed" may read everything the run leaves
        behind."""
        ctx = self.ctx
        last = self.log.last_metric()
        last_loss = last.get("loss") if last is not None else None
        error = self.error
        batching = ctx.batching
        plan = batching.plan if batching else None
        # The ranks of the generation that trains; a worker admitted at a boundary counts in
        # `world_size` only once the resize that admits it has formed its generation.
        roster = ctx.roster()
        spares = list(ctx.spares)
        with self._lock:
            label = self.machine.state.label
            state: StateName = label.value
            if label == RunState.FINISHED and ctx.stopped_early:
                state = "stopped"
            if label.is_terminal and not self._ended:
                state = "finishing"
            abandoned = self._abandoned
            if abandoned:  # its workers go with this actor, which its caller is killing
                state = "failed"
            with ctx.requests.lock:
                target = ctx.requests.target
            return RunStatus(
                name=self.name, state=state, step=ctx.step,
                total_steps=ctx.total_steps, generation=roster.generation,
                world_size=len(roster.world), target_workers=target,
                global_batch_size=(batching.batch_now if batching
                                   else self.config.batch.global_batch_size),
                shares=plan.shares if plan else None,
                micro_batches=plan.micro_batches if plan else None,
                starting_workers=self.workers.starting(), joining_workers=len(roster.joining),
                failures=ctx.policy.workers_lost,
                workers=() if abandoned else tuple(
                    RankedWorker(rank=r, worker_id=m.worker_id, pid=m.pid, node_id=m.node_id)
                    for r, m in enumerate(roster.world)),
                run_dir=self.run_dir, started_at=self.started_at, ended_at=self.ended_at,
                last_loss=last_loss, detached=self.detached,
                error_type=type(error).__name__ if error is not None else None,
                error_message=str(error) if error is not None else None,
                host=this_host(), pid=os.getpid(), control=self.control.address,
                updated_at=time.time(), preemptions=ctx.policy.preemptions,
                spare_workers=len(spares), spares=() if abandoned else tuple(
                    SpareWorker(worker_id=m.worker_id, pid=m.pid, node_id=m.node_id)
                    for m in spares),
                resumed_from=ctx.checkpoints.resumed, cluster=self.cluster,
            )

    def answer(self, request: Request) -> Any:
        """A control request, from the fast channel (`elastic.control.channel`) or through Ray
        (`elastic.actors.client.call`): a status is answered as its record, a plain dict.

        Raises:
            ConfigError: from `scale` or `kill`.
            ValueError: not a control request.
        """
        match request:
            case Status():
                return self.status().to_dict()
            case Events():
                return self.events()
            case Scale(num_workers=num_workers):
                return self.scale(num_workers)
            case Kill(rank=rank):
                return self.kill(rank)
            case Stop():
                return self.stop()
            case Drain(rank=rank, node_id=node_id, deadline_s=deadline_s):
                return self.drain(rank, node_id, deadline_s)
            case _:
                raise ValueError(f"not a control request: {request!r}")

    def _publish(self) -> None:
        """Writes the run's record to the index; a failure to write never fails the run.
        Writes never overlap: the one that read the newest status is written last."""
        with self._publish_lock:
            record = self.status().to_dict()
            try:
                self.registry.write(record)
            except OSError as e:
                logger.warning("cannot write the record of run %s to %s: %s", self.name,
                               self.registry.directory, e)
            if is_terminal(record) or not self._cached:
                # The first record too: it replaces the end an earlier run of this name
                # left there (a resumed run that is then lost must not read as that end).
                _cache_record(record)
                self._cached = True

    def scale(self, num_workers: int) -> None:
        """Sets the target world size: a shrink applies after the step in flight, growth at
        the first chunk boundary after a started worker is up.

        Raises:
            ConfigError: outside [min_workers, max_workers].
        """
        low, high = self.config.scaling.lower, self.config.scaling.upper
        if not low <= num_workers <= high:
            raise ConfigError(
                f"cannot scale run {self.name!r} to {num_workers} workers: it must stay within "
                f"[min_workers, max_workers] = [{low}, {high}]"
            )
        requests = self.ctx.requests
        with requests.lock:
            requests.target = num_workers
            requests.scaled_by_user = True
        self.ctx.start_failures = 0  # asked for: workers are tried again
        self.log.emit(ScaleRequested(num_workers=num_workers))
        if num_workers < len(self.ctx.members):
            # Workers leave after the step in flight; growth waits for a started one to be up.
            self.workers.yield_chunks()

    def kill(self, rank: int) -> None:
        """Kills the worker at `rank` now, as a failure would (for drills and tests). Ranks are
        those `status` lists: of the generation that trains (a joining worker has none).

        Raises:
            ConfigError: no such rank.
        """
        members = self.ctx.roster().world
        if not 0 <= rank < len(members):
            raise ConfigError(f"run {self.name!r} has no rank {rank} (world size {len(members)})")
        member = members[rank]
        self.log.emit(KillRequested(rank=rank, worker_id=member.worker_id))
        requests = self.ctx.requests
        with requests.lock:
            requests.killed_at = time.time()
            requests.killed_on_purpose.add(member.worker_id)
        self.workers.kill(member.worker_id)

    def drain(self, rank: int | None = None, node_id: str | None = None,
              deadline_s: float | None = None) -> list[int]:
        """`elastic drain`: the worker at `rank` (of the generation that trains), or every
        member on Ray node `node_id` (a prefix of its hex id will do), leaves at the next step
        boundary; within `deadline_s` seconds if given, else it is killed then and the run
        recovers as from a failure. Returns the worker ids told to leave.

        Raises:
            ConfigError: neither or both of rank and node, no such rank, no member on that
                node, or a negative deadline.
        """
        if (rank is None) == (node_id is None):
            raise ConfigError("drain takes a rank or a node, one of them")
        if deadline_s is not None and deadline_s < 0:
            raise ConfigError(f"the drain deadline must be 0 or more seconds, not {deadline_s}")
        if rank is not None:
            world = self.ctx.roster().world
            if not 0 <= rank < len(world):
                raise ConfigError(f"run {self.name!r} has no rank {rank} (world size {len(world)})")
            ids = [world[rank].worker_id]
        else:
            assert node_id is not None
            try:
                ids = decisions.on_node(list(self.ctx.members) + list(self.ctx.spares), node_id)
            except ValueError as e:
                raise ConfigError(f"run {self.name!r}: {e}") from None
            if not ids:
                raise ConfigError(f"run {self.name!r} has no worker on a node {node_id!r}; "
                                  "`elastic status NAME` lists each worker's node")
            for member in list(self.ctx.members) + list(self.ctx.spares):
                if member.worker_id in ids:  # their replacements go elsewhere
                    self.workers.avoid_node(member.node_id)
        deadline = time.time() + deadline_s if deadline_s is not None else None
        self.log.emit(DrainRequested(worker_ids=ids, rank=rank, node_id=node_id,
                                     deadline_s=deadline_s))
        return self._notice(ids, "drain", deadline, "elastic drain")

    def notify(self, worker_id: int, source: NoticeSource, deadline: float | None,
               reason: str = "") -> list[int]:
        """A departure notice for member `worker_id` (from its SIGTERM handler): it leaves at
        the next step boundary. Returns [worker_id] if it is a member told now, else []."""
        return self._notice([worker_id], source, deadline, reason)

    def _notice(self, ids: list[int], source: NoticeSource, deadline: float | None,
                reason: str) -> list[int]:
        """Records the notices of the members among `ids`, writes one event, ends the chunk
        in flight after its step (`yield_chunks`) and arms the deadline. Returns the worker
        ids newly told (a member already told, with an earlier deadline, is not)."""
        if self.machine.state.label.is_terminal:
            return []
        now = time.time()
        overdue = deadline is not None and deadline <= now
        # Spares, and workers still starting, on notice are let go when next looked at
        # (`check_spares`, `admit`): they have no rank.
        alive = set(self.workers.alive())
        told = [w for w in ids if w in alive and self.ctx.requests.notice(
            Notice(w, source, deadline, now, reason), overdue=overdue)]
        if not told:
            return []
        world = [m.worker_id for m in self.ctx.roster().world]
        self.log.emit(PreemptionNotice(source=source, ranks=[world.index(w) for w in told
                                                             if w in world],
                                       worker_ids=told, deadline=deadline, reason=reason))
        if overdue:
            # Passed already (`elastic drain --deadline 0`): killed here, before any chunk is
            # asked to end, and marked overdue with the notice, so that no step boundary
            # lets it go before its death is seen (a timer thread could start after the
            # boundary on a busy machine and find the worker already gone).
            for worker_id in told:
                self._deadline_passed(worker_id, deadline)
            return told
        members = {m.worker_id for m in list(self.ctx.members)}
        if members & set(told):
            self.workers.yield_chunks()  # every rank ends its chunk after the step in flight
        for worker_id in told:
            if deadline is not None:
                timer = threading.Timer(deadline - now, self._deadline_passed,
                                        (worker_id, deadline))
                timer.daemon = True
                timer.start()
        return told

    def _deadline_passed(self, worker_id: int, deadline: float) -> None:
        """The deadline of a notice: a worker on notice that is still a member did not reach
        a step boundary in time (or the deadline had already passed), so it is killed and the
        run recovers as from a failure; its loss counts as a preemption."""
        with self.ctx.requests.lock:
            notice = self.ctx.requests.departures.get(worker_id)
        if notice is None or notice.deadline != deadline:
            return  # gone at a boundary already, or a later notice moved the deadline
        if worker_id not in [m.worker_id for m in list(self.ctx.members)]:
            return
        self.ctx.requests.overdue_now(worker_id)  # a boundary before its death: not let go
        self.log.emit(DeadlineMissed(worker_id=worker_id, deadline=deadline))
        self.workers.kill(worker_id)

    def _watch_drains(self) -> None:
        """Polls Ray for draining nodes (`DRAIN_POLL_S`) while the run lives: members on
        one get a notice with the drain's deadline."""
        warned = False
        head_told = False  # this node's drain, said once
        while not self._watching.wait(DRAIN_POLL_S):
            if self.machine.state.label.is_terminal:
                return
            try:
                draining = draining_nodes()
            except Exception as e:  # Ray's private call changed: say so once, keep training
                if not warned:
                    logger.warning("cannot read Ray's draining nodes (%s); drains are seen only "
                                   "when their workers die", e)
                    warned = True
                continue
            for node, deadline in draining.items():
                if node == self._node and not head_told:
                    head_told = True
                    self._head_draining(node, deadline)
                ids = [m.worker_id for m in list(self.ctx.members) + list(self.ctx.spares)
                       if m.node_id == node]
                if ids:
                    self._notice(ids, "ray_drain", deadline,
                                 f"Ray node {node[:12]} is draining")

    def _head_draining(self, node: str, deadline: float | None) -> None:
        """This controller's node drains: the cluster ends with it (Ray's head, a preempted
        head pod). The committed state is written at the next step boundary (the chunk in
        flight ends after its step); the run goes on until then."""
        checkpoint = self.config.checkpoint is not None
        self.log.emit(HeadDraining(deadline=deadline, checkpoint=checkpoint,
                                   reason=f"Ray node {node[:12]} (the controller's) is draining"))
        if checkpoint:
            with self.ctx.requests.lock:
                self.ctx.requests.save = True
            self.workers.yield_chunks()

    def stop(self) -> None:
        """Ends the run gracefully after the step the workers are in (nothing once it has
        ended)."""
        if self.machine.state.label.is_terminal:
            return
        self.ctx.request_stop()

    def interrupt(self) -> bool:
        """A Ctrl-C or SIGTERM in the process that waits for this (attached) run: stops it as
        `stop` does, and has it leave `final_model.pt` in the run dir as a detached run does,
        since that caller gets a KeyboardInterrupt (SystemExit) instead of the weights. False
        when it comes too late: the run has already decided how it ends (the caller keeps the
        weights itself)."""
        with self._lock:
            if self._model_decided:
                return False
            self._interrupted = True
        self.stop()
        return True

    def abandon(self, reason: str, as_exit: bool = False) -> None:
        """A second Ctrl-C (or SIGTERM, `as_exit`): the caller kills this actor (and so the
        workers) without waiting for the step in flight. The record is ended first, as failed
        with a KeyboardInterrupt (SystemExit for SIGTERM) whose message is `reason`, so that
        the run reads as interrupted, not as lost."""
        with self._lock:
            if self._ended:
                return
            self._abandoned = True
            self.error = SystemExit(reason) if as_exit else KeyboardInterrupt(reason)
            self.ended_at = time.time()
        self.log.emit(RunFailed(error=f"{type(self.error).__name__}: {reason}", step=self.ctx.step))
        self._publish()

    # --- the run -------------------------------------------------------------------------------

    def _on_state(self, previous: RunState, state: State) -> None:
        with self._lock:
            if self._abandoned:  # its end is recorded already
                return
            if state.label.is_terminal:
                self.ended_at = time.time()
            if isinstance(state, Failed):
                self.error = state.error

    def run(self) -> Outcome:
        """Runs the whole training; returns when finished, stopped or failed."""
        model_state: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            try:
                self.sinks.start()  # a missing logger package fails the run before it starts
                self.machine.run()
            finally:  # whatever happened, no worker outlives the run
                self.workers.shutdown()
                self.ctx.members = []
                self.server.close()
            end = self.sinks.end()  # callbacks' on_finish; a late callback error fails the run
            model_state = end.model_state if isinstance(end, Finished) else None
            error = end.error if isinstance(end, Failed) else None
            with self._lock:
                self._model_decided = True
                keep = self.detached or self._interrupted
            if keep and model_state is not None:
                self._write_final_model(model_state)
            elif self.sinks.weights_left is not None:  # trained, then a callback failed it
                self._write_final_model(self.sinks.weights_left)
            if self.detached:
                self.log.emit(DetachedExit(failed=error is not None))
        finally:
            # The end is published once everything it points to is written, and before the
            # channel closes: a caller that finds nobody answering reads the record again.
            self.sinks.close()
            with self._lock:
                self._ended = True
            self._publish()
            self._watching.set()
            self.control.close()
            self.log.close()  # a later event (a status call's) opens the file again
        return Outcome(
            model_state=model_state, steps=self.ctx.step, samples=self.ctx.cursor.samples,
            events=list(self.log.events), metrics=self.log.newest_metrics(),
            evaluation=self.ctx.evaluation, stopped=self.ctx.stopped_early, error=error,
        )


DRAIN_POLL_S = 0.5  # how often the controller asks Ray for draining nodes


def draining_nodes() -> dict[str, float | None]:
    """Ray's draining nodes: hex node id -> deadline (seconds since the epoch; None when the
    drain has none). The one call of Ray's private API for drains (Ray Train, Data and Serve
    make the same one); there is no public one, nor a push."""
    from ray._private.state import state

    return {node: (ms / 1000.0 if ms else None)
            for node, ms in state.get_draining_nodes().items()}


RECORD_KEY_PREFIX = "run-record:"


def _cluster_address() -> str | None:
    """The connected Ray cluster's GCS address (None if Ray cannot say)."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # an identity for records only: never fail a run over it
        return None


def _cache_record(record: dict[str, Any]) -> None:
    """Keeps a run's first record and its end in the cluster's key-value store too, for
    callers on other hosts than the controller's (the index is a file on the controller's
    host); a live one found there without its controller is a lost run."""
    try:
        internal_kv._internal_kv_put(
            RECORD_KEY_PREFIX + record["name"], json.dumps(record), overwrite=True, namespace=NAMESPACE)
    except Exception as e:  # a cache: never fail the run over it
        logger.warning("cannot cache the record of run %s in Ray: %s", record["name"], e)


RemoteController = ray.remote(Controller)
