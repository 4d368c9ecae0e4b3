"""Starting a run's controller and reaching it by name from any process on the cluster."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import ray
from ray.experimental import internal_kv

from elastic import reaper
from elastic.actors.controller import (
    FINAL_MODEL,
    NAMESPACE,
    RECORD_KEY_PREFIX,
    Outcome,
    RemoteController,
    controller_name,
)
from elastic.checkpoint.signing import load_or_create_key
from elastic.checkpoint.store import serialize
from elastic.config import HOME_ENV, FitConfig
from elastic.control.requests import Request
from elastic.errors import ConfigError, RunNotFoundError
from elastic.job import TrainJob
from elastic.private import ensure_private_dir, open_private_append, write_private
from elastic.shipping import package_origin, shadowing_folder, unpicklable, user_modules

logger = logging.getLogger(__name__)


def ensure_ray(config: FitConfig | None = None, start: bool = True) -> None:
    """Connects to the current Ray cluster, or starts a local one when none is connected.

    A local cluster started here offers at least `max_workers` worker slots, even on fewer
    cores: workers are processes, and a small machine can run more of them than it has cores.
    """
    with _INIT_LOCK:
        if not ray.is_initialized():
            _init(config, start)
        _route_ray_messages()  # also where the caller connected Ray itself (idempotent)


# Control calls from other threads (an operator thread beside `fit`) may connect concurrently.
_INIT_LOCK = threading.Lock()
# The reaper of the local cluster this process started (`elastic.reaper`): held for as long
# as this process lives, since its pipe closing is what tells it to end the cluster.
_reaper: list[Any] = []


def _init(config: FitConfig | None, start: bool) -> None:
    kwargs: dict[str, Any] = {}
    address = os.environ.get("RAY_ADDRESS")
    if config is not None and address in (None, "", "local", "auto"):
        scaling = config.scaling
        wanted = (scaling.upper + scaling.spares) * scaling.cpus_per_worker  # spares: on top
        kwargs["num_cpus"] = max(os.cpu_count() or 1, int(wanted + 0.999))
    try:
        if address == "local":  # Ray's own word for a fresh local one
            raise ConnectionError("RAY_ADDRESS=local")
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=_worker_logs(),
                 logging_level=logging.WARNING)
        owner = throwaway_owner()
        if start and owner is not None and address in (None, "", "auto"):
            # Found by Ray's search of this machine's processes (no RAY_ADDRESS, no `ray
            # start`): another process's local cluster, which ends with that process and
            # every run on it. A run gets one of its own instead.
            ray.shutdown()
            raise ConnectionError(f"the local cluster of process {owner}")
    except ConnectionError:
        if not start:
            raise
        ray.init(address="local" if address in (None, "", "auto") else None,
                 namespace=NAMESPACE, log_to_driver=_worker_logs(),
                 logging_level=logging.WARNING, **kwargs)
        # This process started the cluster: it ends with this process, however that ends.
        node = getattr(ray._private.worker, "_global_node", None)
        if node is not None and getattr(node, "head", False):
            pids = [info.process.pid for infos in getattr(node, "all_processes", {}).values()
                    for info in infos if getattr(info, "process", None) is not None]
            for old in _reaper:  # a cluster of this process's that ray.shutdown() ended
                if old is not None and old.stdin is not None:
                    old.stdin.close()
            _reaper[:] = [reaper.start(pids)]
            internal_kv._internal_kv_put(THROWAWAY_KEY, str(os.getpid()).encode(),
                                         overwrite=True, namespace=NAMESPACE)


# Marks a local cluster that an elastic process started for its own runs, and that ends with
# it (`_init`): its value is that process's id.
THROWAWAY_KEY = "local-cluster-of"


def throwaway_owner() -> int | None:
    """The process whose own local cluster the connected one is (it ends with that process),
    if it is another process's; None for a cluster that outlives its starter."""
    value = internal_kv._internal_kv_get(THROWAWAY_KEY, namespace=NAMESPACE)
    try:
        owner = int(value) if value is not None else None
    except ValueError:
        return None
    return owner if owner != os.getpid() else None


def _worker_logs() -> bool:
    return os.environ.get("ELASTIC_WORKER_LOGS") == "1"


# Where Ray's driver-side notes about dead workers go: the log of the newest run this process
# started (a note can arrive just after its run ended).
_ray_log: dict[str, str | None] = {"path": None}
_WORKER_DEATH = "A worker died or was killed"


