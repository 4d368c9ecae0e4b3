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

import io
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import default_collate

from elastic.adapt.groups import decide_grouping
from elastic.adapt.plan import BatchPlan
from elastic.collective import Communicator
from elastic.config import ChaosEvent, ChaosPhase, DataConfig, FitConfig
from elastic.errors import CollectiveError, ConfigError, HalfUpdatedError
from elastic.job import TrainJob
from elastic.trainer.apply import apply_step
from elastic.trainer.buffers import BufferSync
from elastic.trainer.compute import ahead, compute
from elastic.trainer.data import Cursor, SampleOrder, steps_per_epoch
from elastic.trainer.device import (
    MoveBatch,
    default_move,
    is_allocation_failure,
    rng_state,
    set_rng_state,
    to_device_like,
)
from elastic.trainer.exact import ExactSum, environment, make_deterministic
from elastic.trainer.faults import FaultInjector, Progress, chaos_kill
from elastic.trainer.loader import Prefetcher
from elastic.trainer.metrics import (
    MAX_NAMES_BYTES,
    decode_names,
    encode_names,
    merge_names,
    read_section,
)
from elastic.trainer.outcomes import NonFinite, OutOfMemory, StepRecord, UserFailure
from elastic.trainer.reducers import Reducer, make_reducer, release_frames
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
from elastic.trainer.training import (
    Training,
    build_extra_state,
    load_extra_state,
    wants_model,
)

# The outcome types, `Progress` and `chaos_kill` are part of this module's interface (the worker
# actor imports them here).
__all__ = ["NonFinite", "OutOfMemory", "Progress", "Replica", "StepRecord", "UserFailure",
           "chaos_kill", "max_state_bytes"]

logger = logging.getLogger(__name__)

# Largest data set whose indices travel exactly in a float32 buffer.
_FLOAT32_EXACT = 1 << 24
# Exact mode: redos of one step at a wider scale before giving up (each widens by up to 50+
# bits, so a float64 gradient from 2**8 to 2**1024 takes about 20).
_MAX_RESCALES = 40
# A worker waits for its loader processes to build the data set for at most 3x its own build
# time, and at least this long (a spawned loader imports torch first: seconds).
_LOADER_START_MIN_S = 30.0


