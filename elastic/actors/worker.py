"""The worker actor: owns one replica and its communicator.

It is a threaded actor: one thread runs chunks of steps, while others answer `abort` and
`progress`, which is how the controller releases a worker blocked in a collective with a dead
peer, and how the hang watchdog sees where each worker is.

With `scaling.use_gpu` it computes on the GPU Ray assigned to it
(`elastic.trainer.device.resolve_device`). CUDA's current device is per thread and Ray runs
each call of a threaded actor on a thread of its pool, so every method that touches the
replica's tensors binds the device first.

The steps themselves all run on one thread of the worker's own (`_compute`), whichever pool
thread the chunk's call arrived on. A step on a thread new to it paid for that: glibc gives each
thread its own malloc arena, so the step's tensors were fresh pages to fault in, and PyTorch's
and oneDNN's per-thread caches started cold. With chunks handed out ahead, successive chunks
arrive on different pool threads, and the first step of each chunk of a CNN took 1.2-4x as long
as the others (measured with `elastic bench overhead --model cnn`). Every other call that reads
or writes the replica's state (taking a peer's, evaluating, checkpointing, loading a
checkpoint, handing out the weights) runs there too (`_on_step_thread`): in the same arena and
thread-local state as the steps, and never beside a step, whatever the controller asks when.
Only `connect`, `abort`, `progress` and `yield_chunks` run on the pool's threads (they must
answer while a step runs or is stuck).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from elastic.adapt.lr import LrRamp
from elastic.adapt.plan import BatchPlan
from elastic.adapt.sharding import describe
from elastic.checkpoint import CheckpointWriter
from elastic.checkpoint.retention import Retention
from elastic.checkpoint.store import newest_checkpoint_within, none_loaded, serialize, shard_name
from elastic.collective import Communicator, Endpoint
from elastic.config import ChaosEvent, FitConfig
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
)
from elastic.errors import (
    AfterStepError,
    CollectiveError,
    ConfigError,
    InjectedFault,
)
from elastic.job import TrainJob
from elastic.shipping import check_origin
from elastic.trainer.device import (
    bind_thread,
    is_out_of_memory,
    out_of_memory_forming,
    release_cached_memory,
    resolve_device,
    to_host,
)
from elastic.trainer.evaluation import EvalFailure, LazyDataset, eval_batch_size, evaluate_share
from elastic.trainer.exact import environment_changes
from elastic.trainer.replica import (
    NonFinite,
    OutOfMemory,
    Replica,
    StepRecord,
    UserFailure,
    chaos_kill,
)

logger = logging.getLogger(__name__)

# Longest a worker waits for the last generation's communicator to be released before it ends
# its process (an NCCL communicator whose kernels never end cannot be released).
_RELEASE_S = 30.0


def _shard_problem(answers: list[dict[str, Any] | None], step: int,
                   own: dict[str, list[int]]) -> str | None:
    """Why the other members' shards (`WorkerActor.checkpoint_shard`) and this member's
    (`own`: name -> state ids) cannot make a checkpoint of `step`, or None."""
    if any(a is None for a in answers):
        return "a member did not write its shard of the optimizer state (it died or failed)"
    busy = [a["busy"] for a in answers if a is not None and "busy" in a]
    if busy:
        return f"a member did not write its shard of the optimizer state: {busy[0]}"
    steps = sorted({a["step"] for a in answers if a is not None} - {step})
    if steps:
        return (f"members hold step(s) {steps}, not the writer's {step}, so their shards of "
                "the optimizer state do not belong to its checkpoint")
    listed = [*own.items(), *((a["name"], a["ids"]) for a in answers if a is not None)]
    names = [name for name, _ in listed]
    ids = [i for _, held in listed for i in held]
    if len(set(names)) != len(names) or len(set(ids)) != len(ids):
        return ("two members wrote shards of the same name or state of the same parameter "
                "(their ownership maps differ)")
    return None


_UNFINISHED = ("a member died while the parameters of a step were gathered: the parts a "
               "rank does not own are not yet updated until the next generation forms")


def _ranks_problem(answers: list[dict[str, Any] | None], shards: Any,
                   absent: list[int]) -> str | None:
    """Why the members that wrote shards, with the ranks `absent`, are not every rank of the
    writer's generation (each part written by its first live owner needs them all), or
    None. Before any generation formed every rank holds every part: nothing to check."""
    world = shards.ownership.world_size if shards.ownership is not None else None
    if world is None:
        return None
    ranks = [a.get("rank") for a in answers if a is not None] + [shards.rank, *absent]
    if sorted(ranks) != list(range(world)) or any(
            a.get("world") != world for a in answers if a is not None):
        return ("the members that wrote shards are not the ranks of one generation (a "
                "generation formed on some of them only): some parts would be in no shard")
    return None


def _writers_problem(replica: Any, answers: list[dict[str, Any] | None], step: int,
                     own: dict[str, list[int]], absent: list[int]) -> str | None:
    """Why this member (the manifest's writer) cannot make a sharded checkpoint of `step`
    from its own shard and the others' `answers`, with the ranks `absent` dead, or None."""
    orphaned = replica.shards.orphaned(absent)
    if orphaned:
        return (f"every owner of parameter(s) {describe(orphaned)} died, so their optimizer "
                "state is in no shard")
    if replica.unfinished is not None:
        return _UNFINISHED
    return _shard_problem(answers, step, own) or _ranks_problem(answers, replica.shards, absent)


def _shard_entries(peers: list[Any], names: list[str], write: str) -> dict[str, dict[str, Any]]:
    """On the writer's thread, before the manifest: each other member's shard of write
    `write` once it is on disk (file name -> manifest entry); `names`: the shard each of
    `peers` announced (`WorkerActor.checkpoint_shard`).

    Raises:
        RuntimeError: a member died, its shard could not be written, or it described another
            shard than it announced (no manifest then).
    """
    entries = {}
    for peer, name in zip(peers, names, strict=True):
        entry = _answer(peer.shard_entry.remote(write))
        if entry is None or "error" in entry:
            raise RuntimeError("a member's shard of the optimizer state is not on disk ("
                               + ("it died" if entry is None else entry["error"])
                               + "); the checkpoint is not committed")
        if entry.get("name") != name or not isinstance(entry.get("bytes"), int) \
                or not isinstance(entry.get("sha256"), str):
            raise RuntimeError(f"the member that announced shard {name} described another "
                               f"({entry.get('name')!r}); the checkpoint is not committed")
        entries[f"{name}.pt"] = entry
    return entries


def _answer(ref: Any) -> Any:
    """What a member's call returned, or None if it died or raised."""
    try:
        return ray.get(ref)
    except (RayActorError, RayTaskError):
        return None


class _StepThread:
    """The one thread that runs a worker's steps (see the module's docstring). A daemon: a step
    stuck in user code never holds the process at its exit."""

    def __init__(self) -> None:
        self._calls: SimpleQueue[tuple[Future, Any, tuple]] = SimpleQueue()
        threading.Thread(target=self._serve, name="elastic-steps", daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # raised again in the caller's thread
                future.set_exception(e)

    def run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on this thread; its result, or its exception raised here."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future.result()


class _SigtermNotice:
    """SIGTERM as a departure notice (a pod evicted, a Slurm job step signalled, a spot
    notice): the handler only sets a flag, and a thread reports it to the controller
    (`Controller.notify`), which lets this worker leave at the next step boundary. A second
    SIGTERM, or one with no controller to tell, goes to the handler that was there before
    (Ray's, which ends the process). Installed from `__init__`, which Ray runs on the main
    thread of a threaded actor (the only thread that may install a handler)."""

    def __init__(self, worker_id: int, controller: Any) -> None:
        self._worker_id, self._controller = worker_id, controller
        self._received = threading.Event()
        self._previous: Any = None
        if controller is None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        threading.Thread(target=self._report, name="elastic-notice", daemon=True).start()

    def _handle(self, signum: int, frame: Any) -> None:
        if not self._received.is_set():
            self._received.set()
            return
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(1)

    def _report(self) -> None:
        self._received.wait()
        try:
            ray.get(self._controller.notify.remote(self._worker_id, "sigterm", None,
                                                   "the worker's process got SIGTERM"))
        except Exception as e:  # no controller to tell: the process ends as it would have
            logger.warning("worker %s: SIGTERM could not be reported (%s); exiting",
                           self._worker_id, e)
            os._exit(1)


def _on_step_thread(method: Any) -> Any:
    """Runs the actor's `method` on its step thread (`WorkerActor._compute`), after any step
    or call queued there before it."""

    @functools.wraps(method)
    def on_step_thread(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return self._compute.run(functools.partial(method, self, *args, **kwargs))

    return on_step_thread


@ray.remote
class WorkerActor:
    """One data-parallel worker. Built in the background; joins a generation via `connect`."""

    def __init__(self, job: TrainJob, config: FitConfig, run_dir: str, worker_id: int,
                 checkpoint_key: bytes | None = None, controller: Any = None,
                 origin: tuple[str, str] | None = None) -> None:
        if origin is not None:  # the driver's elastic (`elastic.shipping.package_origin`)
            check_origin(origin, f"worker {worker_id}")
        self.worker_id = worker_id
        # First, before the slow part (torch's model, the data): a SIGTERM that comes while
        # the worker starts is a notice too.
        self._notice = _SigtermNotice(worker_id, controller)
        self.config = config
        use_gpu = config.scaling.use_gpu
        self.device = resolve_device(use_gpu, ray.get_gpu_ids() if use_gpu else [],
                                     os.environ.get("CUDA_VISIBLE_DEVICES"),
                                     use_gpu and torch.cuda.is_available())
        bind_thread(self.device)  # before the replica: the model is built and moved there
        self.replica = Replica(job, config, run_dir, self.device)
        self._abort = threading.Event()
        self._lock = threading.Lock()
        # The one thread that runs steps (see the module's docstring).
        self._compute = _StepThread()
        ckpt = config.checkpoint
        self._key = checkpoint_key
        self._writer = (CheckpointWriter(
            ckpt.path, ckpt.keep_last, checkpoint_key,
            Retention(ckpt.keep_last, ckpt.keep_best, ckpt.monitor, ckpt.mode),
            limit_s=ckpt.timeout_s)
            if ckpt else None)
        self._eval_set = LazyDataset(job.eval_dataset, config.seed) if job.eval_dataset else None
        self._checkpoint_chaos: list[ChaosEvent] = []  # kills to fire during a checkpoint write
        self._restore_chaos: list[ChaosEvent] = []  # out of memory to fire in a `sync`
        self._restore_fired: list[ChaosEvent] = []  # each once, if handed out again
        # Chunks run in the order handed out (`ticket`, from 0 in each generation), whatever
        # the order in which this threaded actor's calls arrive; `_completed`: the last one did.
        self._turn = threading.Condition()
        self._next_ticket = 0
        self._completed = True
        # Chunks of `_generation` with a ticket up to `_yield_ticket` end after the step in
        # which every rank learns of it (`yield_chunks`).
        self._generation = -1
        self._yield_ticket = -1
        self._taken_in = threading.Event()  # a generation took this worker in (`park`)

    def park(self) -> None:
        """Waits as a hot spare until a generation takes this worker in (`connect`). The
        controller holds this call's reference: it fails when the process dies, which is how
        a spare's death is seen while it trains nothing."""
        self._taken_in.wait()

    def info(self) -> dict[str, Any]:
        """Identity of this worker's process (tests check that survivors keep their pid) and
        the length of the data set it built (`decisions.data_set_mismatch`)."""
        return {"worker_id": self.worker_id, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "dataset_size": self.replica.order.dataset_size}

    def connect(self, rank: int, world_size: int, endpoint: str, generation: int,
                secret: bytes) -> tuple[int, str]:
        """Joins generation `generation` as `rank` (`secret`: the run's rendezvous secret, which
        reaches the worker only through this call); returns the committed step this replica can
        hand over (-1 if it is half updated: `Replica.restorable_step`) and the communicator's
        transport."""
        bind_thread(self.device)  # NCCL binds its communicator to the caller's device
        self._taken_in.set()
        with self._lock:
            self._abort = threading.Event()
            signal_ = self._abort
            # Not left pointing at it: if the new one cannot be built, neither the next connect
            # nor `abort` touches the closed one.
            old, self.replica.comm = self.replica.comm, None
        if old is not None and not old.close(timeout=_RELEASE_S):
            # NCCL state that cannot be released (a kernel that never ends) would wedge this
            # process; ending it lets the controller replace the worker.
            logger.error("worker %s: the communicator of the last generation was not released "
                         "within %.0f s; ending this worker's process so that it is replaced",
                         self.worker_id, _RELEASE_S)
            os._exit(1)
        with self._turn:
            self._next_ticket, self._completed = 0, True
            self._generation, self._yield_ticket = generation, -1
            self._turn.notify_all()  # a chunk of the old generation still waiting: skipped
        with self._forming(rank, generation, "connecting"):
            self.replica.comm = Communicator(rank, world_size, Endpoint.parse(endpoint),
                                             generation, self.config.collective,
                                             abort_signal=signal_, secret=secret,
                                             shared_bytes=self.replica.registered_bytes())
        shards = self.replica.shards
        holding = ((len(shards.params), sorted(shards.held),
                    shards.pending.step if shards.pending is not None else None)
                   if shards is not None else None)
        return self.replica.restorable_step, self.replica.comm.transport, holding

    @_on_step_thread
    def sync(self, src: int, leaving: list[int] | None = None) -> dict[str, int]:
        """Takes the state of rank `src` of the current generation; returns the data cursor.
        `leaving`: ranks about to leave, which hand their sharded optimizer state over."""
        bind_thread(self.device)
        comm = self.replica.comm
        with self._forming(comm.rank if comm is not None else 0, self._generation, "restoring"):
            due = [e for e in self._restore_chaos if e.step <= self.replica.global_step]
            if due:
                self._restore_chaos.remove(due[0])
                self._restore_fired.append(due[0])
                self.replica.faults.fire(due[:1], "restore")
            self.replica.sync_from(src, leaving or ())
        return self.replica.cursor.to_dict()

    @contextlib.contextmanager
    def _forming(self, rank: int, generation: int, doing: str) -> Iterator[None]:
        """Out of memory while a generation forms becomes `GenerationOutOfMemoryError`
        (after the allocator's cached blocks are freed), which the controller's policy acts
        on; a smaller micro-batch would change nothing here."""
        try:
            yield
        except Exception as e:
            typed = out_of_memory_forming(e, rank=rank, generation=generation, doing=doing,
                                          device=self.device, worker_id=self.worker_id)
            if typed is None:
                raise
            raise typed from e

    def run_chunk(self, plan: BatchPlan, num_steps: int, chaos: list[ChaosEvent],
                  lr_ramp: LrRamp | None = None, ticket: int = 0, start: int | None = None,
                  ahead: bool = False, generation: int | None = None) -> ChunkOutcome:
        """Runs up to `num_steps` steps from the committed step; says how the chunk ended.

        Chunks of a generation run in `ticket` order. One handed out `ahead` (while the chunk
        before it was running) is skipped unless that chunk completed at step `start`; so is
        one of a generation this worker has left."""
        bind_thread(self.device)
        replica = self.replica
        with self._turn:
            while self._next_ticket != ticket and generation in (None, self._generation):
                self._turn.wait()
            if generation not in (None, self._generation):
                return ChunkSkipped([], replica.global_step, replica.cursor.to_dict())
        try:
            if ahead and (not self._completed or replica.global_step != start):
                return ChunkSkipped([], replica.global_step, replica.cursor.to_dict())
            self._completed = False
            replica.yielding = lambda: ticket <= self._yield_ticket
            outcome = self._compute.run(self._run_chunk, plan, num_steps, chaos, lr_ramp)
            self._completed = isinstance(outcome, ChunkDone)
            return outcome
        finally:
            with self._turn:
                self._next_ticket += 1
                self._turn.notify_all()

    def _run_chunk(self, plan: BatchPlan, num_steps: int, chaos: list[ChaosEvent],
                   lr_ramp: LrRamp | None) -> ChunkOutcome:
        bind_thread(self.device)
        records: list[StepRecord] = []
        replica = self.replica
        rank = replica.comm.rank if replica.comm else -1
        broken: ChunkVotedDown | None = None
        self._checkpoint_chaos += [e for e in chaos if e.rank == rank and e.phase == "checkpoint"]
        self._restore_chaos += [e for e in chaos if e.rank == rank and e.phase == "restore"
                                and e not in self._restore_chaos and e not in self._restore_fired]
        try:
            for _ in range(num_steps):
                step = replica.global_step
                mine = [e for e in chaos if e.step == step and e.rank == rank]
                factor = lr_ramp.factor(step) if lr_ramp is not None else 1.0
                writing = self._writer is not None and self._writer.writing
                outcome = replica.run_step(plan, mine, factor)
                if isinstance(outcome, (UserFailure, OutOfMemory, NonFinite)):
                    return ChunkVotedDown(records, replica.global_step, replica.cursor.to_dict(),
                                          outcome)
                if writing or (self._writer is not None and self._writer.writing):
                    outcome = dataclasses.replace(outcome, writing=True)
                records.append(outcome)
                if outcome.interrupted is not None:  # committed, but the gather after it failed
                    return ChunkInterrupted(records, replica.global_step,
                                            replica.cursor.to_dict(), outcome.interrupted)
                if outcome.yielded:  # every rank read the same flag: all end here
                    break
        except CollectiveError as e:
            if not is_out_of_memory(e):
                return ChunkInterrupted(records, replica.global_step, replica.cursor.to_dict(),
                                        str(e))
            # This rank ran out of memory in the step's communication (NCCL's buffers, or its
            # own past the vote) or in its apply phase, and aborted its communicator: the
            # controller releases its peers, backs its micro-batch off as for a vote and
            # re-forms the generation (restoring this rank from the newest committed step).
            step = replica.global_step
            broken = ChunkVotedDown(records, step, replica.cursor.to_dict(),
                                    OutOfMemory(step=step, ranks=(rank,)), broken=True)
        except (AfterStepError, ConfigError) as e:
            # User code after a step raised, or the job is set up so that a step cannot run
            # (a parameter that started training, exact mode's plan): the run fails with it,
            # the other ranks released from the step's collectives.
            return ChunkFailed(records, replica.global_step, replica.cursor.to_dict(), e)
        if broken is not None:
            # Out of the except block: the error's frames (the failed attempt's tensors) are
            # gone before the allocator's cache is released.
            release_cached_memory(self.device)
            return broken
        return ChunkDone(records, replica.global_step, replica.cursor.to_dict())

    def yield_chunks(self, generation: int, ticket: int) -> None:
        """Ends the chunks of `generation` handed out up to `ticket` early (any thread): the
        running one after the step whose metadata first carries the request (every rank ends
        it after that same step), and those queued behind it are then skipped."""
        with self._turn:
            if generation == self._generation:
                self._yield_ticket = max(self._yield_ticket, ticket)

    @_on_step_thread
    def checkpoint_shard(self, write: str, absent: list[int] | None = None) -> dict[str, Any]:
        """Sharded optimizer state, as another member takes a checkpoint (write `write`):
        writes the state of the parts this rank is the first owner of as its shard of the
        checkpoint of its committed step, and of the parts whose earlier owners are among the
        ranks `absent` (dead since the generation formed; `elastic.checkpoint.store.write_shard`; in the
        background if configured, after its previous write: a shard is skipped only when that
        write is past `checkpoint.timeout` and still running). Returns the step, the shard's
        name and the state ids it holds, or the step and why it was skipped (`busy`); the member
        that writes the manifest asks for the file's entry once it is on disk (`shard_entry`)."""
        ckpt = self.config.checkpoint
        replica = self.replica
        assert ckpt is not None and self._writer is not None, "no checkpoint configured"
        shards = replica.shards
        assert shards is not None, "optimizer state is not sharded"
        bind_thread(self.device)
        replica.check_committed()
        step = replica.global_step
        self._writer.flush()
        busy = self._writer.busy_note()  # its previous write is past the limit, still running
        if busy is None and replica.unfinished is not None:
            busy = _UNFINISHED
        if busy is not None:
            return {"step": step, "busy": busy}
        name, state = shard_name(shards.rank, write), shards.primary_states(absent or ())
        if ckpt.async_write:  # the step pays for a copy in host memory only
            self._writer.submit_shard(step, write, (name, to_host(state, copy=True, pin=True)))
        else:
            self._writer.write_shard_now(step, write, (name, to_host(state)))
        world = shards.ownership.world_size if shards.ownership is not None else None
        return {"step": step, "name": name, "ids": sorted(state), "rank": shards.rank,
                "world": world}

    def shard_entry(self, write: str) -> dict[str, Any]:
        """Any thread: once this member's shard of write `write` is on disk (waiting for it up
        to `checkpoint.timeout`), its name and manifest entry, or the error that ended it."""
        assert self._writer is not None, "no checkpoint configured"
        return self._writer.shard_entry(write)

    @_on_step_thread
    def checkpoint(self, meta: dict[str, Any], shards: list[Any] | None = None,
                   peers: list[Any] | None = None) -> dict[str, Any]:
        """Snapshots the committed state and writes it (in the background if configured).
        Returns whether it was submitted and the reports of writes finished since last time.
        With sharded optimizer state: `shards`, the other members' `checkpoint_shard` calls
        for this write (`meta['write']`; object references), and `peers`, their actors. Each
        writes its own shard and this member its own with the rest; the manifest, written once
        every shard is on disk (`shard_entry`), lists them all with their checksums. A write
        in flight is then waited for, not skipped (the others' shards are on their way)."""
        ckpt = self.config.checkpoint
        assert ckpt is not None and self._writer is not None, "no checkpoint configured"
        meta = dict(meta)
        absent = meta.pop("absent", [])  # ranks dead since the generation formed (sharded)
        busy = self._writer.busy_note() if shards is None else None
        if busy is not None:
            return {"submitted": False, "reports": self._reports(), "note": busy}
        bind_thread(self.device)
        state = self.replica.state()
        step = self.replica.global_step
        written = None
        if shards is not None:
            answers = [_answer(ref) for ref in shards]
            self._writer.flush()
            busy = self._writer.busy_note()  # its previous write is past the limit, still running
            if busy is not None:
                return {"submitted": False, "reports": self._reports(), "note": busy}
            assert self.replica.shards is not None, "optimizer state is not sharded"
            own = self.replica.shards.primary_states(absent)
            own_name = shard_name(self.replica.shards.rank, meta["write"])
            problem = _writers_problem(self.replica, answers, step, {own_name: sorted(own)},
                                       absent)
            if problem is not None:
                return {"submitted": False, "reports": self._reports(),
                        "note": f"{problem}; this checkpoint was skipped"}
            listed = {a["name"]: a["ids"] for a in answers if a is not None}
            listed[own_name] = sorted(own)
            state = {**state, "optimizer": {**state["optimizer"], "state": {}}, own_name: own}
            meta = {**meta, "shards": dict(sorted(listed.items()))}
            written = functools.partial(_shard_entries, peers or [],
                                        [a["name"] for a in answers if a is not None],
                                        meta["write"])
        meta = {**meta, "epoch": state["cursor"]["epoch"]}
        crash = self._crash_mid_write(step)
        if ckpt.async_write:
            # The only cost on the training path: a copy of the state in host memory, which the
            # writer's thread serialises while training goes on. A GPU's tensors are copied
            # into pinned memory up to `device.PIN_LIMIT_BYTES` (2 GiB) per snapshot, the rest
            # (and all of it if pinning fails) into pageable memory: PyTorch's caching host
            # allocator keeps the pinned blocks for the next snapshot, so that bound is what
            # checkpoints hold pinned. One walk of the whole state: tied tensors copied once.
            snapshot = to_host({name: value for name, value in state.items() if value is not None},
                               copy=True, pin=True)
            submitted = self._writer.submit(step, snapshot, meta, after_part=crash,
                                            written=written)
        else:  # serialised at once: a GPU's tensors copied out, the others as they are
            parts = {name: serialize(to_host(value)) for name, value in state.items()
                     if value is not None}
            submitted = self._writer.write_now(step, parts, meta, after_part=crash, written=written)
        if not submitted:  # not started: the write before is past its time limit and still runs
            return {"submitted": False, "reports": self._reports(),
                    "note": self._writer.busy_note() or "the write before was still in flight"}
        return {"submitted": True, "reports": self._reports()}

    def _crash_mid_write(self, step: int) -> Any:
        """Chaos phase 'checkpoint': once the first part of this write is on disk, before the
        manifest commits it, SIGKILL this worker ('kill') or block the write for good
        ('hang', storage that stops answering)."""
        due = [e for e in self._checkpoint_chaos if e.step <= step]
        if not due:
            return None
        event = due[0]
        self._checkpoint_chaos.remove(event)
        if event.action == "hang":
            return lambda _part: threading.Event().wait()
        run_dir = self.replica.run_dir
        return lambda _part: chaos_kill(run_dir, event)

    @_on_step_thread
    def evaluate_share(self, shares: tuple[int, ...], chaos: list[ChaosEvent],
                       scheduled: bool = True) -> EvalOutcome:
        """Evaluates this rank's slice of the evaluation set and reduces the metrics with every
        member of the generation (`elastic.trainer.evaluation.evaluate_share`); chaos faults of
        phase 'evaluate' for this rank fire before it reads anything. After a `scheduled`
        evaluation, a scheduler of `scheduler_interval` 'evaluation' steps."""
        bind_thread(self.device)
        replica = self.replica
        comm = replica.comm
        assert comm is not None and self._eval_set is not None
        mine = [e for e in chaos if e.rank == comm.rank and e.phase == "evaluate"]
        try:
            result = evaluate_share(comm, replica.model, self._eval_set, replica.collate,
                                    replica.eval_step, shares, eval_batch_size(self.config),
                                    self.config.seed, lambda: self._fire(mine), replica.progress)
        except CollectiveError as e:
            return EvalInterrupted(str(e))
        if isinstance(result, EvalFailure):
            return EvalVotedDown(result)
        try:
            if scheduled:
                replica.training.after_evaluation(replica.global_step, comm.rank, result)
        except AfterStepError as e:
            return EvalFailed(e)
        return EvalDone(result)

    def _fire(self, events: list[ChaosEvent]) -> None:
        """Chaos during an evaluation: 'kill' SIGKILLs this worker, 'hang' blocks it for
        good, 'raise' is an error of user code."""
        for event in events:
            if event.action == "kill":
                chaos_kill(self.replica.run_dir, event)
            elif event.action == "hang":
                threading.Event().wait()
            elif event.action == "raise":
                raise InjectedFault(f"injected fault in the evaluation at step {event.step}, "
                                    f"rank {event.rank}")

    def flush_checkpoints(self) -> list[dict[str, Any]]:
        """Waits for the background write, if any; returns the finished writes' reports."""
        if self._writer is not None:
            self._writer.flush()
        return self._reports()

    def _reports(self) -> list[dict[str, Any]]:
        if self._writer is None:
            return []
        return [dict(r.__dict__) for r in self._writer.take_reports()]

    @_on_step_thread
    def restore_checkpoint(self) -> dict[str, Any]:
        """Loads the newest valid checkpoint into this replica, if there is one."""
        ckpt = self.config.checkpoint
        assert ckpt is not None, "no checkpoint configured"
        bind_thread(self.device)
        comm = self.replica.comm
        with self._forming(comm.rank if comm is not None else 0, self._generation,
                           "loading a checkpoint"):
            loaded, skipped = newest_checkpoint_within(
                ckpt.path, self._key, ckpt.timeout_s)
            if loaded is None:
                return none_loaded(skipped)
            self.replica.load_state(loaded.parts)
        change = None
        there = (loaded.parts.get("exact") or {}).get("environment")
        if self.config.batch.exact and there:  # allowed by checkpoint.allow_environment_change
            changes = environment_changes(there)
            if changes:
                change = "environment " + ", ".join(
                    f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        return {"step": loaded.step, "path": loaded.path, "skipped": loaded.skipped,
                "environment_change": change,
                "fingerprint": loaded.manifest.get("fingerprint"),
                "world_size": loaded.manifest.get("world_size"),
                "dataset_size": loaded.manifest.get("dataset_size"),
                "data_layout": loaded.manifest.get("data_layout"),
                "lr_ramp": loaded.manifest.get("lr_ramp"),
                "run": loaded.manifest.get("run")}

    def abort(self) -> None:
        """Releases this worker from any collective it is blocked in (any thread)."""
        with self._lock:
            self._abort.set()
            comm = self.replica.comm
        if comm is not None:
            comm.abort()

    def progress(self) -> dict[str, Any]:
        """Step, phase and seconds in it, for the hang watchdog."""
        p = self.replica.progress
        return {"step": p.step, "phase": p.phase, "since": p.since,
                "age": time.monotonic() - p.since}

    def traits(self) -> dict[str, int]:
        """The model's BatchNorm and dropout layers (`Replica.traits`)."""
        return self.replica.traits()

    @_on_step_thread
    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict as CPU tensors."""
        bind_thread(self.device)
        self.replica.check_committed()
        return {k: v.detach().cpu().clone() for k, v in self.replica.model.state_dict().items()}

    @_on_step_thread
    def evaluate(self) -> dict[str, float]:
        """Runs the job's `evaluate` on this replica (the controller asks rank 0)."""
        if self.replica.job.evaluate is None:
            return {}
        bind_thread(self.device)
        self.replica.model.eval()
        with torch.no_grad():
            return dict(self.replica.job.evaluate(self.replica.model))

