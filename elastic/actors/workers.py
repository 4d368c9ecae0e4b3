"""The `Workers` port (`elastic.control.port`) over Ray actors: the only code that starts or
kills a worker process and reads the cluster's resources.

Ray's failures become typed records here: a dead actor is a lost rank with Ray's reason, a
worker's `CollectiveError` is a broken generation, a factory that raised at start is a
`ConfigError`. Ray's error text is read only where Ray gives no type (an actor's constructor
error and its exit detail).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from elastic.actors.worker import WorkerActor
from elastic.adapt.lr import LrRamp
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer
from elastic.config import ChaosEvent, FitConfig
from elastic.control.decisions import gpu_worker_slots
from elastic.control.port import (
    ChunkDone,
    ChunkFailed,
    ChunkReport,
    EvalReport,
    Gathered,
    Hung,
    Member,
    Started,
)
from elastic.errors import (
    CollectiveError,
    ConfigError,
    ElasticError,
    GenerationOutOfMemoryError,
    WorkerLostError,
)
from elastic.job import TrainJob

logger = logging.getLogger(__name__)

_NODE_CHECK_S = 0.5  # while waiting on a generation, how often members' nodes are checked
_RELEASE_S = 10.0  # longest a worker that left on notice takes to exit before it is killed


class RayWorkers:
    """Worker actors of one run, by worker id.

    Args:
        job, config, run_dir, checkpoint_key: what every worker is built with.
        server: the run's rendezvous server (its endpoint and secret reach the workers only
            as arguments of `connect`).
    """

    def __init__(self, job: TrainJob, config: FitConfig, run_dir: str,
                 checkpoint_key: bytes | None, server: RendezvousServer,
                 controller: Any = None, origin: tuple[str, str] | None = None) -> None:
        self.job, self.config, self.run_dir = job, config, run_dir
        self._controller = controller  # where a worker reports a SIGTERM (`Controller.notify`)
        self._origin = origin  # the driver's elastic, which every worker must import too
        self._key = checkpoint_key
        self.server = server
        # Every worker started in this run, by worker id; a killed one keeps its handle, so a
        # call to it fails as a call to a dead worker does.
        self.actors: dict[int, Any] = {}
        self._killed: set[int] = set()
        self._node_of: dict[int, str] = {}  # worker id -> Ray node id
        self._starting: dict[Any, int] = {}  # info() ref -> worker id
        self._parked: dict[Any, int] = {}  # park() ref of each hot spare -> worker id
        self._preempted: set[int] = set()  # dead by their node's preemption (`preempted`)
        # Nodes no new worker is placed on (`avoid_node`; replaced whole, never changed in
        # place: a request thread adds while the run thread spawns).
        self._avoid: frozenset[str] = frozenset()
        self._next_id = 0
        # Chunks handed out and not finished, oldest first: (ids, ref -> rank); and the ticket
        # of the next one in this generation (the order in which each worker runs them).
        self._chunks: deque[tuple[list[int], dict[Any, int]]] = deque()
        self._ticket = 0
        self._generation = -1
        self._members: list[int] = []  # the last formed generation's worker ids, by rank
        self._chunk_lock = threading.Lock()  # `yield_chunks` comes from request threads

    # --- processes -----------------------------------------------------------------------------

    def now(self) -> float:
        return time.time()

    def spawn(self) -> int:
        worker_id, self._next_id = self._next_id, self._next_id + 1
        scaling = self.config.scaling
        actor = WorkerActor.options(
            num_cpus=scaling.cpus_per_worker, num_gpus=scaling.gpus_per_worker if scaling.use_gpu else 0,
            max_concurrency=6,  # a chunk, the one ahead, abort, progress, park
            **placement(self._avoid),
        ).remote(self.job, self.config, self.run_dir, worker_id, self._key, self._controller,
                 self._origin)
        self.actors[worker_id] = actor
        self._starting[actor.info.remote()] = worker_id
        return worker_id

    def avoid_node(self, node_id: str) -> None:
        """No worker started from now on is placed on Ray node `node_id` (hex): `elastic drain
        --node` let its workers go, and Ray, which knows nothing of that drain, would place
        their replacements there again."""
        self._avoid = self._avoid | {node_id}

    def starting(self) -> int:
        return len(self._starting)

    def joinable(self) -> bool:
        if not self._starting:
            return False
        ready, _ = ray.wait(list(self._starting), num_returns=1, timeout=0)
        return bool(ready)

    def admit(self, wanted: int | None, timeout: float) -> Started:
        if not self._starting:
            return Started([])
        refs = list(self._starting)
        num = len(refs) if wanted is None else min(wanted, len(refs))
        ready, _ = ray.wait(refs, num_returns=num, timeout=timeout)
        members, failed = [], []
        for ref in ready:
            worker_id = self._starting.pop(ref)
            try:
                info = ray.get(ref)
            except RayTaskError as e:
                failed.append(_user_start_error(e))
                self.kill(worker_id)
                continue
            except RayActorError as e:
                failed.append(_init_error(e) if getattr(e, "actor_init_failed", False)
                              else WorkerLostError(f"worker {worker_id} died while starting: "
                                                   f"{_death_reason(e)}"))
                self.kill(worker_id)
                continue
            self._node_of[worker_id] = info["node_id"]
            members.append(Member(info["worker_id"], info["pid"], info["node_id"],
                                  info["dataset_size"]))
        return Started(members, failed)

    def placeable(self) -> int:
        total = ray.cluster_resources()
        scaling = self.config.scaling
        count = int(total.get("CPU", 0.0) // scaling.cpus_per_worker)
        if scaling.use_gpu:
            gpus = [node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node["Alive"]]
            count = min(count, gpu_worker_slots(gpus, scaling.gpus_per_worker))
        return count

    def free_slot(self) -> bool:
        free = ray.available_resources()
        scaling = self.config.scaling
        if free.get("CPU", 0.0) < scaling.cpus_per_worker:
            return False
        # With a fraction of a GPU per worker, fractions left on several GPUs do not add up to
        # a place: `top_up` also keeps this run's workers within `placeable`.
        return not scaling.use_gpu or free.get("GPU", 0.0) >= scaling.gpus_per_worker - 1e-9

    def kill(self, worker_id: int) -> None:
        actor = self.actors.get(worker_id)
        if actor is not None and worker_id not in self._killed:
            self._killed.add(worker_id)
            ray.kill(actor, no_restart=True)

    def park(self, worker_id: int) -> None:
        self._parked[self.actors[worker_id].park.remote()] = worker_id

    def parked_lost(self) -> list[int]:
        if not self._parked:
            return []
        ready, _ = ray.wait(list(self._parked), num_returns=len(self._parked), timeout=0)
        lost = []
        for ref in ready:
            worker_id = self._parked.pop(ref)
            try:
                ray.get(ref)  # returned: a generation took it in meanwhile
            except (RayActorError, RayTaskError):
                lost.append(worker_id)
        return lost

    def preempted(self, ids: Sequence[int]) -> list[int]:
        found = [w for w in ids if w in self._preempted]
        self._preempted.difference_update(found)
        return found

    def _died(self, worker_id: int, e: RayActorError) -> str:
        """Ray's reason for worker `worker_id`'s death; notes a preemption (`preempted`)."""
        if getattr(e, "preempted", False):
            self._preempted.add(worker_id)
        return _death_reason(e)

    def release(self, worker_id: int) -> None:
        actor = self.actors.get(worker_id)
        if actor is None or worker_id in self._killed:
            return
        parked = [ref for ref, w in self._parked.items() if w == worker_id]
        if parked or worker_id in self._starting.values():
            # A spare (or a worker still starting) trains nothing: its `park` call would hold
            # a clean exit back forever, so it simply ends.
            for ref in parked:
                del self._parked[ref]
            self._starting = {r: w for r, w in self._starting.items() if w != worker_id}
            self.kill(worker_id)
            return
        self._killed.add(worker_id)  # calls to it now fail as calls to a dead worker do
        actor.__ray_terminate__.remote()  # a clean exit, after the calls queued before it
        # Killed if it has not exited by then (a step thread stuck in user code).
        timer = threading.Timer(_RELEASE_S, ray.kill, (actor,), {"no_restart": True})
        timer.daemon = True
        timer.start()

    def alive(self) -> list[int]:
        """Every worker started and not killed, members, spares and starting ones (from a
        request's thread too, while the run thread starts workers: a snapshot first, taken
        in one step under the interpreter lock)."""
        return [w for w in list(self.actors) if w not in self._killed]

    def shutdown(self) -> None:
        for worker_id in list(self.actors):
            self.kill(worker_id)
        self._starting = {}

    # --- generations -----------------------------------------------------------------------

    def connect(self, ids: Sequence[int], generation: int) -> Gathered[tuple[int, str]]:
        endpoint = str(self.server.endpoint)
        taken = set(ids)  # spares promoted into this generation: no longer watched
        self._parked = {ref: w for ref, w in self._parked.items() if w not in taken}
        with self._chunk_lock:
            self._chunks.clear()  # a new generation: chunks of the old one are abandoned
            self._ticket, self._generation = 0, generation
        refs = [self.actors[w].connect.remote(r, len(ids), endpoint, generation, self.server.secret)
                for r, w in enumerate(ids)]
        try:
            return self._gather(ids, refs)
        finally:
            self.server.forget(generation)

    def sync(self, ids: Sequence[int], src: int,
             leaving: Sequence[int] = ()) -> Gathered[dict[str, int]]:
        synced = self._gather(ids, [self.actors[w].sync.remote(src, list(leaving)) for w in ids])
        if all(value is not None for value in synced.values):
            self._members = list(ids)  # formed: the ranks of every member's ownership map
        return synced

    def _gather(self, ids: Sequence[int], refs: list[Any]) -> Gathered[Any]:
        """Waits for one ref per member, in completion order. At the first death or error
        every other member is aborted, so that nobody waits out a rendezvous or broadcast
        timeout for a peer that will never come (a lost node's workers, say)."""
        values: list[Any] = [None] * len(refs)
        dead: list[int] = []
        broken: list[str] = []
        out_of_memory: list[GenerationOutOfMemoryError] = []
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        aborted = False
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_NODE_CHECK_S)
            if not ready:
                # A worker process can outlive its node's raylet for a while and keep answering;
                # the node's death in Ray's membership is what counts.
                gone = self._on_dead_nodes(ids, [index[ref] for ref in pending])
                if not gone:
                    continue
                for rank in gone:
                    dead.append(rank)
                    self.kill(ids[rank])
                pending = [ref for ref in pending if index[ref] not in gone]
                rank = gone[0]
            else:
                rank = index[ready[0]]
                try:
                    values[rank] = ray.get(ready[0])
                    continue
                except RayActorError as e:
                    self._died(ids[rank], e)
                    dead.append(rank)
                except RayTaskError as e:
                    if isinstance(e.cause, GenerationOutOfMemoryError):
                        out_of_memory.append(e.cause)
                    elif not isinstance(e.cause, CollectiveError):
                        if isinstance(e.cause, ElasticError):  # ours, typed (a ConfigError)
                            self._abort_all_but(ids, rank)
                            raise e.cause from e
                        raise
                    else:
                        broken.append(f"rank {rank}: {str(e.cause).splitlines()[0]}")
            if not aborted:
                aborted = True
                self._abort_all_but(ids, rank)
        return Gathered(values, dead, broken, out_of_memory)

    def _abort_all_but(self, ids: Sequence[int], rank: int) -> None:
        for r, worker_id in enumerate(ids):
            if r != rank and worker_id in self.actors:
                self.actors[worker_id].abort.remote()

    def _on_dead_nodes(self, ids: Sequence[int], ranks: list[int]) -> list[int]:
        """The ranks among `ranks` whose node Ray's membership reports dead."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return [r for r in ranks if self._node_of.get(ids[r]) not in alive]

    # --- chunks --------------------------------------------------------------------------------

    def start_chunk(self, ids: Sequence[int], plan: BatchPlan, start: int, num_steps: int,
                    chaos: list[ChaosEvent], lr_ramp: LrRamp | None) -> None:
        with self._chunk_lock:
            ahead = bool(self._chunks)
            ticket, self._ticket = self._ticket, self._ticket + 1
            refs = {self.actors[w].run_chunk.remote(plan, num_steps, chaos, lr_ramp, ticket,
                                                    start, ahead, self._generation): r
                    for r, w in enumerate(ids)}
            self._chunks.append((list(ids), refs))

    def finish_chunk(self, hang_timeout: float, hung: Hung) -> ChunkReport:
        with self._chunk_lock:
            ids, refs = self._chunks[0]  # out until answered: `yield_chunks` may end it
        try:
            answers = self._answers(ids, refs, hang_timeout, hung)
        finally:
            with self._chunk_lock:
                self._chunks.popleft()
                behind = bool(self._chunks)
        done = [isinstance(o, ChunkDone) for o in answers.outcomes.values()]
        if behind and any(done) and not all(done) and not answers.lost:
            # Some ranks completed it and went on into the chunk behind, which the others
            # skip: release them from its first collective (a loss has done so already).
            self._abort_all_but(ids, -1)
        return ChunkReport(answers.outcomes, answers.lost, answers.detected, answers.hung)

    def yield_chunks(self) -> None:
        with self._chunk_lock:
            if not self._chunks:
                return
            ids, generation, ticket = self._chunks[-1][0], self._generation, self._ticket - 1
        for worker_id in ids:
            self.actors[worker_id].yield_chunks.remote(generation, ticket)

    def evaluate(self, ids: Sequence[int], shares: Sequence[int], chaos: list[ChaosEvent],
                 hang_timeout: float, hung: Hung, scheduled: bool) -> EvalReport:
        refs = {self.actors[w].evaluate_share.remote(tuple(shares), chaos, scheduled): r
                for r, w in enumerate(ids)}
        answers = self._answers(ids, refs, hang_timeout, hung)
        return EvalReport(answers.outcomes, answers.lost, answers.detected, answers.hung)

    def _answers(self, ids: Sequence[int], refs: dict[Any, int], hang_timeout: float,
                 hung: Hung) -> _Answers:
        """Waits for every rank's answer to one call on the generation (`refs`: ref -> rank).
        At the first loss, or when a rank leaves on its own (`ChunkFailed`), every other rank
        is aborted, so that none waits in a collective for it; ranks silent for `hang_timeout`
        are asked where they are and those `hung` names are killed."""
        outcomes: dict[int, Any] = {}
        lost: dict[int, str] = {}
        killed: list[tuple[int, str]] = []
        detected = 0.0
        remaining = list(refs)
        wait = hang_timeout
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=wait)
            wait = hang_timeout
            if not ready:
                found, wait = self._kill_hung(ids, [refs[r] for r in remaining], hung, hang_timeout)
                killed += found
                continue
            rank = refs[ready[0]]
            try:
                outcomes[rank] = ray.get(ready[0])
                left = isinstance(outcomes[rank], ChunkFailed) or getattr(
                    outcomes[rank], "broken", False)
                if left and remaining:
                    # It left the generation on its own (user code after a step raised, or
                    # out of memory in a collective): the others would wait for it in a
                    # collective.
                    self._abort_all_but(ids, rank)
            except RayActorError as e:
                lost[rank] = self._died(ids[rank], e)
                if len(lost) == 1:
                    detected = time.time()
                    # Release every survivor blocked in a collective with the dead worker.
                    self._abort_all_but(ids, rank)
        return _Answers(outcomes, lost, detected, killed)

    def _kill_hung(self, ids: Sequence[int], ranks: list[int], hung: Hung,
                   hang_timeout: float) -> tuple[list[tuple[int, str]], float]:
        """Asks the silent ranks where they are; kills the ones `hung` names. Returns them
        and how long to wait before asking again: until the youngest phase of a rank outside
        a collective is `hang_timeout` old (so a hang is found within one timeout of its
        start, not two)."""
        refs = {r: self.actors[ids[r]].progress.remote() for r in ranks}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        where = {rank: _where(ref) if ref in ready else ("unresponsive", float("inf"))
                 for rank, ref in refs.items()}
        killed = hung(where)
        for rank in killed:
            self.kill(ids[rank])
        young = [hang_timeout - age for rank, (phase, age) in where.items()
                 if rank not in killed and phase != "allreduce" and age < hang_timeout]
        wait = max(0.05, min(young)) if young else hang_timeout
        return [(rank, where[rank][0]) for rank in killed], wait

    # --- single calls --------------------------------------------------------------------------

    def call(self, worker_id: int, method: str, *args: Any) -> Any:
        if method == "checkpoint" and self.config.sharding.stage:
            # Sharded optimizer state: each other member writes its own shard of this write;
            # the writer takes their answers (passed as references: nothing goes through
            # here) and their actors, to list each shard in its manifest once it is on disk.
            # Members of the last generation killed since (a loss before a final checkpoint):
            # their parts are written by their next owner, if one lives.
            absent = [rank for rank, w in enumerate(self._members)
                      if w in self._killed or w not in self.actors]
            others = [self.actors[w] for w in self._members
                      if w != worker_id and w in self.actors and w not in self._killed]
            write = uuid.uuid4().hex
            args = ({**args[0], "write": write, "absent": absent},
                    [actor.checkpoint_shard.remote(write, absent) for actor in others], others)
        try:
            answer = ray.get(getattr(self.actors[worker_id], method).remote(*args))
        except RayActorError as e:
            raise WorkerLostError(f"worker {worker_id} died: {self._died(worker_id, e)}") from e
        except ObjectLostError as e:  # its answer lay on a node that died as it came back
            raise WorkerLostError(f"the answer of worker {worker_id} was lost with its node: "
                                  f"{type(e).__name__}") from e
        except RayTaskError as e:
            if isinstance(e.cause, ElasticError):  # ours, typed: the policy acts on it
                raise e.cause from e
            raise  # user code's error: Ray's error keeps the worker's traceback
        return answer

    def fired_kill(self, step: int, rank: int) -> float | None:
        path = os.path.join(self.run_dir, "chaos", f"kill-{step}-{rank}")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return float(f.read())


@dataclass(frozen=True)
class _Answers:
    """Every rank's answer to one call on a generation (the fields of a `ChunkReport`)."""

    outcomes: dict[int, Any]
    lost: dict[int, str]
    detected: float
    hung: list[tuple[int, str]]