def _route_ray_messages() -> None:
    """Sends Ray's driver-side note about a dead worker (a raylet's "A worker died or was
    killed ... OOM killer ... SIGSEGV" after every kill) to the current run's `ray.log`
    instead of the terminal; Ray's other messages are left as they are. A worker killed on
    purpose is not a crash, and an unplanned death is reported by the run's own
    `worker_failure` event with Ray's reason.

    Ray prints these through `ray._private.worker.print_to_stdstream`, looked up at each
    call; where a Ray version lacks it, its messages are left as they are.
    """
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_elastic", False):
        return

    def to_run_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        path = _ray_log["path"]
        lines = data.get("lines", [])
        if path is None or not lines or not all(_WORKER_DEATH in line for line in lines):
            original(data, ignore_prefix)  # anything else of Ray's still reaches the terminal
            return
        try:
            fd = open_private_append(path)
            with os.fdopen(fd, "a") as f:
                for line in lines:
                    f.write(f"({data.get('pid', 'ray')}) {line}\n")
        except (OSError, ConfigError):
            original(data, ignore_prefix)

    to_run_log._elastic = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_run_log


def ship_job_code(job: TrainJob) -> None:
    """Makes the job's code travel with it: the user's modules that its factories reference
    (a script, a file target, a test module; see `elastic.shipping`) are pickled by value,
    so that workers on any node can run them without the file on their path."""
    factories = [getattr(job, field.name) for field in dataclasses.fields(job)]
    for module in user_modules(factories):
        ray.cloudpickle.register_pickle_by_value(module)


HEAD_RESOURCE = "node:__internal_head__"


def new_run_name() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def _launch(job: TrainJob, config: FitConfig, name: str, run_dir: str, detached: bool) -> Any:
    """Creates the named controller actor of a run (the job's code travels with it).

    Raises:
        ConfigError: the name is taken, or a factory cannot be pickled.
    """
    ship_job_code(job)
    try:
        ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ConfigError(f"a run named {name!r} is already running; choose another name")
    # On the head node: a controller on a worker node would die with that node. A detached
    # run's controller is restarted by Ray when its process dies and resumes from the newest
    # checkpoint (FailureConfig.controller_restarts).
    key = None
    if config.checkpoint is not None and config.checkpoint.sign:
        key = load_or_create_key(config.checkpoint.key_file)
    try:
        return RemoteController.options(
            name=controller_name(name), namespace=NAMESPACE, num_cpus=0, max_concurrency=16,
            lifetime="detached" if detached else None, resources={HEAD_RESOURCE: 0.001},
            max_restarts=config.failure.controller_restarts if detached else 0,
        ).remote(job, config, name, run_dir, detached, os.environ.get(HOME_ENV), key,
                 package_origin())
    except TypeError:  # Ray's "Could not serialize the argument TrainJob(...)", a page long
        problem = unpicklable({f.name: getattr(job, f.name) for f in dataclasses.fields(job)},
                              ray.cloudpickle.dumps)
        if problem is None:
            raise
        raise ConfigError(problem) from None


def _check_run_dir(run_dir: str) -> None:
    """The run folder is private and its event log can be written (no planted link or file),
    and no folder named elastic in the working directory would shadow the package in Ray's
    processes (they start there): refused here, in the caller's process, before any actor,
    with a ConfigError naming it."""
    shadow = shadowing_folder(os.getcwd())
    if shadow is not None:
        raise ConfigError(
            f"{shadow} would be imported as elastic by Ray's processes (they start in this "
            f"working directory) instead of the package at {package_origin()[0]}: rename it, "
            "or start the run from another directory")
    ensure_private_dir(run_dir, "run_dir")
    os.close(open_private_append(os.path.join(run_dir, "events.jsonl")))


def run_controller(job: TrainJob, config: FitConfig, name: str, run_dir: str) -> Outcome:
    """Starts the controller actor of a run and waits for its outcome (`_wait`: Ctrl-C or
    SIGTERM stops the run gracefully, a second one abandons it).

    Raises:
        ConfigError: the name is taken.
        KeyboardInterrupt: Ctrl-C, once the run has stopped (or been abandoned).
        SystemExit: SIGTERM (exit status 143), once the run has stopped (or been abandoned).
    """
    _check_run_dir(run_dir)  # before any actor: a refusal leaves nothing behind
    ensure_ray(config)
    _ray_log["path"] = os.path.join(run_dir, "ray.log")
    controller = _launch(job, config, name, run_dir, detached=False)
    try:
        return _wait(controller, name, run_dir)
    finally:
        ray.kill(controller, no_restart=True)


