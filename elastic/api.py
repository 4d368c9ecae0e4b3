"""The public Python API: `fit` and run control by name. The CLI is a thin layer over this."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from elastic import control
from elastic.config import FitConfig, storage_root, with_job_settings
from elastic.control.requests import Drain, Events, Kill, Request, Scale, Status, Stop
from elastic.errors import ConfigError, ControllerBusyError, RunNotFoundError
from elastic.events import iter_jsonl
from elastic.job import TrainJob
from elastic.registry import LOST, RunRegistry, is_terminal, mark_lost, this_host
from elastic.runlog import read_jsonl

if TYPE_CHECKING:
    from elastic.checkpoint import LoadedCheckpoint
    from elastic.result import FitResult

# Ray and torch are imported where they are used: the control commands (`elastic status`,
# `list`, `scale`, `kill`, `stop`) must answer without paying seconds to import them.

# Set by Ray in the driver of a job submitted with `ray job submit` (ray._private.runtime_env.
# constants.RAY_JOB_CONFIG_JSON_ENV_VAR): the job's runtime environment, as JSON.
_RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def run_dir_of(run_dir: str | None, name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The absolute directory where run `name` keeps its record: `run_dir`
    (`FitConfig.run_dir`) if set, else `runs/NAME` under the current directory, except in the
    driver of a `ray job submit` job with a working directory, whose current directory is
    Ray's temporary copy of it (deleted with the session, or once the package is no longer
    used): there `$ELASTIC_HOME/run-dirs/NAME` (default `~/.elastic/run-dirs/NAME`), so that
    the events, metrics and final model outlive the job, as its record in the run index does."""
    if run_dir:
        return os.path.abspath(os.path.expanduser(run_dir))
    try:
        runtime_env = json.loads(environ.get(_RAY_JOB_CONFIG_ENV) or "{}").get("runtime_env") or {}
    except (ValueError, AttributeError):
        runtime_env = {}
    if isinstance(runtime_env, dict) and runtime_env.get("working_dir"):
        return os.path.join(storage_root(), "run-dirs", name)
    return os.path.abspath(os.path.join("runs", name))


def fit(job: TrainJob, config: FitConfig) -> FitResult:
    """Trains `job` data-parallel on Ray workers, through failures and resizes.

    Uses the connected Ray cluster, or starts a local one. Shows the run's progress when
    stdout is a terminal (`config.logging.progress`).

    Ctrl-C stops the run as `stop` does (after the step in flight; recorded as stopped, its
    weights left in the run dir's `final_model.pt`), then raises KeyboardInterrupt rather than
    returning: the caller asked to be interrupted. A second Ctrl-C abandons the run at once
    (recorded as failed with a KeyboardInterrupt). When `fit` runs on the main thread, SIGTERM
    (`ray job stop`, a container's stop) does the same and then raises SystemExit(143); a
    SIGTERM handler of the caller's is set aside meanwhile and put back after.

    Raises:
        KeyboardInterrupt: Ctrl-C, once the run has stopped (or been abandoned).
        SystemExit: SIGTERM (status 143), once the run has stopped (or been abandoned).
        UserCodeError: user code kept raising past `failure.max_user_retries`, or a callback
            raised (`CallbackError`).
        InsufficientWorkersError: fewer than `scaling.min_workers` workers for too long.
        StartupTimeoutError: the workers did not start in time.
        ConfigError: the job cannot be built (a factory raised or returned the wrong type).
        WorkerOutOfMemoryError: a worker ran out of memory even at micro-batch 1.
    """
    from elastic.actors import client
    from elastic.progress import follow
    from elastic.result import FitResult

    if not isinstance(job, TrainJob):
        raise TypeError(f"fit needs an elastic.TrainJob, got {type(job).__name__}")
    config = with_job_settings(config, job.settings, job.source)
    name = config.name or client.new_run_name()
    run_dir = run_dir_of(config.run_dir, name)
    with follow(run_dir, config.logging.progress):  # a bar on a terminal (LoggingConfig.progress)
        outcome = client.run_controller(job, config, name, run_dir)
    if outcome.error is not None:
        raise outcome.error
    assert outcome.model_state is not None
    return FitResult(
        name=name, run_dir=run_dir, model_state=outcome.model_state, steps=outcome.steps,
        samples=outcome.samples, events=outcome.events, metrics=outcome.metrics,
        evaluation=outcome.evaluation, stopped=outcome.stopped,
    )