def _where(ref: Any) -> tuple[str, float]:
    """The phase a worker's `progress` answer names and how long it has been in it ("dead",
    for ever, if it died meanwhile)."""
    try:
        answer = ray.get(ref)
    except RayActorError:
        return "dead", float("inf")
    return answer["phase"], answer["age"]


def placement(avoid: Collection[str]) -> dict[str, Any]:
    """Ray options that keep an actor off the nodes `avoid` (hex ids; every node has its id
    as the label `ray.io/node-id`), where this Ray has label selectors (2.49 and later);
    none before, with a warning: a worker may then land on such a node again."""
    if not avoid:
        return {}
    if _version(ray.__version__) < (2, 49):
        logger.warning("Ray %s has no node labels to select by (2.49 and later do): workers "
                       "started after `elastic drain --node` may land on the drained node "
                       "again", ray.__version__)
        return {}
    return {"label_selector": {"ray.io/node-id": f"!in({','.join(sorted(avoid))})"}}


def _version(text: str) -> tuple[int, ...]:
    """'2.60.1' -> (2, 60, 1); a development build's '3.0.0.dev0' -> (3, 0, 0)."""
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def _death_reason(e: RayActorError) -> str:
    """Ray's reason for an actor's death, in one line (its exit detail when it gives one)."""
    text = " ".join(str(getattr(e, "error_msg", None) or e).split())
    marker = "Worker exit detail: "
    if marker in text:
        text = text[text.index(marker) + len(marker):]
    return text[:300]


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
    """The error a worker's constructor raised (Ray passes it on only as text)."""
    lines = [line.strip() for line in str(getattr(e, "error_msg", e)).strip().splitlines()]
    last = next((line for line in reversed(lines) if line), "")
    own = "elastic.errors.ConfigError: "
    if last.startswith(own):
        return ConfigError(last[len(own):])
    return ConfigError(
        "a worker could not build the job (model, optimizer, scheduler or dataset factory "
        f"raised): {last}"
    )