ABANDON_TIMEOUT_S = 10.0
"""How long a second interruption waits for the controller to record the run's end before
killing it."""

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
"""The exit status of a process that SIGTERM stopped (`SystemExit` from `fit`), as a shell
reports a process the signal killed."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[list[int]]:
    """While in it, SIGTERM (`ray job stop`, a scheduler's preemption, a container's stop)
    interrupts the main thread as SIGINT does, with a KeyboardInterrupt, instead of ending the
    process at once (or exiting through Ray's own handler); the handler before is restored
    after. It yields the SIGTERMs received, for the caller to tell the two apart: Ray turns
    an interruption of its waits into a KeyboardInterrupt of its own (and would swallow any
    other exception raised there). Elsewhere than the main thread nothing changes: signal
    handlers are set and run there only."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def terminated(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield received
    finally:  # None: a handler set from C, which Python cannot put back; the default then
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _interruption(received: list[int]) -> str:
    """What the KeyboardInterrupt just caught was: 'SIGTERM' (`received` one) or 'Ctrl-C'."""
    if received:
        received.clear()
        return "SIGTERM"
    return "Ctrl-C"


def _wait(controller: Any, name: str, run_dir: str) -> Outcome:
    """The outcome of the attached run `name`. A Ctrl-C (KeyboardInterrupt) or a SIGTERM stops
    the run as `elastic.stop` does: it ends after the step in flight, writes its final state,
    leaves `final_model.pt` in `run_dir` and is recorded as stopped; then KeyboardInterrupt
    (Ctrl-C) or SystemExit with status 143 (SIGTERM) is raised here. A second Ctrl-C or SIGTERM
    meanwhile abandons it: its controller records it as failed (KeyboardInterrupt, or
    SystemExit for SIGTERM; "interrupted", never "lost") and is killed with its workers.

    Raises:
        KeyboardInterrupt: after a Ctrl-C, once the run has stopped or been abandoned; its
            message says how the run ended.
        SystemExit: after a SIGTERM, likewise (status 143; how the run ended is printed).
    """
    pending = controller.run.remote()
    with _sigterm_interrupts() as received:
        try:
            return ray.get(pending)
        except ray.exceptions.RayActorError as e:
            # The controller's constructor refused (another elastic than this process's):
            # Ray passes its ConfigError on only as text.
            own = "elastic.errors.ConfigError: "
            lines = [line.strip() for line in str(getattr(e, "error_msg", e)).splitlines()]
            refusal = next((line for line in reversed(lines) if line.startswith(own)), None)
            if getattr(e, "actor_init_failed", False) and refusal is not None:
                raise ConfigError(refusal[len(own):]) from None
            raise
        except KeyboardInterrupt:
            by = _interruption(received)
        try:
            _say(f"interrupted ({by}): stopping run {name} after the current step "
                 f"({by} again to abandon it)")
            in_time = ray.get(controller.interrupt.remote())
            outcome = ray.get(pending)
        except KeyboardInterrupt:
            again = _interruption(received)
            _abandon(controller, name, f"interrupted: abandoned by a second {again} before it could stop",
                     as_exit=by == "SIGTERM")
            line = (f"run {name} was abandoned by a second {again} before it could stop (recorded as "
                    f"failed: {'SystemExit' if by == 'SIGTERM' else 'KeyboardInterrupt'})")
            _raise_interrupted(by, line, None)
    path = os.path.join(run_dir, FINAL_MODEL)
    unwritten = [e.get("error") for e in outcome.events if e.get("event") == "final_model_failed"]
    if not in_time and outcome.model_state is not None:  # it had ended: keep its weights too
        try:
            write_private(path, serialize(outcome.model_state))
        except (OSError, MemoryError) as e:
            unwritten.append(f"{type(e).__name__}: {e}")
    how = "failed" if outcome.error is not None else "stopped" if outcome.stopped else "finished"
    line = f"run {name} {how} at step {outcome.steps} (interrupted by {by})"
    if outcome.error is not None:
        line += f": {type(outcome.error).__name__}: {outcome.error}"
    elif unwritten:  # before, the line named the file all the same
        line += (f"; its final model could not be written to {path} ({unwritten[-1]}): its "
                 "newest checkpoint, if any, holds the weights")
    else:
        line += f"; its final model is in {path}"
    _raise_interrupted(by, line, outcome.error)


def _abandon(controller: Any, name: str, reason: str, as_exit: bool) -> None:
    """Has the controller record run `name` as failed with `reason` before it is killed."""
    _say(f"abandoning run {name}")
    try:
        ray.get(controller.abandon.remote(reason, as_exit), timeout=ABANDON_TIMEOUT_S)
    except ray.exceptions.RayError as e:  # it could not record its end: it reads as lost
        logger.warning("run %s: could not record its end before it was killed: %s", name, e)


def _raise_interrupted(by: str, line: str, cause: BaseException | None) -> None:
    """KeyboardInterrupt(line) after a Ctrl-C; after a SIGTERM, `line` on stderr and
    SystemExit(143), the status of a process the signal ended."""
    if by == "SIGTERM":
        _say(line)
        raise SystemExit(SIGTERM_EXIT_STATUS) from cause
    raise KeyboardInterrupt(line) from cause


def _say(line: str) -> None:
    """One line to the person at the terminal (stderr: a progress bar on stdout stays whole)."""
    print(line, file=sys.stderr, flush=True)


def start_detached(job: TrainJob, config: FitConfig, name: str, run_dir: str) -> None:
    """Starts a run whose controller is a named, detached actor and returns at once.

    Raises:
        ConfigError: no Ray cluster is running (a detached run needs one that outlives this
            process), or the name is taken.
    """
    _check_run_dir(run_dir)
    try:
        ensure_ray(config, start=False)
    except ConnectionError as e:
        raise ConfigError(
            "a detached run needs a running Ray cluster that outlives this process: start one "
            "with `ray start --head` (or pass --address); `elastic run` uses a local one"
        ) from e
    if any(r is not None for r in _reaper):  # the cluster is this process's own (`connect`)
        raise ConfigError(
            "a detached run needs a Ray cluster that outlives this process, but the connected "
            "one was started by it and ends with it: start one with `ray start --head` (or "
            "pass --address)")
    owner = throwaway_owner()
    if owner is not None:  # another `elastic run`'s, or a script's `fit`
        raise ConfigError(
            "a detached run needs a Ray cluster that outlives this process, but the one found "
            f"here is the local cluster of process {owner} (an `elastic run` or `fit`), which "
            "ends with it and every run on it: start one with `ray start --head` (or pass "
            "--address)")
    controller = _launch(job, config, name, run_dir, detached=True)
    # Wait until it exists (its constructor ran), so that status works right after this.
    ray.get(controller.status.remote())


def live_run_names() -> list[str]:
    """Names of the runs whose controllers are alive on the connected cluster (none if no
    cluster is running)."""
    try:
        ensure_ray(start=False)
    except ConnectionError:
        return []
    prefix = controller_name("")
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))