def connect(config: FitConfig | None = None) -> None:
    """Connects this process to the Ray cluster (`RAY_ADDRESS`, or one running on this
    machine), or starts a local one sized for `config`. `fit` does this itself; call it first
    from the main thread when `fit` will run on other threads: a local cluster's processes
    die with the thread that started them."""
    from elastic.actors import client

    client.ensure_ray(config)


def start(job: TrainJob, config: FitConfig) -> str:
    """Starts a detached run and returns its name at once. The run survives the exit of this
    process; control it by name, read its record in its run dir (events.jsonl,
    metrics.jsonl, and `final_model.pt` when it finishes).

    Raises:
        ConfigError: no Ray cluster is running, or the name is taken.
    """
    from elastic.actors import client

    if not isinstance(job, TrainJob):
        raise TypeError(f"start needs an elastic.TrainJob, got {type(job).__name__}")
    config = with_job_settings(config, job.settings, job.source)
    name = config.name or client.new_run_name()
    run_dir = run_dir_of(config.run_dir, name)
    client.start_detached(job, config.model_copy(update={"name": name}), name, run_dir)
    return name


def runs(live_only: bool = False) -> list[dict[str, Any]]:
    """The runs this host knows of, newest first: every run whose controller ran here (live
    or ended, from the index under `ELASTIC_HOME`), plus, when `RAY_ADDRESS` names a cluster,
    its live runs whose controllers run elsewhere. Each is a record as `status` returns it;
    `state` is one of starting, running, recovering, resizing, finished, stopped, failed, or
    lost (the controller died before it could record an end).
    """
    records = [_refresh(r) for r in RunRegistry().all()]
    if os.environ.get("RAY_ADDRESS"):
        from elastic.actors import client

        known = {r["name"] for r in records}
        for name in client.live_run_names():
            if name not in known:
                try:
                    records.append(client.call(name, Status()))
                except RunNotFoundError:
                    continue  # it ended meanwhile
    if live_only:
        records = [r for r in records if not is_terminal(r) and r["state"] != LOST]
    return sorted(records, key=lambda r: r.get("started_at") or 0.0, reverse=True)


def events(name: str) -> list[dict[str, Any]]:
    """The events of run `name` so far (live or ended).

    Raises:
        RunNotFoundError: no such run.
    """
    return _control(name, Events())


def status(name: str) -> dict[str, Any]:
    """A snapshot of run `name`, live or ended: state, step, world size, workers, start and
    end times, last loss and, for a failed run, its error's class and message.

    `world_size`, `workers` and `generation` are the generation that trains (the ranks `kill`
    takes); a worker that is up but not yet in a generation counts in `joining_workers`, one
    still starting in `starting_workers`.

    Raises:
        RunNotFoundError: no such run.
    """
    return _control(name, Status())


def scale(name: str, num_workers: int) -> None:
    """Grows or shrinks run `name` at its next step boundary, within [min, max] workers.

    Raises:
        RunNotFoundError: no such live run.
        ConfigError: outside the run's bounds.
    """
    _control(name, Scale(num_workers))


def kill(name: str, rank: int) -> None:
    """Kills the worker at `rank` of run `name` (a drill: the run recovers).

    Raises:
        RunNotFoundError: no such live run.
        ConfigError: no such rank.
        ControllerBusyError: the run's controller took the kill but did not answer in time
            (it may have killed the worker; it is not asked again).
    """
    _control(name, Kill(rank))


def drain(name: str, *, rank: int | None = None, node: str | None = None,
          deadline: float | None = None) -> list[int]:
    """Lets the worker at `rank` of run `name`, or every worker on Ray node `node` (its hex id
    or a prefix of it, as `elastic status` shows), leave at the next step boundary: the
    others go on with the committed state, no step is redone, and a replacement starts. With
    `deadline` (seconds), a worker still training then is killed and the run recovers as from
    a failure. Returns the worker ids told to leave.

    Raises:
        RunNotFoundError: no such live run.
        ConfigError: neither or both of rank and node, no such rank or node, or a negative
            deadline.
    """
    return _control(name, Drain(rank, node, deadline))