def _built_model(job: TrainJob) -> torch.nn.Module:
    """The job's model, checked.

    Raises:
        ConfigError: the factory returned no `torch.nn.Module`, or a layer makes sparse
            gradients (the step sums dense gradient buffers over ranks).
    """
    model = job.model()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"TrainJob.model returned {type(model).__name__}, not a torch.nn.Module")
    sparse = [name or type(model).__name__ for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ConfigError(
            f"TrainJob.model: {', '.join(map(repr, sparse))} make sparse gradients (sparse=True), which "
            "elastic does not support: its steps sum dense gradient buffers over the ranks; "
            "build them with sparse=False (and a dense optimizer instead of SparseAdam)")
    return model


def _start_loaders(job: TrainJob, data: DataConfig, data_rng: torch.Tensor,
                   built_in: float) -> Prefetcher | None:
    """The worker's loader processes (none without `data.loader_workers`), started.

    They have built the data set before the worker reports itself started: a worker that
    joins a running generation then holds no rank's step while its loaders build it. They are
    not waited on for long past what the worker's own build took (`built_in` seconds; they
    build it side by side): a loader stuck in the factory is then found at the first step (as
    a hung data phase), not left holding the worker's start."""
    if not data.loader_workers:
        return None
    prefetcher = Prefetcher(job, data.loader_workers, data.start_method, data_rng, data.pin_memory)
    patience = max(_LOADER_START_MIN_S, 3 * built_in)
    try:
        if not prefetcher.wait_started(patience):
            logger.warning("the loader processes had not built the data set %.0f s after the "
                           "worker had; the first step waits for them", patience)
    except BaseException:
        prefetcher.close()
        raise
    return prefetcher


def random_layer(module: torch.nn.Module) -> bool:
    """Whether `module` draws random numbers of its own in training: a dropout layer
    (`nn.Dropout*`, `nn.AlphaDropout`) or `nn.RReLU`; a recurrent layer with dropout between
    its layers (`nn.LSTM/GRU/RNN`, `num_layers` > 1); stochastic depth (torchvision's
    `StochasticDepth`, or a class named `*Drop*` with a float `p` above 0, as timm's
    `DropPath`); and any module that keeps a probability above 0 in a float attribute named
    like `*drop*` (`nn.MultiheadAttention`'s `dropout`, the `attention_dropout` of Hugging Face
    attention, `drop_prob`, `drop_path_rate`). A module that draws in other ways (`torch.rand`
    in a forward) is not seen: `batch.groups = 'on'` covers it."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    if isinstance(module, torch.nn.RNNBase):
        return module.dropout > 0 and module.num_layers > 1
    named = type(module).__name__
    if "drop" in named.lower() or named == "StochasticDepth":
        p = getattr(module, "p", None)
        if isinstance(p, float) and p > 0:
            return True
    return any("drop" in name.lower() and isinstance(value, float) and value > 0
               for name, value in vars(module).items())


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
        self.model = _built_model(job)
        self.model.to(self.device)  # before the optimizer: its state follows the parameters
        self._build_optimizer()
        self.metric_names: tuple[str, ...] = ()  # committed: the same on every rank
        data_rng = torch.get_rng_state()  # loader processes build the data set from here too
        building = time.monotonic()
        self.dataset = job.dataset()
        built_in = time.monotonic() - building
        if not (hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__")):
            raise ConfigError(
                f"TrainJob.dataset returned {type(self.dataset).__name__}, not a map-style "
                "dataset (it needs __len__ and __getitem__)"
            )
        self.collate: Callable[[list[Any]], Any] = job.collate_fn or default_collate
        if config.data.loader_workers and not getattr(self.dataset, "uses_loader_processes", True):
            raise ConfigError(
                f"data.loader_workers: a {type(self.dataset).__name__} is read through Ray, and "
                "loader processes are not Ray workers; set data.loader_workers=0 (Ray Data ran "
                "its transforms in parallel already)")
        try:
            steps_per_epoch(len(self.dataset), config.batch.global_batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.order = SampleOrder(len(self.dataset), config.seed, self.dataset)
        if config.ledger and len(self.dataset) > _FLOAT32_EXACT:
            raise ConfigError("ledger=True supports data sets of up to 2**24 samples")
        self.cursor = Cursor()
        self.faults = FaultInjector(run_dir)
        self.progress: Progress = self.faults.progress
        self.comm: Communicator | None = None
        # Whether the controller asked this rank to end its chunk (read as a step's metadata
        # is packed; the worker actor sets it per chunk).
        self.yielding: Callable[[], bool] = lambda: False
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.buffers = BufferSync(self.model)
        collective = config.collective
        self._loss_slot = len(self._params)  # exact mode's slot of the loss
        self.exact = self._exact_sums() if config.batch.exact else None
        # How the gradients are summed: exact sums, buckets that overlap the backward pass,
        # or flat buffers after it (`elastic.trainer.reducers`), chosen once.
        self.reducer: Reducer = make_reducer(
            self, self._params, collective.overlap_enabled, collective.bucket_bytes,
            collective.first_bucket_bytes, self.exact, self._loss_slot)
        # Last: nothing above may fail after loader processes exist.
        self.prefetcher = _start_loaders(job, config.data, data_rng, built_in)

    def _build_optimizer(self) -> None:
        """The optimizer (from the model's parameters, or from the model when the factory
        asks for it: `wants_model`), the scheduler, their `Training` and the extra state."""
        job = self.job
        self.optimizer = job.optimizer(self.model if wants_model(job.optimizer)
                                       else self.model.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"TrainJob.optimizer returned {type(self.optimizer).__name__}, not a "
                "torch.optim.Optimizer"
            )
        self.scheduler = job.lr_scheduler(self.optimizer) if job.lr_scheduler else None
        self.training = Training(self.config.training, self.scheduler)
        if self.config.training.scheduler_interval == "evaluation" and job.eval_step is None:
            raise ConfigError("training.scheduler_interval 'evaluation' steps the scheduler "
                              "after each evaluation, but the job has no TrainJob.eval_step "
                              "and eval_dataset to evaluate")
        self.extra = build_extra_state(job, self.model, self.optimizer)

    def close(self) -> None:
        """Stops the loader processes (they also exit by themselves when this process dies)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

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

    def state(self) -> dict[str, Any]:
        """The committed state: model, optimizer, scheduler, RNG and the data cursor. The RNG
        is 'rng', the CPU generator, and on a GPU worker 'cuda_rng', its device's generator
        (`elastic.trainer.device.rng_state`). Tensors stay where they live (the device):
        `elastic.trainer.device.to_host` copies them out.

        Raises:
            HalfUpdatedError: this replica is half updated (`torn_at`): it holds no committed
                state to save or hand to a peer.
        """
        self.check_committed()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            **rng_state(self.device),
            "cursor": {"global_step": self.cursor.step, "epoch": self.cursor.epoch,
                       "offset": self.cursor.offset, "samples": self.cursor.samples},
            "training": self.training.state_dict(),
            "metric_names": list(self.metric_names),
            **({"extra": {name: obj.state_dict() for name, obj in self.extra.items()}}
               if self.extra else {}),
            **({"exact": self.exact.state_dict()} if self.exact is not None else {}),
        }

    def traits(self) -> dict[str, int]:
        """What the controller needs to know about the model to cut the batch: its BatchNorm
        layers and its layers that draw random numbers (`random_layer`; `batch.groups`
        'auto')."""
        modules = list(self.model.modules())
        return {"batchnorm": sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                 for m in modules),
                "dropout": sum(map(random_layer, modules))}

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

    def load_state(self, state: dict[str, Any], origin: str = "checkpoint") -> None:
        """Takes a committed state (`origin`: 'checkpoint' or 'peer'), from host memory or
        any device: the model and optimizer copy it to their device (the optimizer casts its
        state to each parameter's). The CUDA generator is restored on a GPU worker only. The
        extra state objects get their tensors on the device (`_extra_on_device`).

        Raises:
            ConfigError: exact mode, and the state was written without it or under another
                torch build, thread count or hardware type (from a checkpoint, unless
                `checkpoint.allow_environment_change`; from a peer, always: the members of an
                exact run must compute alike).
        """
        if self.exact is not None:
            self._check_exact(state.get("exact"), origin)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state, self.device)
        self.training.load_state_dict(state.get("training"))
        self.metric_names = tuple(state.get("metric_names") or ())
        load_extra_state(self.extra, self._extra_on_device(state.get("extra")))
        self.cursor = Cursor.from_dict(state["cursor"], self.order.dataset_size,
                                       self.config.batch.global_batch_size)
        if self.exact is not None and state.get("exact") is not None:
            self.exact.load_state_dict(state["exact"])
        self.torn_at = None

    def _extra_on_device(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """The extra state objects' saved states with their tensors where each object holds
        them now (`elastic.trainer.device.to_device_like`: its own `state_dict()` as the
        template), and any tensor it does not hold yet (an EMA allocated at its first update)
        on this replica's device; a CPU replica's as they are. A state loaded from a
        checkpoint or a peer is in host memory."""
        if not saved or self.device.type == "cpu":
            return saved
        moved = dict(saved)
        for name, obj in self.extra.items():
            if name in moved:
                moved[name] = to_device_like(moved[name], obj.state_dict(), self.device)
        return moved

    def _check_exact(self, saved: dict[str, Any] | None, origin: str) -> None:
        assert self.exact is not None
        if saved is not None:
            try:
                self.exact.check_state(saved)
            except ValueError as e:
                raise ConfigError(f"batch.exact: {e}") from None
        here = environment()
        there = (saved or {}).get("environment") or {}
        if there == here:
            return
        ckpt = self.config.checkpoint
        if origin == "checkpoint" and ckpt is not None and ckpt.allow_environment_change:
            return
        what = ("was written without batch.exact" if saved is None or not there else
                "was written under " + ", ".join(f"{k}={there.get(k)!r}" for k in here
                                                  if there.get(k) != here[k])
                + "; this worker has " + ", ".join(f"{k}={here[k]!r}" for k in here
                                                  if there.get(k) != here[k]))
        if origin == "peer":
            raise ConfigError(f"batch.exact: the state of a peer {what}; every worker of an "
                              "exact run needs the same torch build, threads and hardware type")
        raise ConfigError(f"batch.exact: the checkpoint {what}, so this run could not "
                          "reproduce it; set checkpoint.allow_environment_change=True to resume "
                          "anyway (exact from here on)")

    def registered_bytes(self) -> int:
        """Shared memory to ask the communicator to lend for the flat gradient buffers
        (`Communicator(shared_bytes=...)`; `FlatReducer.registered_bytes`): 0 when the step
        reduces no flat host buffers (buckets, exact mode, or gradients on a GPU)."""
        return self.reducer.registered_bytes()

    def state_bytes(self) -> bytes:
        """The committed state, serialised for a peer."""
        buffer = io.BytesIO()
        torch.save(self.state(), buffer)
        return buffer.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        # weights_only: a peer's bytes are data, never code.
        self.load_state(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"),
                        origin="peer")

    def sync_from(self, src: int) -> None:
        """Every rank of the generation calls this; afterwards all hold `src`'s state (sent as
        bytes over the control plane)."""
        comm = self._comm().control
        payload = self.state_bytes() if comm.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        comm.broadcast(size, src)
        announced = int(size.item())
        if comm.rank != src:
            # Checked before a byte is allocated: a peer cannot make this rank exhaust memory.
            limit = max_state_bytes(self.model, self.optimizer, self.extra)
            if not 0 < announced <= limit:
                raise CollectiveError(
                    f"rank {src} announced a committed state of {announced} bytes; this rank "
                    f"expects at most {limit} for its model, optimizer and extra state; refused",
                    rank=comm.rank)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if comm.rank == src
                else torch.empty(announced, dtype=torch.uint8))
        comm.broadcast(data, src)
        if comm.rank != src:
            self.load_state_bytes(data.numpy().tobytes())

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
        for rescaled in range(_MAX_RESCALES + 1):  # noqa: B007 (read after the loop)
            computed = self._compute(context)
            try:
                reduced = self._reduce(context, computed)
                reduced = self._learn_metric_names(context, computed, reduced)
            except BaseException as e:
                self._abandon(exponents)
                if is_allocation_failure(e):  # past the allocations the vote covers
                    raise self._left_collectives(context, e) from e
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
            context = replace(context, chaos=tuple(e for e in context.chaos
                                                   if e.phase == "optimizer"))
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
        self.model.train()
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
        self._chaos(context.chaos, "allreduce")

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

    @staticmethod
    def _left_collectives(context: StepContext, error: BaseException) -> CollectiveError:
        """An out-of-memory error inside the reduce, past the allocations the vote covers (in
        the communication itself): this rank may have left the step's collectives half done,
        so it aborts its communicator and reports a collective error caused by it (which
        `elastic.trainer.device.is_out_of_memory` classifies as out of memory)."""
        context.comm.abort()
        release_frames(error)
        return CollectiveError(f"rank {context.rank} ran out of memory in the collectives of "
                               f"step {context.step}: {error}", rank=context.rank)

    def _used(self) -> torch.Tensor:
        """At the end of the compute phase: 1 for each parameter this rank's backward passes
        gave a gradient (in exact mode, whose slot they added to), else 0 (`pack_meta`'s
        `used`).

        Raises:
            TypeError: a backward pass left a sparse gradient (`reducers.used_params`).
        """
        return self.reducer.used()

    def _learn_metric_names(self, context: StepContext, computed: Computed,
                            reduced: Reduced) -> Reduced:
        """When some rank's metrics named a metric this step's layout did not have (the
        summed flag), every rank exchanges its names, adopts their union and sums this
        step's metrics again under it. Every rank runs the same collectives (the flag is
        summed), so nobody is left waiting.

        Raises:
            CollectiveError: the exchange failed, or a peer announced malformed names.
        """
        new, _ = read_section(reduced.metrics, context.metric_names)
        if not new:
            return reduced
        comm = context.comm.control
        mine = encode_names(list(computed.metrics.sums))
        names: list[list[str]] = []
        for src in range(comm.world_size):
            size = torch.tensor([len(mine) if src == comm.rank else 0], dtype=torch.int64)
            comm.broadcast(size, src)
            announced = int(size.item())
            if not 0 < announced <= MAX_NAMES_BYTES:
                raise CollectiveError(f"rank {src} announced {announced} bytes of metric names; "
                                      f"at most {MAX_NAMES_BYTES} are accepted", rank=comm.rank)
            data = (torch.frombuffer(bytearray(mine), dtype=torch.uint8) if src == comm.rank
                    else torch.empty(announced, dtype=torch.uint8))
            comm.broadcast(data, src)
            try:
                names.append(decode_names(data.numpy().tobytes()))
            except ValueError as e:
                raise CollectiveError(f"rank {src}: {e}", rank=comm.rank) from None
        self.metric_names = merge_names(self.metric_names, *names)
        section = computed.metrics.section(self.metric_names)
        comm.allreduce(section)
        return replace(reduced, metrics=section)

    def drop_grads(self) -> None:
        """Sets every parameter's gradient to None."""
        for p in self._params:
            p.grad = None