def find(name: str) -> Any:
    """The controller of run `name`.

    Raises:
        RunNotFoundError: no such run on the connected cluster.
    """
    try:
        # Looking a run up never starts a cluster: a new one could not hold the run.
        ensure_ray(start=False)
    except ConnectionError as e:
        raise RunNotFoundError(
            f"no run named {name!r}: cannot connect to a Ray cluster to ask (set RAY_ADDRESS; "
            f"with token authentication also RAY_AUTH_MODE=token): {e}"
        ) from e
    try:
        return ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError as e:
        raise RunNotFoundError(f"no run named {name!r} on this Ray cluster") from e


def call(name: str, request: Request) -> Any:
    """Sends a control request to run `name`'s controller through Ray and returns its answer
    (`Controller.answer`).

    Raises:
        RunNotFoundError: no live run of that name on the connected cluster.
    """
    controller = find(name)
    try:
        return ray.get(controller.answer.remote(request))
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    except ray.exceptions.ActorDiedError as e:  # the run ended (or its node died) as it was asked
        # (not ActorUnavailableError: a controller Ray is restarting answers again later)
        raise RunNotFoundError(f"run {name!r} ended as it was asked (its controller is gone: "
                               f"{type(e).__name__})") from None


def cluster_address() -> str | None:
    """The GCS address of the Ray cluster this process is connected to, or can connect to
    (never starts one); None without one."""
    try:
        ensure_ray(start=False)
        return ray.get_runtime_context().gcs_address
    except ConnectionError:
        return None


def cached_record(name: str) -> dict[str, Any] | None:
    """The record an ended run left in the connected cluster's key-value store, if any."""
    try:
        ensure_ray(start=False)
    except ConnectionError:
        return None
    value = internal_kv._internal_kv_get(RECORD_KEY_PREFIX + name, namespace=NAMESPACE)
    return json.loads(value) if value else None