def stop(name: str) -> None:
    """Stops run `name` gracefully at its next step boundary.

    Raises:
        RunNotFoundError: no such live run.
    """
    _control(name, Stop())


def _control(name: str, request: Request) -> Any:
    """Answers `request` for run `name`: through its control channel when its controller runs
    on this host (milliseconds), from its record when it has ended, else through Ray."""
    record = RunRegistry().read(name)
    if record is not None and not is_terminal(record) and _local(record):
        try:
            return control.call(record["control"], request)
        except control.ControlBusy as e:
            # A rank names another worker after a resize: a kill or drain of one may have
            # been carried out, and is not asked again through Ray.
            if isinstance(request, Kill) or (isinstance(request, Drain)
                                             and request.rank is not None):
                raise ControllerBusyError(
                    f"the controller of run {name!r} took the {request.verb} of rank "
                    f"{request.rank} but did not answer in time ({e}); it may have carried "
                    f"it out: see `elastic status {name}` before asking again") from None
            if isinstance(request, Status):  # as last published (Ray would wait on it)
                return RunRegistry().read(name) or record
            record = RunRegistry().read(name) or record
        except control.ControlUnavailable:
            record = RunRegistry().read(name) or record  # it may have ended just now
    if record is not None and is_terminal(record):
        return _from_record(record, request)
    # Not on this host, or its channel did not answer (a detached controller Ray is
    # restarting answers through Ray again): ask Ray.
    from elastic.actors import client

    try:
        return client.call(name, request)
    except RunNotFoundError as e:
        # Ray does not know it either: a local record was left by a controller that died
        # before recording an end; otherwise the cluster may still hold an ended run's record.
        ended = record if record is not None else client.cached_record(name)
        if ended is None:
            raise RunNotFoundError(f"{e} (nor is it in the run index, "
                                   f"{RunRegistry().directory})") from None
        if not is_terminal(ended):  # its controller is gone without recording an end ...
            if record is not None and not _local(record) and _unverifiable(record):
                # ... or runs where this process cannot ask (a run index on shared storage)
                raise RunNotFoundError(_unreachable(record, "set RAY_ADDRESS to that cluster "
                                                            "(or ask on its host)")) from None
            ended = mark_lost(ended)
        return _from_record(ended, request)


def _local(record: dict[str, Any]) -> bool:
    return bool(record.get("control")) and record.get("host") == this_host()


def _refresh(record: dict[str, Any]) -> dict[str, Any]:
    """A live record's current status from its controller, or the record marked lost."""
    if is_terminal(record) or not _local(record):
        return record
    try:
        return control.call(record["control"], Status())
    except control.ControlBusy:  # alive, and slow to answer: as last published
        return RunRegistry().read(record["name"]) or record
    except control.ControlUnavailable:
        again = RunRegistry().read(record["name"]) or record
        return again if is_terminal(again) else mark_lost(again)


def _refresh_anywhere(record: dict[str, Any],
                      force: bool = False) -> tuple[dict[str, Any], bool]:
    """As `_refresh`, and a live record of another host (a run index on shared storage) is
    asked of the connected Ray cluster: lost when the cluster does not know the run and is
    its own (the one its record names; a record of an older version names none). Returns
    the record and whether it could not be verified: a run of another cluster, or with no
    cluster to ask, may be live where this host cannot see, and stays as it is, unless
    `force` (its cluster is known to be gone)."""
    if is_terminal(record) or _local(record) or record.get("state") == LOST:
        return _refresh(record), False
    from elastic.actors import client

    try:
        return client.call(record["name"], Status()), False
    except RunNotFoundError:
        if not force and _unverifiable(record):
            return record, True
        again = RunRegistry().read(record["name"]) or record
        return (again if is_terminal(again) else mark_lost(again)), False


def _unverifiable(record: dict[str, Any]) -> bool:
    """Whether a live record of another host that the connected Ray cluster does not know
    may still be live: the record names another cluster, or there is none to ask."""
    from elastic.actors import client

    here, theirs = client.cluster_address(), record.get("cluster")
    return here is None or (theirs is not None and theirs != here)


