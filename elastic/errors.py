"""The exception tree of `elastic`.

Every exception the library raises on purpose derives from `ElasticError`. Each class says in
its docstring what the system does about it (its recovery action); the controller's failure
policy maps class to action. Exceptions cross Ray actor boundaries, so any class with extra
fields defines `__reduce__` (a unit test pickles every class in this module).
"""

from __future__ import annotations

from typing import Any


class ElasticError(Exception):
    """Root of every error raised by `elastic`."""


class ConfigError(ElasticError, ValueError):
    """A configuration or argument the user gave is invalid.

    Recovery: none; nothing is started. The message names the setting to change.
    """


class CollectiveError(ElasticError):
    """A collective operation failed: a peer died, the connection broke, or it was aborted.

    Recovery: abort the communicator, rebuild a new generation from the survivors, and bring
    every rank to the newest committed step (restore).

    Example scenario: rank 2 is SIGKILLed during an allreduce; rank 1 sees its connection
    reset and rank 3 is released by the controller calling `abort()`.
    """

    def __init__(self, message: str, *, rank: int | None = None, generation: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.generation = generation

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {"rank": self.rank, "generation": self.generation}))


class CollectiveAbortedError(CollectiveError):
    """The communicator was aborted (by `abort()`, usually from the controller) while or before
    the operation ran.

    Recovery: as for `CollectiveError`; the abort is the controller's own doing.
    """


class CollectiveTimeoutError(CollectiveError):
    """A collective operation did not finish within `CollectiveConfig.timeout`.

    Recovery: as for `CollectiveError`. If it happens without any failure, raise
    `CollectiveConfig.timeout`.
    """


class RendezvousError(CollectiveError):
    """The ranks of a generation could not meet at the rendezvous endpoint in time.

    Recovery: retry with a new generation from the members that are alive.
    """


class BackendUnavailableError(ElasticError):
    """The requested collective backend cannot run here (for example `nccl` without CUDA or
    without the `gpu` extra installed).

    Recovery: none; pick another backend (`CollectiveConfig.backend`) or install
    `elastic[gpu]`.
    """


class MembershipChanged(ElasticError):
    """The set of workers changes at a step boundary (scale up or down, a replacement joins).

    Recovery: reconfigure the communicator without restoring state (every rank is at the
    same committed step).
    """


