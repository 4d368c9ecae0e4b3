"""One worker's replica of the model and its part of each global step.

The step contract (DESIGN.md): rank r of a generation takes its share of the global batch,
runs forward/backward per micro-batch with each micro-batch's mean loss scaled by
`len/B` (or a `LossSum` total as is, the summed gradients then divided by the global count),
and the gradients are summed over ranks in one allreduce, so that every rank applies
the same optimizer step as one process with batch B would. The same allreduce carries the
summed loss (and count), one error flag per rank (a rank whose user code raised votes the step down on
every rank, so nobody is left waiting in the collective), and with the ledger on the indices
the step consumed, so that what is recorded is exactly what was committed. `run_step` drives
the step's phases (compute, reduce, verdict, apply); `elastic.trainer.step` says what each
one guarantees and holds what passes between them.

The replica computes on its device (`elastic.trainer.device`): the model is moved there before
the optimizer is built (so that the optimizer's state is allocated there), each batch is moved
there after it is loaded, and the gradient buffers live there. The step's metadata stays in
host memory (float64) and travels over the control plane.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from elastic.adapt.groups import decide_grouping
from elastic.adapt.plan import BatchPlan
from elastic.collective import Communicator
from elastic.config import ChaosEvent, ChaosPhase, FitConfig
from elastic.errors import ConfigError, HalfUpdatedError
from elastic.job import TrainJob
from elastic.trainer.apply import apply_step
from elastic.trainer.buffers import BufferSync
from elastic.trainer.build import (
    built_data,
    built_model,
    built_optimizer,
    model_traits,
    random_layer,
    start_loaders,
)
from elastic.trainer.compute import ahead, compute
from elastic.trainer.data import Cursor
from elastic.trainer.device import (
    MoveBatch,
    default_move,
    is_allocation_failure,
)
from elastic.trainer.exact import ExactSum, make_deterministic
from elastic.trainer.faults import FaultInjector, Progress, chaos_kill
from elastic.trainer.outcomes import NonFinite, OutOfMemory, StepRecord, UserFailure
from elastic.trainer.reducers import Reducer, SoloReducer, left_collectives, make_reducer, with_metric_names
from elastic.trainer.sharding import OptimizerShards, check_shardable, sync_sharded
from elastic.trainer.staging import CudaStreams, HostStaging
from elastic.trainer.state import (
    committed_state,
    load_committed,
    max_state_bytes,
    state_bytes,
    state_from_bytes,
    sync_state,
)
from elastic.trainer.step import (
    Commit,
    Computed,
    Reduced,
    Rescale,
    StepContext,
    Vote,
    pack_meta,
    verdict,
)

# The outcome types, `Progress` and `chaos_kill` are part of this module's interface (the worker
# actor imports them here).
__all__ = ["NonFinite", "OutOfMemory", "Progress", "Replica", "StepRecord", "UserFailure",
           "chaos_kill", "max_state_bytes", "random_layer"]

logger = logging.getLogger(__name__)

# The chaos phases after the reduce (a redone step keeps their faults).
_LATE = ("optimizer", "gather")
# Exact mode: redos of one step at a wider scale before giving up (each widens by up to 50+
# bits, so a float64 gradient from 2**8 to 2**1024 takes about 20).
_MAX_RESCALES = 40
class Replica:
    """Model, optimizer, scheduler and data of one worker.

    Args:
        job: the user's factories.
        config: the run's configuration.
        run_dir: where chaos kill timestamps are written (for recovery timing).
        device: where the model, the batches and the gradients live
            (`elastic.trainer.device.resolve_device`; the worker actor binds it as its
            thread's current CUDA device first). Default: the CPU.
    """

    # The step whose optimizer step began here and was not committed (it ran out of memory:
    # `_apply_out_of_memory`), leaving the model and the optimizer half updated; None once
    # the step is committed or a committed state is loaded.
    torn_at: int | None = None
    # Exact mode's exponents before the step being applied (a held step dropped restores them:
    # `elastic.trainer.apply._hold`).
    _exponents: list[int] = []
    # Sharded state: the end of a committed step whose gather failed, until the next
    # generation forms.
    unfinished: Callable[[], None] | None = None

    def __init__(self, job: TrainJob, config: FitConfig, run_dir: str,
                 device: torch.device | None = None) -> None:
        self.job = job
        self.config = config
        self.run_dir = run_dir
        self.device = device if device is not None else torch.device("cpu")
        # A CPU worker passes its batches through as the collate function made them.
        self.move: MoveBatch = job.move_batch or default_move(self.device)
        scaling = config.scaling
        if config.batch.exact:
            make_deterministic(scaling.threads_per_worker or max(1, int(scaling.cpus_per_worker)))
        elif scaling.threads_per_worker is not None:
            torch.set_num_threads(scaling.threads_per_worker)
        torch.manual_seed(config.seed)
        self.model = built_model(job)
        self.model.to(self.device)  # before the optimizer: its state follows the parameters
        self.optimizer, self.scheduler, self.training, self.extra = built_optimizer(
            job, self.model, config.training)
        self.metric_names: tuple[str, ...] = ()  # committed: the same on every rank
        data = built_data(job, config)
        self.dataset, self.collate, self.order = data.dataset, data.collate, data.order
        self.cursor = Cursor()
        self.faults = FaultInjector(run_dir)
        self.progress: Progress = self.faults.progress
        self.comm: Communicator | None = None
        # Whether the controller asked this rank to end its chunk (read as a step's metadata
        # is packed; the worker actor sets it per chunk).
        self.yielding: Callable[[], bool] = lambda: False
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        # Parameters frozen when the model was built: none may start training later (`_begin`).
        self._frozen = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]
        self._modules, self._own_train, self._modes = self._training_modes()
        self.shards = self._shards()
        self.buffers = BufferSync(self.model)
        collective = config.collective
        self._loss_slot = len(self._params)  # exact mode's slot of the loss
        self.exact = self._exact_sums() if config.batch.exact else None
        keep = self._kept_grads()
        # How the gradients are summed: exact sums, buckets that overlap the backward pass,
        # or flat buffers after it (`elastic.trainer.reducers`), chosen once for generations
        # of several ranks.
        self.reducer: Reducer = make_reducer(
            self, self._params, collective.overlap_enabled, collective.bucket_bytes,
            collective.first_bucket_bytes, self.exact, self._loss_slot,
            keep=keep, norms=config.training.clip_grad_norm is not None
            or config.training.clip_grad_value is not None, staging=self._staging())
        self._several = self.reducer
        # A generation of one rank leaves the gradients where they are (none at stage 2,
        # whose reducer keeps the rank's share of each sum, nor in exact mode, whose integer
        # sums make the bits independent of the world size).
        self._solo = SoloReducer(self._params) if self.exact is None and keep is None else None
        # Last: nothing above may fail after loader processes exist.
        self.prefetcher = start_loaders(job, config.data, data.rng_state, data.built_in,
                                        self.device)

    def _shards(self) -> OptimizerShards | None:
        """Sharded optimizer state: the parts this rank owns (`elastic.trainer.sharding`)."""
        if not self.config.sharding.stage:
            return None
        check_shardable(self.optimizer)
        sharding = self.config.sharding
        return OptimizerShards(self._params, self.optimizer, sharding.replicas,
                               sharding.max_state_bytes_per_element)

    def _staging(self) -> HostStaging | None:
        """GPU workers on the host plane (no NCCL): their gradients are summed in host memory
        (`elastic.trainer.staging`); not in exact mode, whose integer sums are made apart."""
        if (self.device.type != "cuda" or self.config.collective.backend == "nccl"
                or self.config.batch.exact):
            return None
        return HostStaging(CudaStreams())

    def _kept_grads(self) -> Callable[[], frozenset[int]] | None:
        """Sharding stage 2: the parts whose summed gradients this rank keeps (those it owns
        as each step begins); None: every rank keeps every sum."""
        shards = self.shards
        if shards is None or self.config.sharding.stage < 2:
            return None
        return lambda: shards.owned

    def close(self) -> None:
        """Stops the loader processes (they also exit by themselves when this process dies)
        and releases what the reducer holds (on the host plane: its registered region,
        unregistered before its mapping goes)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.reducer.release()

    def _exact_sums(self) -> ExactSum:
        """Exact mode's slots: every parameter's gradient, the loss, the `LossSum` count, then
        the BatchNorm running statistics; the groups per step as the controller cuts them."""
        batch, traits = self.config.batch, self.traits()
        grouping = decide_grouping(batch.groups, batch.group_size, batch.global_batch_size,
                                   self.config.scaling.num_workers, batch.policy,
                                   traits["batchnorm"], traits["dropout"], batch.max_micro_batch,
                                   exact=True)
        sizes = [p.numel() for p in self._params] + [1, 1] + self.buffers.slot_sizes()
        exact = ExactSum(sizes, batch.global_batch_size // grouping.size)
        self.buffers.attach(exact, self._loss_slot + 2)
        return exact

    # --- state --------------------------------------------------------------------------

    def traits(self) -> dict[str, int]:
        """What the controller needs to know about the model to cut the batch
        (`elastic.trainer.build.model_traits`)."""
        return model_traits(self.model)

    def eval_step(self, model: torch.nn.Module, batch: Any) -> Any:
        """`TrainJob.eval_step` on a batch of the evaluation set: moved as the training
        batches are, under the run's mixed precision (autocast, as the training forward;
        Lightning and the Hugging Face Trainer evaluate so)."""
        eval_step = self.job.eval_step
        assert eval_step is not None, "the job has no eval_step"
        with self.training.autocast(model):
            return eval_step(model, self.move(batch, self.device))

    def state(self) -> dict[str, Any]:
        """The committed state (`elastic.trainer.state.committed_state`).

        Raises:
            HalfUpdatedError: this replica is half updated (`torn_at`).
        """
        return committed_state(self)

    def load_state(self, state: dict[str, Any], origin: str = "checkpoint") -> None:
        """Takes a committed state (`elastic.trainer.state.load_committed`; `origin`:
        'checkpoint' or 'peer').

        Raises:
            ConfigError: exact mode, and the state was written under another environment.
        """
        parts = None
        if self.shards is not None and origin == "checkpoint":
            # What this rank kept of a step of the timeline the checkpoint replaces goes first
            # (dropping it rolls buffers and exponents back; the checkpoint overwrites them).
            pending, self.shards.pending, self.unfinished = self.shards.pending, None, None
            if pending is not None:
                pending.drop()
            # A checkpoint holds the whole optimizer state: it waits in host memory, and the
            # generation that forms next gives each rank the parts it owns (installed into
            # one optimizer, it would be every part's state on one device).
            optimizer = state["optimizer"]
            parts = optimizer.get("state", {})
            state = {**state, "optimizer": {**optimizer, "state": {}}}
        load_committed(self, state, origin)
        if self.shards is not None and parts is not None:
            self.shards.load_whole(parts)

    def state_bytes(self) -> bytes:
        """The committed state, serialised for a peer (with sharded state, without the
        optimizer's per-parameter state: that moves part by part)."""
        state = self.state()
        if self.shards is not None:
            # Nor the parameters: as a generation forms, every rank has taken them from their
            # holders over the data plane already (`OptimizerShards.take_values`); a second
            # copy of the whole model over the control plane would be the largest transfer of
            # the recovery. Buffers (BatchNorm statistics) still come from here.
            state["optimizer"] = {**state["optimizer"], "state": {}}
            names = self._part_names()
            state["model"] = _with_metadata(
                state["model"], ((k, v) for k, v in state["model"].items() if k not in names))
        return state_bytes(state)

    def _part_names(self) -> set[str]:
        """The state-dict names of the sharded parts (the parameters that take gradients:
        each rank takes their values over the data plane as a generation forms); a frozen
        parameter is not one, and travels with the rest of the state."""
        assert self.shards is not None
        parts = {id(p) for p in self.shards.params}
        return {name for name, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in parts}

    def load_state_bytes(self, data: bytes) -> None:
        """Takes a peer's committed state (`state_bytes`). With sharded state its parameters
        are this rank's own, which `OptimizerShards.take_values` set as the generation formed
        (`sync_sharded` runs it first)."""
        state = state_from_bytes(data)
        if self.shards is not None:  # the parameters this rank took as the generation formed
            own = self.model.state_dict()
            state["model"] = _with_metadata(state["model"], [
                *((k, own[k]) for k in self._part_names() if k in own),
                *state["model"].items()])
        self.load_state(state, origin="peer")

    def sync_from(self, src: int, leaving: Sequence[int] = ()) -> None:
        """Every rank of the generation calls this; afterwards all hold `src`'s state
        (`elastic.trainer.state.sync_state`), with sharded state the newest step's parts from
        their holders (`elastic.trainer.sharding.sync_sharded`; the ranks in `leaving` hand
        theirs over and own none)."""
        comm = self._comm()
        if self.shards is None:
            sync_state(self, comm.control, src)
        else:
            sync_sharded(self, comm, src, lambda: sync_state(self, comm.control, src), leaving)

    @property
    def global_step(self) -> int:
        """Steps committed."""
        return self.cursor.step

    def check_committed(self) -> None:
        """Raises `HalfUpdatedError` if this replica is half updated (`torn_at`)."""
        if self.torn_at is not None:
            raise HalfUpdatedError(
                f"this worker ran out of memory in the optimizer step of step {self.torn_at}; "
                "its model and optimizer are half updated and hold no committed state to save "
                "or send")

    @property
    def restorable_step(self) -> int:
        """The committed step this replica can hand to its peers: `global_step`, or -1 when
        it is half updated (`torn_at`), so that a new generation never restores from it."""
        return -1 if self.torn_at is not None else self.global_step

    def registered_bytes(self) -> int:
        """Shared memory to ask the communicator to lend for the flat gradient buffers
        (`Communicator(shared_bytes=...)`; `FlatReducer.registered_bytes`): 0 when the step
        reduces no flat host buffers (buckets, exact mode, or gradients on a GPU)."""
        return self._several.registered_bytes()

    def _training_modes(self) -> tuple[list[torch.nn.Module], bool, list[bool]]:
        """The model's modules, whether one overrides train() (to keep a BatchNorm frozen,
        say: then train() is called every step, `_begin`), and the mode each trains in: the
        one the factory left it in (a layer it put in eval mode, a frozen BatchNorm, stays so,
        as in a plain loop that never calls train()); a model built for inference
        (`from_pretrained`) is put in training mode first."""
        modules = list(self.model.modules())
        own = any(type(m).train is not torch.nn.Module.train for m in modules)
        if not self.model.training:
            self.model.train()
        return modules, own, [m.training for m in modules]

    def _comm(self) -> Communicator:
        assert self.comm is not None, "replica has no communicator; connect first"
        return self.comm

    # --- the step -----------------------------------------------------------------------

    def _enter(self, phase: str) -> None:
        self.faults.enter(phase)

    def _chaos(self, events: Sequence[ChaosEvent], phase: ChaosPhase) -> None:
        self.faults.fire(events, phase)

    def run_step(self, plan: BatchPlan, chaos: list[ChaosEvent],
                 lr_factor: float = 1.0) -> StepRecord | UserFailure | OutOfMemory | NonFinite:
        """Runs one global step on this rank: compute, reduce, verdict, apply.

        Args:
            plan: this generation's shares and micro-batches.
            chaos: this rank's faults to inject at this step.
            lr_factor: scales the learning rate of this step only (batch policy
                'scale_with_workers').

        Returns:
            The record of the committed step, or the outcome that voted it down on every rank
            (user error, out of memory, non-finite under the policy 'stop'); then nothing was
            applied and the step can be redone.

        Raises:
            CollectiveError: the reduce failed or was aborted, or this rank ran out of memory
                in the apply phase (`_apply_out_of_memory`); the step is not committed here.
        """
        context = self._begin(plan, chaos, lr_factor)
        if self.exact is not None and context.pieces != self.exact.groups:
            # Its integers are sized for that many groups; more would overflow their sums.
            raise ConfigError(f"batch.exact: a plan of {context.pieces} forward passes for "
                              f"{self.exact.groups} groups of the global batch")
        exponents = list(self.exact.exponents) if self.exact is not None else []
        self._exponents = exponents
        for rescaled in range(_MAX_RESCALES + 1):  # noqa: B007 (read after the loop)
            computed = self._compute(context)
            try:
                reduced = self._reduce(context, computed)
                reduced = with_metric_names(self, context, computed, reduced)
            except BaseException as e:
                self._abandon(exponents)
                if is_allocation_failure(e):  # past the allocations the vote covers
                    raise left_collectives(context, e) from e
                raise
            outcome = verdict(context.step, reduced.votes, self.training.nonfinite_policy(
                              self.config.failure.nonfinite),
                              computed.user_traceback, reduced.forms, reduced.count)
            if not isinstance(outcome, Rescale):
                break
            assert self.exact is not None
            self.exact.rescale()  # every rank alike: the overflow is summed over ranks
            self.buffers.rollback()
            self.buffers.begin(context.pieces)
            self.drop_grads()
            # Injected faults fire once: those of the phases already run are dropped.
            context = replace(context, chaos=tuple(e for e in context.chaos if e.phase in _LATE))
        else:
            raise ConfigError(f"batch.exact: step {context.step}'s values still did not fit the "
                              f"fixed-point scale after {_MAX_RESCALES} rescales")
        if self.exact is not None and not (isinstance(outcome, Commit) and not outcome.skipped):
            self.exact.exponents = exponents  # only an applied step moves them for good
        if isinstance(outcome, Commit):
            record = apply_step(self, context, computed, reduced, outcome)
            return replace(record, rescaled=rescaled) if rescaled else record
        self.buffers.rollback()
        self.drop_grads()
        self._enter("idle")
        return outcome

    def _begin(self, plan: BatchPlan, chaos: list[ChaosEvent], lr_factor: float) -> StepContext:
        """Fixes what the step reads and clears the gradients (allocating nothing on the
        device: the compute phase allocates, inside the step's vote)."""
        comm = self._comm()
        rank = comm.rank
        step = self.global_step
        thawed = next((name for name, p in self._frozen if p.requires_grad), None)
        if thawed is not None:
            raise ConfigError(
                f"parameter {thawed!r} was frozen when the model was built (requires_grad="
                "False) and trains now: the gradients summed over the workers are those of the "
                "parameters that trained at the start, so its gradient would stay each worker's "
                "own and the workers' weights would part. Build the model with every parameter "
                "that will ever train set to requires_grad=True (hold one still with a "
                "learning rate of 0 in a parameter group of its own)")
        reducer = self._solo if comm.world_size == 1 and self._solo is not None else self._several
        if reducer is not self.reducer:  # a generation of one rank, or of several again
            self.reducer.release()
            self.reducer = reducer
        started = time.perf_counter()
        wall_start = time.time()
        self.progress.step = step
        epoch, global_batch = self.order.batch(self.cursor, plan.global_batch_size)
        offset = plan.offset(rank)
        context = StepContext(
            step=step, epoch=epoch, plan=plan, comm=comm,
            indices=global_batch[offset : offset + plan.shares[rank]], chaos=tuple(chaos),
            lr_factor=lr_factor, ledger=self.config.ledger, started=started,
            wall_start=wall_start, buffers=self.buffers.length,
            first_piece=sum(plan.accumulation(r) for r in range(rank)),
            metric_names=self.metric_names, params=len(self._params), scale=self.training.scale)
        if self.prefetcher is not None:
            self.prefetcher.want(ahead(self, plan, rank))
        self.buffers.begin(context.pieces)
        self.faults.arm_slow(chaos, step)
        self.drop_grads()
        if self._own_train:
            self.model.train()
        elif any(m.training is not mode for m, mode in zip(self._modules, self._modes,
                                                           strict=True)):
            for module, mode in zip(self._modules, self._modes, strict=True):
                module.training = mode  # as built (user code switched some modes meanwhile)
        return context

    def _compute(self, context: StepContext) -> Computed:
        """The compute phase (`elastic.trainer.compute.compute`)."""
        return compute(self, context)

    def _reduce(self, context: StepContext, computed: Computed) -> Reduced:
        """The reduce phase: gradients and metadata summed over ranks by this replica's
        reducer (`elastic.trainer.reducers`: in buckets the backward pass has been filling,
        in flat buffers, or in exact mode's integers).

        Guarantees: every rank issues the same collectives in the same order whatever its
        vote (a rank that voted down sends zeros or ignored content). A rank that voted OK
        but whose loss or gradients are not finite votes NONFINITE (with buckets, gradients
        are checked as they are sent; in exact mode, an overflow of the fixed-point scale
        votes RESCALE). A rank whose flat buffers do not fit even after the allocator's cache
        is released votes OUT_OF_MEMORY; it, and a rank whose buckets could not be begun (its
        vote already says why), allocates them again with its gradients freed, so that it
        still issues every collective. The allreduce chaos faults fire here.

        Raises:
            CollectiveError: the communication failed or was aborted, or this rank ran out of
                memory again for the buffers it needs to take part (then it aborted its
                communicator; the error's cause is the `torch.OutOfMemoryError`).
        """
        comm_start = time.perf_counter()
        self._enter("allreduce")
        try:
            self._chaos(context.chaos, "allreduce")
        except BaseException:
            self.reducer.abandon()  # nothing of this step will be reduced
            raise

        def pack(loss_sum: float, vote: Vote, count: float) -> torch.Tensor:
            return pack_meta(context, loss_sum, vote, count, computed.form,
                             self.buffers.section(), computed.metrics, self.yielding(),
                             computed.used)

        return self.reducer.reduce(context, computed, pack, comm_start)

    def _abandon(self, exponents: list[int]) -> None:
        """A step whose reduce raised: nothing of it may stay in the buffers (or, in exact
        mode, in the fixed-point exponents)."""
        self.buffers.rollback()
        if self.exact is not None:
            self.exact.exponents = exponents

    def _used(self) -> torch.Tensor:
        """At the end of the compute phase: 1 for each parameter this rank's backward passes
        gave a gradient (in exact mode, whose slot they added to), else 0 (`pack_meta`'s
        `used`).

        Raises:
            TypeError: a backward pass left a sparse gradient (`reducers.used_params`).
        """
        return self.reducer.used()

    def drop_grads(self) -> None:
        """Sets every parameter's gradient to None."""
        for p in self._params:
            p.grad = None


def _with_metadata(model_state: Any, items: Any) -> OrderedDict[str, Any]:
    """`items` as a model state dict that keeps `model_state`'s `_metadata` (the modules'
    versions, which `load_state_dict` reads)."""
    out: OrderedDict[str, Any] = OrderedDict(items)
    metadata = getattr(model_state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out