def _unreachable(record: dict[str, Any], then: str) -> str:
    return (f"run {record['name']!r} is recorded {record['state']} on host {record.get('host')} "
            f"(Ray cluster {record.get('cluster')}), which this process cannot reach: {then}")


def _from_record(record: dict[str, Any], request: Request) -> Any:
    """What an ended (or lost) run can still answer: its status (the record) and events.

    Raises:
        RunNotFoundError: any other request.
    """
    match request:
        case Status():
            return record
        case Events():
            return read_jsonl(os.path.join(record["run_dir"], "events.jsonl"))
    what = f"{record['state']} at step {record['step']}"
    raise RunNotFoundError(f"run {record['name']!r} is not running ({what}); there is nothing to "
                           f"{request.verb}")


@contextlib.contextmanager
def recorded_launch(name: str, run_dir: str, target: str) -> Iterator[None]:
    """Records in `run_dir` that run `name` is started from `target` (`path.py:attr` or
    `package.module:attr`), for `resume` to start it again (`elastic.launch`), around the
    start of that run. A live run of that name is refused first: its launch record is never
    written over. If the start fails before the run began (no cluster, the name taken, a job
    that cannot be sent), the record of the earlier run of that name is put back: before, a
    `resume` of that run then trained the failed start's target on its checkpoints.

    Raises:
        ConfigError: a run of that name is live, or the run dir cannot be made private.
    """
    from elastic.launch import LAUNCH_FILE, write_launch
    from elastic.private import ensure_private_dir, write_private

    record = RunRegistry().read(name)
    if record is not None and not is_terminal(record) and record.get("state") != LOST:
        record, _ = _refresh_anywhere(record)
        if not is_terminal(record) and record.get("state") != LOST:
            raise ConfigError(f"a run named {name!r} is already {record['state']}; choose "
                              "another --name")
    ensure_private_dir(run_dir, "run_dir")  # before anything in it is read
    path, events = os.path.join(run_dir, LAUNCH_FILE), os.path.join(run_dir, "events.jsonl")
    earlier = _read_bytes(path)
    starts = _starts(events)
    write_launch(run_dir, target)
    try:
        yield
    except BaseException:
        if _starts(events) == starts:  # the run did not begin
            if earlier is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                write_private(path, earlier)
        raise


def _read_bytes(path: str) -> bytes | None:
    """The file at `path` (never through a link; None if there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _starts(events: str) -> int:
    """How many `start` events the run dir's `events.jsonl` holds."""
    return sum(record.get("event") == "start" for record in iter_jsonl(events))


def resume(name: str, job: TrainJob | None = None, *, num_workers: int | None = None,
           detach: bool = False, force: bool = False,
           overrides: Mapping[str, Any] | None = None) -> FitResult | str:
    """Starts lost, failed or stopped run `name` again from its newest valid checkpoint, with
    the configuration it started with (its `start` event), under the same name and run dir.

    Args:
        name: the run, as `elastic list` shows it.
        job: the `TrainJob` (needed for a run started from Python; a run started with
            `elastic run`/`start` is rebuilt from its recorded target).
        num_workers: another world size (the run's bounds widen to take it).
        detach: start it detached (as `start`) and return its name; else run it attached (as
            `fit`) and return its `FitResult`.
        force: resume although the target's file changed since the run started, or its
            record says it runs on a Ray cluster this process cannot reach (gone).
        overrides: dotted FitConfig fields to change (`{"logging.progress": "lines"}`).

    Raises:
        RunNotFoundError: no run of that name in the index.
        ConfigError: the run is still live, has no valid checkpoint, was started from Python
            and `job` is missing, or its target's file changed (without `force`).
    """
    from elastic.launch import file_sha256, read_launch, resume_config, target_file, update_launch
    from elastic.targets import load_target

    record = RunRegistry().read(name)
    if record is None:
        raise RunNotFoundError(f"no run named {name!r} in the run index "
                               f"({RunRegistry().directory})")
    record, unverified = _refresh_anywhere(record, force)
    if unverified:
        raise ConfigError(_unreachable(record, "stop it there, or, if that cluster is gone, "
                                               "resume with --force (force=True)"))
    launch = read_launch(record["run_dir"])
    config = resume_config(name, record, launch, num_workers, overrides)
    if job is None:
        if launch is None or launch.target is None:
            raise ConfigError(f"run {name!r} was started from Python with a TrainJob: pass it "
                              "again, elastic.resume(name, job=...)")
        path = target_file(launch.target, launch.cwd)
        if path is None:
            raise ConfigError(f"the target of run {name!r}, {launch.target!r}, cannot be found "
                              f"from here (it started in {launch.cwd}); run elastic resume there")
        digest = file_sha256(path)
        if launch.target_sha256 and digest != launch.target_sha256:
            if not force:
                raise ConfigError(
                    f"{path} changed since run {name!r} started (SHA-256 "
                    f"{launch.target_sha256[:12]}, now {(digest or 'missing')[:12]}); resume "
                    "with --force (force=True) to train the file as it is now")
            launch = update_launch(record["run_dir"], launch, digest)  # the file as it is now
        module_part, _, attr = launch.target.rpartition(":")
        spec = f"{path}:{attr}" if module_part.endswith(".py") else launch.target
        job = load_target(spec)
    job = _asked_over_implied(job, overrides, num_workers)
    checkpoint = config.checkpoint
    assert checkpoint is not None  # resume_config refuses a run without
    if not _has_checkpoint(checkpoint.path, checkpoint.key_file, checkpoint.sign):
        raise ConfigError(f"run {name!r} has no valid checkpoint under {checkpoint.path!r}: "
                          "nothing to resume from")
    return start(job, config) if detach else fit(job, config)