class WorkerLostError(ElasticError):
    """A worker process or its node died.

    Recovery: rebuild the ring from the survivors; restore the newest committed step from a
    peer; start a replacement in the background.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.step = step

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {"rank": self.rank, "step": self.step}))


class WorkerHangError(WorkerLostError):
    """A worker stopped making progress for longer than its watchdog timeout.

    Recovery: kill it, then as for `WorkerLostError`. Raise `FailureConfig.hang_timeout` if
    steps are legitimately that slow.
    """


class MembersLostError(WorkerLostError):
    """Every member died while the controller asked them something between chunks (a
    checkpoint, an evaluation, the final weights): nobody answered a chunk with the failure.

    Recovery: as for `WorkerLostError`, from the newest checkpoint (no member is left to hold
    the state); replacements start as usual.
    """


class HalfUpdatedError(ElasticError):
    """A worker was asked for its committed state (to checkpoint it, hand it to a peer or
    return the weights) while its model and optimizer are half updated: it ran out of memory
    during an optimizer step that it never committed.

    Recovery: the controller never takes such a worker's state; it restores it from a peer
    that committed the step, else from a checkpoint, else (at step 0) replaces it with a fresh
    worker.
    """


class StartupTimeoutError(ElasticError):
    """Workers did not start within `FailureConfig.startup_timeout`.

    Recovery: none when below `min_workers`; otherwise train with the workers that started.
    """


class InsufficientWorkersError(ElasticError):
    """Fewer than `ScalingConfig.min_workers` workers were available for longer than
    `FailureConfig.capacity_timeout`.

    Recovery: none; the run fails. Lower `min_workers` or add capacity.
    """


class UserCodeError(ElasticError):
    """User code (model, loss, dataset, optimizer) raised on a worker more often than
    `FailureConfig.max_user_retries` allows.

    Recovery: none; the run fails with the rank, step and original traceback.
    """

    def __init__(self, message: str, *, rank: int, step: int, traceback: str):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.traceback = traceback

    def __str__(self) -> str:
        return f"{self.args[0]} (rank {self.rank}, step {self.step})\n{self.traceback}"

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {"rank": self.rank, "step": self.step, "traceback": self.traceback}
        return (_rebuild_kw, (type(self), self.args[0], fields))


class AfterStepError(UserCodeError):
    """User code that runs once a step is applied (`TrainJob.lr_scheduler`, an extra state's
    `after_step`) raised; the step stays committed.

    Recovery: none: a retry would apply the step again; the run fails with the traceback.
    """


class EvaluationError(UserCodeError):
    """User code of a distributed evaluation (`TrainJob.eval_step`, `eval_dataset`) raised, or
    the ranks disagreed on its metric names or set size; `step` is the committed step it
    evaluated.

    Recovery: the evaluation runs again at the same step, up to
    `FailureConfig.max_user_retries` times (counted apart from the training steps' retries);
    then the run fails with the traceback.
    """


class CallbackError(UserCodeError):
    """A hook of a `TrainJob.callbacks` object raised; callbacks run in the controller
    process, so the error has no rank (`rank` is -1). The message names the callback's class
    and hook; `step` is the step of the record it was handed (else the committed step).

    Recovery: none: the run fails at once (a callback is never retried), with the traceback.
    """

    def __str__(self) -> str:
        return f"{self.args[0]} (step {self.step})\n{self.traceback}"


class _AtRankAndStep(ElasticError):
    """An error that names the rank and the step where it happened (both required).

    Recovery: none; the run fails (see the subclasses).
    """

    def __init__(self, message: str, *, rank: int, step: int):
        super().__init__(message)
        self.rank = rank
        self.step = step

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_kw, (type(self), self.args[0], {"rank": self.rank, "step": self.step}))


class WorkerOutOfMemoryError(_AtRankAndStep):
    """A worker ran out of memory at micro-batch size 1, so there is nothing left to back off.

    Recovery: none; the run fails with the rank and step. Smaller micro-batches were tried
    first (each out-of-memory error halves that rank's micro-batch and redoes the step); use a
    smaller model, more memory per worker, or more workers.
    """


class GenerationOutOfMemoryError(ElasticError):
    """A worker ran out of memory while a generation formed, before any step ran in it:
    while it built its communicator, took the newest state from a peer (its parts of the
    sharded optimizer state included), or loaded a checkpoint (`doing` says which).

    Recovery: the generation forms once more (the worker has freed its cached memory; what an
    earlier failure left behind may have been the cause). Out of memory again at the same
    step: the run fails with the rank, the generation and what it was doing (after a final
    checkpoint when it ran out connecting: no state had moved then). A smaller micro-batch changes
    nothing here: the model, its optimizer state (the worker's parts of it, when sharded) and
    the communicator's buffers must fit on each worker. Shard the optimizer state
    (`sharding.stage`, fewer `sharding.replicas`), give each worker more memory, or use a
    smaller model.
    """

    def __init__(self, message: str, *, rank: int, generation: int, doing: str):
        super().__init__(message)
        self.rank = rank
        self.generation = generation
        self.doing = doing

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_kw, (type(self), self.args[0], {
            "rank": self.rank, "generation": self.generation, "doing": self.doing}))


class NonFiniteLossError(_AtRankAndStep):
    """The loss or the gradients of a step were NaN or infinite on some rank, and
    `FailureConfig.nonfinite` is 'stop'.

    Recovery: none; the run fails with the first such rank and the step (its update was not
    applied on any rank). Use `nonfinite='skip'` to drop such steps instead.
    """


class CheckpointCorruptError(ElasticError):
    """A checkpoint's manifest or checksums do not verify, or it holds a forbidden payload.

    Recovery: skip it (with an event) and use the next newest valid checkpoint.
    """


class CheckpointUncommittedError(CheckpointCorruptError):
    """A step folder without a committed manifest: a write that was interrupted, or is still
    running; never a checkpoint, so nothing is lost by skipping it.

    Recovery: skipped like a corrupt one.
    """


class CheckpointSignatureError(CheckpointCorruptError):
    """A checkpoint is intact but not validly signed with the run's key: unsigned (written
    without signing, or planted), signed with another key, or altered.

    Recovery: skipped like a corrupt one; a run that finds nothing but these refuses to start
    over on top of them (`ConfigError` naming `checkpoint.key_file` and `checkpoint.sign`).
    """


class CheckpointTimeoutError(ElasticError):
    """Loading a checkpoint, or checking as a run starts that `checkpoint.path` can be written,
    did not finish within `CheckpointConfig.timeout`: the storage stopped answering (a hung
    NFS mount, an object store that never replies).

    Recovery: none; the run fails (a load: the state it needed is in no member). Once the
    storage answers again, `elastic resume` the run (or raise `checkpoint.timeout` if the
    storage is this slow).
    """


class RunNotFoundError(ElasticError):
    """No run with the given name exists on the connected cluster.

    Recovery: none; check the name with `elastic list`.
    """


class ControllerBusyError(ElasticError):
    """The run's controller took a request that must not be made twice (`kill`) but did not
    answer in time: it may have carried it out.

    Recovery: none here; see `elastic status` before asking again (asking again through Ray,
    as for other requests, could kill a second worker, another one after a resize).
    """


class ControllerError(ElasticError):
    """The controller failed for a reason that is not one of the typed errors above; it wraps
    the original exception.

    Recovery: none; the run fails. Report it as a bug with the attached cause.
    """


class InjectedFault(ElasticError):
    """A fault injected on purpose by `FitConfig.chaos` (tests and demos).

    Recovery: as for the failure it simulates; tests retry only on this type.
    """


def _rebuild(cls: type[Exception], args: tuple[Any, ...], fields: dict[str, Any]) -> Exception:
    exc = cls(*args)
    for key, value in fields.items():
        setattr(exc, key, value)
    return exc


def _rebuild_kw(cls: type[Exception], message: str, fields: dict[str, Any]) -> Exception:
    return cls(message, **fields)