# Per-parameter tensors an optimizer may keep that a fresh one has not created yet (Adam with
# amsgrad keeps three: exp_avg, exp_avg_sq, max_exp_avg_sq), and room for everything that is
# not a tensor of the model's size (cursor, RNG state, scheduler, pickling).
_OPTIMIZER_SLOTS = 3
_STATE_SLACK_BYTES = 16 << 20
# Each extra state object may hold this many copies of the model's state on the peer that
# sends it, whatever it holds here: an EMA allocated at its first update is empty on a fresh
# replica (two: an EMA of the weights and one of their squares, say).
_EXTRA_SLOTS = 2


def max_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any] | None = None) -> int:
    """An upper bound of the serialised committed state of a replica of `model`: its own
    parameters and buffers plus up to `_OPTIMIZER_SLOTS` tensors per parameter in the
    optimizer (or what the optimizer already holds, if more), per extra state object
    `_EXTRA_SLOTS` copies of the model's state (or what it holds here, if more), plus a fixed
    slack."""
    tensors = list(model.state_dict().values())
    model_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(_tensor_bytes(v) for st in optimizer.state.values() for v in st.values())
    extra_bytes = sum(max(_tensor_bytes(obj.state_dict()), _EXTRA_SLOTS * model_bytes)
                      for obj in (extra or {}).values())
    return model_bytes + max(_OPTIMIZER_SLOTS * params, held) + extra_bytes + _STATE_SLACK_BYTES


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):  # LBFGS keeps its history as lists of tensors
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):  # an extra state's state_dict
        return sum(_tensor_bytes(v) for v in value.values())
    return 0