def _asked_over_implied(job: TrainJob, overrides: Mapping[str, Any] | None,
                        num_workers: int | None) -> TrainJob:
    """`job` without the settings it implies that a resume asks for otherwise (a longer
    max_steps, say: then the epochs it implies go too, as `resume_config` drops the run's)."""
    asked = set(overrides or ()) | ({"scaling.num_workers"} if num_workers is not None else set())
    if "max_steps" in asked:
        asked.add("epochs")
    if not asked:
        return job
    return dataclasses.replace(job, settings={k: v for k, v in job.settings.items()
                                             if k not in asked})


def _has_checkpoint(path: str, key_file: str | None, signed: bool) -> bool:
    """A complete checkpoint signed with the key (its manifest and file sizes; the run that
    resumes verifies every byte as it loads it)."""
    import os as _os

    from elastic.checkpoint.signing import default_key_file, read_key
    from elastic.checkpoint.store import has_complete_checkpoint

    key_path = key_file or default_key_file()
    if signed and not _os.path.exists(key_path):
        return False  # no key: nothing was signed with it
    return has_complete_checkpoint(path, read_key(key_path) if signed else None)


def load_checkpoint(path: str, step: int | None = None, *, key_file: str | None = None,
                    signed: bool = True, best: bool = False) -> LoadedCheckpoint | None:
    """The newest checkpoint under `path` whose manifest and checksums verify (or exactly
    `step`); None if there is none. `parts["model"]` is the model's state dict.

    Args:
        path: the checkpoint root (`CheckpointConfig.path`).
        step: exactly this step instead of the newest.
        key_file: the signing key (default `$ELASTIC_HOME/keys/checkpoint.key`, the one
            `fit` uses by default on this machine).
        signed: False loads checkpoints written with `CheckpointConfig(sign=False)`; their
            checksums still verify, but anyone who can write `path` could have replaced them.
        best: the one with the best monitored value instead (`CheckpointConfig.monitor`, by
            the metric and mode its manifests record); None if none records one.

    Raises:
        ValueError: both `step` and `best`.
        CheckpointCorruptError: `step` was given and that checkpoint does not verify (or is
            not signed with the key), or holds a pickle that would run code (it is refused,
            never executed).
        ConfigError: `signed` and there is no readable, private key file.
    """
    from elastic.checkpoint import load_checkpoint as _load_checkpoint
    from elastic.checkpoint.signing import default_key_file, read_key

    if best and step is not None:
        raise ValueError("load_checkpoint takes step or best=True, not both")
    key = read_key(key_file or default_key_file()) if signed else None
    if best:
        from elastic.checkpoint.store import best_checkpoint

        return best_checkpoint(path, key)
    return _load_checkpoint(path, step, key)
