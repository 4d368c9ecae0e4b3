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
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import default_collate

from elastic.adapt.groups import decide_grouping, forward_seed
from elastic.adapt.plan import BatchPlan
from elastic.collective import Communicator
from elastic.config import ChaosEvent, ChaosPhase, DataConfig, FitConfig
from elastic.errors import CollectiveError, ConfigError, HalfUpdatedError, InjectedFault
from elastic.job import TrainJob
from elastic.private import ensure_private_dir, write_private
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.buffers import BufferSync
from elastic.trainer.data import Cursor, SampleOrder, steps_per_epoch
from elastic.trainer.device import (
    MoveBatch,
    default_move,
    is_allocation_failure,
    release_cached_memory,
    rng_state,
    set_rng_state,
    to_device_like,
)
from elastic.trainer.exact import ExactSum, environment, make_deterministic
from elastic.trainer.flat import all_finite, allreduce_flat, flatten_grads, unflatten_grads
from elastic.trainer.loader import Piece, Prefetcher, load_piece, set_generator_state
from elastic.trainer.loss import LossForm, loss_term
from elastic.trainer.metrics import (
    MAX_NAMES_BYTES,
    MetricSums,
    decode_names,
    encode_names,
    merge_names,
    read_section,
    split_output,
)
from elastic.trainer.outcomes import NonFinite, OutOfMemory, StepRecord, UserFailure
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
    after_step,
    build_extra_state,
    load_extra_state,
    wants_model,
)

# The outcome types are part of this module's interface (the worker actor imports them here).
__all__ = ["NonFinite", "OutOfMemory", "Replica", "StepRecord", "UserFailure", "chaos_kill",
           "max_state_bytes"]

logger = logging.getLogger(__name__)

# Largest data set whose indices travel exactly in a float32 buffer.
_FLOAT32_EXACT = 1 << 24
# Exact mode: redos of one step at a wider scale before giving up (each widens by up to 50+
# bits, so a float64 gradient from 2**8 to 2**1024 takes about 20).
_MAX_RESCALES = 40
# Elements of step metadata the registered gradient buffers leave room for: the votes, the
# loss, the ledger (one per sample of the global batch) and the metrics; a step whose metadata
# is longer copies its buffers through the transport instead (correct, a little slower).
_META_ROOM = 1 << 16
# A worker waits for its loader processes to build the data set for at most 3x its own build
# time, and at least this long (a spawned loader imports torch first: seconds).
_LOADER_START_MIN_S = 30.0


@dataclass
class Progress:
    """Where a replica is, readable from another thread (for the hang watchdog)."""

    step: int = 0
    phase: str = "idle"
    since: float = field(default_factory=time.monotonic)


def chaos_kill(run_dir: str, event: ChaosEvent) -> None:
    """Chaos 'kill': records the moment (for the recovery breakdown), then SIGKILLs this
    process."""
    directory = os.path.join(run_dir, "chaos")
    ensure_private_dir(directory, "run_dir")
    write_private(os.path.join(directory, f"kill-{event.step}-{event.rank}"),
                  repr(time.time()).encode(), fsync=False)
    os.kill(os.getpid(), signal.SIGKILL)


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
        self._slow: tuple[float, int | None] | None = None  # chaos: (factor, last step)
        self.progress = Progress()
        self.comm: Communicator | None = None
        # Whether the controller asked this rank to end its chunk (read as a step's metadata
        # is packed; the worker actor sets it per chunk).
        self.yielding: Callable[[], bool] = lambda: False
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.buffers = BufferSync(self.model)
        collective = config.collective
        self.exact = self._exact_sums() if config.batch.exact else None
        self._buckets = (GradientBuckets(self._params, collective.bucket_bytes,
                                         collective.first_bucket_bytes)
                         if collective.overlap_enabled and self.exact is None else None)
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
        self._loss_slot = len(self._params)
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
        (`Communicator(shared_bytes=...)`): one copy of the gradients, each dtype 64-byte
        aligned, and room for the step's metadata up to `_META_ROOM` elements; 0 when the
        step reduces no flat host buffers (buckets, exact mode, or gradients on a GPU)."""
        if self._buckets is not None or self.exact is not None or self.device.type != "cpu":
            return 0
        sizes: dict[torch.dtype, int] = {}
        for p in self._params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        return sum(-(-n // 64) * 64 for n in sizes.values()) + _META_ROOM * 8

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
        self.progress.since = time.monotonic()  # first: see evaluation._enter
        self.progress.phase = phase

    def _chaos(self, events: Sequence[ChaosEvent], phase: ChaosPhase, started: float) -> None:
        for event in events:
            if event.phase != phase or event.action == "slow":
                continue
            match event.action:
                case "kill":
                    chaos_kill(self.run_dir, event)
                case "hang":
                    threading.Event().wait()
                case "raise":
                    raise InjectedFault(
                        f"injected fault at step {event.step}, rank {event.rank}, phase {phase}"
                    )
                case "oom":
                    raise torch.OutOfMemoryError(
                        f"injected out-of-memory error at step {event.step}, rank {event.rank}"
                    )

    def _stretch(self, step: int, started: float) -> None:
        """Chaos 'slow': this step's compute takes `factor` times as long (a sleep in
        proportion to the samples just processed)."""
        if self._slow is None:
            return
        factor, last = self._slow
        if last is not None and step > last:
            self._slow = None
            return
        time.sleep((factor - 1.0) * (time.perf_counter() - started))

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
            self._drop_grads()
            # Injected faults fire once: those of the phases already run are dropped.
            context = replace(context, chaos=tuple(e for e in context.chaos
                                                   if e.phase == "optimizer"))
        else:
            raise ConfigError(f"batch.exact: step {context.step}'s values still did not fit the "
                              f"fixed-point scale after {_MAX_RESCALES} rescales")
        if self.exact is not None and not (isinstance(outcome, Commit) and not outcome.skipped):
            self.exact.exponents = exponents  # only an applied step moves them for good
        if isinstance(outcome, Commit):
            record = self._commit(context, computed, reduced, outcome)
            return replace(record, rescaled=rescaled) if rescaled else record
        self.buffers.rollback()
        self._drop_grads()
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
            self.prefetcher.want(self._ahead(plan, rank))
        self.buffers.begin(context.pieces)
        for event in chaos:
            if event.action == "slow":
                self._slow = (event.factor, None if event.steps is None else step + event.steps - 1)
        self._drop_grads()
        self.model.train()
        return context

    def _begin_buckets(self, context: StepContext) -> None:
        """With gradient buckets: allocates the step's buffers and starts the communication
        thread that the last backward pass feeds (nothing without).

        Raises:
            torch.OutOfMemoryError: the buffers did not fit (nothing was started).
        """
        if self._buckets is not None:
            self._buckets.begin(context.comm, context.meta_len, context.rank, float(Vote.NONFINITE))

    def _ahead(self, plan: BatchPlan, rank: int) -> list[Piece]:
        """This rank's pieces of the current step and of the next `data.prefetch_steps` steps
        should the plan stay as it is, in the order they will be trained on."""
        pieces: list[Piece] = []
        cursor, base, batch = self.cursor, plan.offset(rank), plan.global_batch_size
        for _ in range(1 + self.config.data.prefetch_steps):
            share = self.order.batch(cursor, batch)[1][base : base + plan.shares[rank]].tolist()
            pieces += [Piece(cursor.step, forward_seed(self.config.seed, cursor.step, base + start),
                             tuple(share[start : start + length]))
                       for start, length in plan.pieces(rank)]
            cursor = cursor.advance(self.order.dataset_size, batch)
        return pieces

    def _load(self, step: int, seed: int, samples: torch.Tensor) -> Any:
        """One piece's batch on this replica's device (`TrainJob.move_batch`, or every tensor
        in it), with the generators where reading it left them: read ahead by a loader process
        if it was (pinned with `data.pin_memory`), else here (`elastic.trainer.loader` says
        why both are the same)."""
        indices = samples.tolist()
        if self.prefetcher is not None:
            taken = self.prefetcher.take(Piece(step, seed, tuple(indices)))
            if taken is not None:
                batch, state = taken
                torch.manual_seed(seed)  # CUDA's generators; the CPU ones continue from `state`
                set_generator_state(state)
                return self.move(batch, self.device)
        return self.move(load_piece(self.dataset, self.collate, indices, seed), self.device)

    def _compute(self, context: StepContext) -> Computed:
        """The compute phase: forward/backward over the micro-batches of this rank's share
        (one group each with groups on), a mean loss scaled by `len/B`, a `LossSum` total as
        is (its count summed); the generators seeded from (seed, step, position of the first
        sample in the global batch) before each one's data is loaded, never from the rank.

        Guarantees: an exception from user code (data, moving the batch, loss, backward) or an
        out-of-memory error (there, or in allocating the gradient buckets first; torch's, or
        the CPU allocator's RuntimeError: `is_allocation_failure`) is latched into the vote
        with its traceback, never raised, so this rank still joins the reduce; the failed
        attempt's tensors are released before the allocator's cache is. With the
        vote OK, the gradients are this rank's part of the global batch's (in exact mode, each
        group's went into the exact sums instead). Chaos faults of data, forward and backward
        fire here.
        """
        pieces = context.plan.pieces(context.rank)
        loss_sum = data_s = count = 0.0
        metrics, form = MetricSums(), LossForm.NONE
        error, vote, used = None, Vote.OK, None
        if self.exact is not None:
            self.exact.begin(context.meta_len)  # each attempt of the step sums afresh
        try:
            self._begin_buckets(context)
            self._enter("data")
            self._chaos(context.chaos, "data", context.started)
            for index, (start, length) in enumerate(pieces):
                loss, items, form, loading_s = self._piece(context, index, start, length,
                                                           index == len(pieces) - 1, form,
                                                           metrics)
                loss_sum, count, data_s = loss_sum + loss, count + items, data_s + loading_s
            used = self._used()
            self._stretch(context.step, context.started)
        except Exception as e:  # latched into the vote
            error = traceback.format_exc()
            vote = Vote.OUT_OF_MEMORY if is_allocation_failure(e) else Vote.USER_ERROR
        if vote != Vote.OK:
            # Out of the except block, so that the failed attempt's frames (its batch,
            # activations, half-allocated buffers) are gone; its gradients are never sent.
            self._drop_grads()
            if vote == Vote.OUT_OF_MEMORY:
                release_cached_memory(self.device)
        return Computed(loss_sum=loss_sum, count=count, form=form, vote=vote, error=error, data_s=data_s,
                        compute_s=time.perf_counter() - context.started, metrics=metrics, used=used)

    def _piece(self, context: StepContext, index: int, start: int, length: int, last: bool,
               form: LossForm, metrics: MetricSums) -> tuple[float, float, LossForm, float]:
        """One micro-batch of the compute phase (`index` of this rank's, `length` samples from
        `start` of its share; `last`: the step's last backward pass): loaded, forward and
        backward. Returns its loss, item count, loss form and loading seconds."""
        exact, started = self.exact, context.started
        piece = context.first_piece + index
        loading = time.perf_counter()
        seed = forward_seed(self.config.seed, context.step, context.plan.offset(context.rank) + start)
        batch = self._load(context.step, seed, context.indices[start : start + length])
        loading_s = time.perf_counter() - loading
        self._enter("forward")
        self._chaos(context.chaos, "forward", started)
        self.buffers.before_piece(piece)
        loss, items, form = self._forward(batch, length / context.plan.global_batch_size, form,
                                          metrics, length)
        # Read before backward: activation checkpointing runs the layers again there.
        self.buffers.after_piece(piece)
        if exact is not None:
            self._sum_loss(exact, loss, items, form)
        self._enter("backward")
        self._chaos(context.chaos, "backward", started)
        if self._buckets is not None:  # gradients are complete in the last backward pass
            self._buckets.arm(last)
        (loss * context.scale if context.scale != 1.0 else loss).backward()
        value = float(loss.detach())
        del batch, loss
        if exact is not None:
            self._sum_grads(exact)
        return value, items, form, loading_s

    def _forward(self, batch: Any, scale: float, form: LossForm, metrics: MetricSums,
                 samples: int) -> tuple[torch.Tensor, float, LossForm]:
        """One micro-batch's forward and loss (under autocast with mixed precision): the
        tensor to backpropagate, its item count and form; its user metrics into `metrics`."""
        with self.training.autocast(self.model):
            out, piece_metrics = split_output(self.job.loss(self.model, batch))
        loss, items, form = loss_term(out, scale, form)
        if piece_metrics:
            metrics.add(piece_metrics, samples)
        return loss, items, form

    def _sum_loss(self, exact: ExactSum, loss: torch.Tensor, items: float,
                  form: LossForm) -> None:
        """Exact mode: one group's loss (and `LossSum` count) into the exact sums."""
        exact.add(self._loss_slot, loss.detach().reshape(1))
        if form == LossForm.SUM:
            exact.add(self._loss_slot + 1, torch.tensor([items], dtype=torch.float64))

    def _sum_grads(self, exact: ExactSum) -> None:
        """Exact mode: one group's gradient into the exact sums, each group's on its own (the
        next backward starts from no gradient)."""
        for slot, p in enumerate(self._params):
            if p.grad is not None:
                exact.add(slot, p.grad)
                p.grad = None

    def _reduce(self, context: StepContext, computed: Computed) -> Reduced:
        """The reduce phase: gradients and metadata summed over ranks, in the buckets the
        backward pass has been filling or in flat buffers.

        Guarantees: every rank issues the same collectives in the same order whatever its
        vote (a rank that voted down sends zeros or ignored content). A rank that voted OK
        but whose loss or gradients are not finite votes NONFINITE (with buckets, gradients
        are checked as they are sent). A rank whose flat buffers do not fit even after the
        allocator's cache is released votes OUT_OF_MEMORY; it, and a rank whose buckets could
        not be begun (its vote already says why), allocates them again with its gradients
        freed, so that it still issues every collective. The allreduce chaos faults fire here.

        Raises:
            CollectiveError: the communication failed or was aborted, or this rank ran out of
                memory again for the buffers it needs to take part (then it aborted its
                communicator; the error's cause is the `torch.OutOfMemoryError`).
        """
        comm_start = time.perf_counter()
        self._enter("allreduce")
        self._chaos(context.chaos, "allreduce", context.started)
        if self.exact is not None:
            return self._reduce_exact(context, computed, comm_start)
        buckets = self._buckets
        vote, flat = computed.vote, None
        room = context.meta_len if context.comm.control is context.comm else 0
        if buckets is None:
            vote, flat = self._flatten(context, vote, room)
        elif not buckets.begun:
            # Beginning them raised (the vote says why: out of memory, or an error); this rank
            # still issues every collective, so they are begun again, their content ignored.
            self._take_part(context, lambda: self._begin_buckets(context))
        if vote == Vote.OK and not (math.isfinite(computed.loss_sum)
                                    and (flat is None or all_finite(flat))):
            vote = Vote.NONFINITE
        meta = pack_meta(context, computed.loss_sum, vote, computed.count, computed.form,
                         self.buffers.section(), computed.metrics, self.yielding(), computed.used)
        if buckets is not None:
            buckets.finish(meta)
            meta = buckets.wait()
        else:
            assert flat is not None
            allreduce_flat(context.comm, flat, meta, room=room > 0)
        comm_s = time.perf_counter() - comm_start
        return Reduced.unpack(meta, context, flat, comm_s)

    def _flatten(self, context: StepContext, vote: Vote,
                 room: int) -> tuple[Vote, dict[torch.dtype, torch.Tensor]]:
        """The flat gradient buffers (`flatten_grads`; zeros when this rank voted the step
        down; `room` for the metadata) and this rank's vote. If they do not fit, the
        allocator's cache is released and they are allocated once more; if they still do not
        fit, the vote is OUT_OF_MEMORY (if it was OK) and they are zeros, allocated with the
        gradients freed. Their size does not depend on the micro-batch: the backoff that the
        vote brings frees no memory they need, which the warning logged then says.

        Raises:
            CollectiveError: they did not fit even then (`_take_part`).
        """
        lend = context.comm.shared_buffers
        # GPU gradients on a host plane (no NCCL: several workers may share the GPU) are
        # staged in pinned host memory.
        host = self.device.type == "cuda" and context.comm.control is context.comm
        if vote != Vote.OK:
            return vote, self._take_part(context, lambda: flatten_grads(
                self._params, zero=True, meta_len=room, lend=lend, host=host))
        for attempt in range(2):
            failed = False
            try:
                return vote, flatten_grads(self._params, zero=False, meta_len=room, lend=lend,
                                           host=host)
            except Exception as e:
                if not is_allocation_failure(e):
                    raise
                failed = True  # retried below: out of this block, its frames released
            if failed and attempt == 0:
                release_cached_memory(self.device)
        nbytes = sum(p.numel() * p.element_size() for p in self._params)
        logger.warning(
            "rank %d: out of memory for the flat gradient buffers of step %d (%d bytes on %s, "
            "beside the gradients themselves); their size does not depend on the micro-batch, "
            "so the step is voted down as out of memory, but halving the micro-batch frees "
            "only activation memory", context.rank, context.step, nbytes, self.device)
        return Vote.OUT_OF_MEMORY, self._take_part(context, lambda: flatten_grads(
            self._params, zero=True, meta_len=room, lend=lend, host=host))

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
        _release_frames(error)
        return CollectiveError(f"rank {context.rank} ran out of memory in the collectives of "
                               f"step {context.step}: {error}", rank=context.rank)

    def _take_part(self, context: StepContext, allocate: Callable[[], Any]) -> Any:
        """After this rank's step was voted down (out of memory in the step's allocations, or
        an error): frees the gradients and the allocator's cache, then runs `allocate` (the
        buffers this rank needs to take part in the step's collectives) and returns what it
        returns.

        Raises:
            CollectiveError: `allocate` raised (ran out of memory again, say); this rank cannot
                take part, so it aborts its communicator (the generation is re-formed) and
                reports the error as the cause (out of memory is classified as such by
                `elastic.trainer.device.is_out_of_memory`).
        """
        self._drop_grads()
        release_cached_memory(self.device)
        try:
            return allocate()
        except Exception as e:
            out_of_memory = is_allocation_failure(e)
            context.comm.abort()
            _release_frames(e)
            what = ("ran out of memory for its gradient buffers" if out_of_memory else
                    f"could not allocate its gradient buffers ({type(e).__name__}: {e})")
            error = CollectiveError(
                f"rank {context.rank} {what} in step {context.step}, even with its gradients "
                "freed, so it could not take part in the step's collectives",
                rank=context.rank)
            error.__cause__ = e
        # Out of the except block: the failed allocation's frames are gone before the cache
        # is released.
        release_cached_memory(self.device)
        raise error

    def _commit(self, context: StepContext, computed: Computed, reduced: Reduced,
                commit: Commit) -> StepRecord:
        """`_apply`, and if it runs out of memory before the step is committed here (the
        cursor has not moved), `_apply_out_of_memory`.

        Raises:
            CollectiveError: out of memory in the apply phase (this rank left the generation).
        """
        try:
            return self._apply(context, computed, reduced, commit)
        except Exception as e:
            if not is_allocation_failure(e) or self.cursor.step != context.step:
                raise
            raise self._apply_out_of_memory(context, e) from e

    def _apply_out_of_memory(self, context: StepContext, error: BaseException) -> CollectiveError:
        """Out of memory in the apply phase (the optimizer's lazily allocated state, clipping,
        the buffers' broadcast): its peers applied the step, while this rank may be half
        updated. It must not stay a member with that state: it aborts its communicator (its
        peers are released, the generation is re-formed and this rank restored from a peer
        that committed the step) and reports a collective error caused by out of memory. Its
        cursor did not advance (the step is not committed here). If the optimizer step had
        begun (`torn_at`, set by `_apply`), this replica offers no state until it loads a
        committed one (`restorable_step`): if no member committed the step either (a single
        worker, or every rank out of memory alike), the run goes back to a checkpoint (or, at
        step 0, to fresh workers) instead of going on from half-updated weights. Before the
        optimizer (clipping, the buffers' broadcast) nothing of the model was touched: it still
        holds its committed step."""
        self.buffers.rollback()
        self._drop_grads()
        context.comm.abort()
        _release_frames(error)
        return CollectiveError(
            f"rank {context.rank} ran out of memory in the apply phase of step {context.step} "
            f"(optimizer, clipping or buffers), where its peers commit it; it left the "
            f"generation to be restored from a peer: {error}", rank=context.rank)

    def _reduce_exact(self, context: StepContext, computed: Computed,
                      comm_start: float) -> Reduced:
        """Exact mode's reduce: this rank's integers and the metadata (integers there too:
        votes, forms, flags, the ledger) in one float64 allreduce, exact for integers; the
        loss and count from the exact sums."""
        exact = self.exact
        assert exact is not None
        vote = computed.vote
        if vote == Vote.OK and exact.overflowed:
            vote = Vote.RESCALE
        elif vote == Vote.OK and exact.nonfinite:
            vote = Vote.NONFINITE
        meta = pack_meta(context, 0.0, vote, 0.0, computed.form, self.buffers.section(),
                         computed.metrics, self.yielding(), computed.used)
        # The count travels whatever the vote, as in the default reduce: whether a LossSum
        # step's count is 0 must not depend on which ranks' groups were non-finite.
        joined = exact.payload(zero=vote not in (Vote.OK, Vote.RESCALE), meta=meta,
                               keep=(self._loss_slot + 1,))
        context.comm.allreduce(joined)
        exact.finish(joined)
        reduced = Reduced.unpack(joined[exact.payload_length :], context, None,
                                 time.perf_counter() - comm_start)
        total, count = exact.scalar(self._loss_slot), exact.scalar(self._loss_slot + 1)
        loss = total / count if LossForm.SUM in reduced.forms and count > 0 else total
        return replace(reduced, loss=loss, count=count)

    def _apply(self, context: StepContext, computed: Computed, reduced: Reduced,
               commit: Commit) -> StepRecord:
        """The apply phase of a committed step.

        Guarantees: every rank applies the same update, from the summed gradients (divided by
        the global count with `LossSum` losses; none when `commit` skips it: every rank drops
        it); the scheduler steps with the optimizer; the
        cursor advances by the global batch either way and the gradients are cleared. The
        optimizer chaos faults fire here.
        """
        optimizer_start = time.perf_counter()
        self._enter("optimizer")
        self._chaos(context.chaos, "optimizer", context.started)
        grad_norm = None
        if commit.skipped:  # the samples count as consumed
            self.buffers.rollback()
            lr = float(self.optimizer.param_groups[0]["lr"]) * context.lr_factor
        else:
            try:  # before the optimizer: a failed broadcast leaves nothing half-applied
                self.buffers.commit(reduced.buffers, context.comm, _first_with_share(context.plan))
            except BaseException:
                self._drop_grads()
                raise
            self._assign_grads(reduced, commit)
            grad_norm = self.training.unscale_and_clip(self._params)
            # From here until the step is committed, the model and the optimizer may be half
            # updated: a failure in between leaves this replica without a committed state.
            self.torn_at = context.step
            lr = self._optimizer_step(context.lr_factor)
            if self.exact is not None:
                self.exact.advance()
        self._drop_grads()
        self.cursor = self.cursor.advance(self.order.dataset_size, context.global_batch_size)
        self.torn_at = None
        metrics = read_section(reduced.metrics, self.metric_names)[1]
        self._after(context, reduced.loss, metrics, applied=not commit.skipped)
        optimizer_s = time.perf_counter() - optimizer_start
        self._enter("idle")
        plan, compute_s = context.plan, computed.compute_s
        return StepRecord(
            step=context.step, epoch=context.epoch, loss=reduced.loss,
            world_size=context.world_size, global_batch_size=context.global_batch_size,
            shares=plan.shares, micro_batch=plan.micro_batches[context.rank],
            step_time_s=time.perf_counter() - context.started, compute_time_s=compute_s,
            end_time=time.time(), lr=lr, indices=reduced.indices, skipped_ranks=commit.skipped,
            timeline=(context.wall_start, computed.data_s, compute_s - computed.data_s,
                      reduced.comm_s, optimizer_s),
            metrics=metrics, grad_norm=grad_norm,
            scale=context.scale if self.config.training.precision == "fp16-mixed" else None,
            yielded=reduced.yielded,
        )

    def _assign_grads(self, reduced: Reduced, commit: Commit) -> None:
        """Every parameter's `grad`: its summed gradient (exact mode's sums, the buckets' or
        the flat buffers' slices), none for those no rank reached (`_unreached`), divided by
        the global count with `LossSum` losses, before the optimizer (and clipping) reads it."""
        if self.exact is not None:
            for slot, p in enumerate(self._params):
                p.grad = self.exact.value(slot).to(p.dtype).view_as(p).to(p.device)
        elif self._buckets is not None:
            self._buckets.assign_grads()
        else:
            assert reduced.flat is not None
            unflatten_grads(self._params, reduced.flat)
        self._unreached(reduced.used)
        if commit.divisor is not None:
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(commit.divisor)

    def _used(self) -> torch.Tensor:
        """At the end of the compute phase: 1 for each parameter this rank's backward passes
        gave a gradient (in exact mode, whose slot they added to), else 0 (`pack_meta`'s
        `used`).

        Raises:
            TypeError: a backward pass left a sparse gradient (`F.embedding(..., sparse=True)`,
                a custom autograd function; sparse layers are refused when the model is
                built): an error of this rank's user code, as the step sums dense gradients.
        """
        if self.exact is not None:
            added = self.exact.added
            return torch.tensor([slot in added for slot in range(len(self._params))],
                                dtype=torch.float64)
        reached = []
        for p in self._params:
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError("the backward pass left a sparse gradient, which elastic does "
                                "not support: its steps sum dense gradients over the ranks; "
                                "compute it dense (sparse=False)")
            reached.append(p.grad is not None)
        return torch.tensor(reached, dtype=torch.float64)

    def _unreached(self, used: torch.Tensor) -> None:
        """Leaves the parameters that no rank's backward passes reached in this step without
        a gradient, as in one process over the global batch (`zero_grad` sets gradients to
        None): the optimizer skips them (no weight decay, no momentum or Adam moment steps
        them, no state is created for them), where a gradient of zeros would step them. A
        data-dependent branch, an expert no sample was routed to, a layer not called."""
        if used.numel() and not bool(used.all()):
            for p, ranks in zip(self._params, used.tolist(), strict=True):
                if ranks == 0:
                    p.grad = None

    def _after(self, context: StepContext, loss: float, metrics: dict[str, float],
               applied: bool) -> None:
        """Once the step is committed: the extra state's `after_step` hooks (applied steps),
        the loss scale and the scheduler.

        Raises:
            AfterStepError: user code raised there (the step stays committed).
        """
        if applied:
            after_step(self.extra, self.model, context.step, context.rank)
        epoch_over = (self.cursor.start(self.order.dataset_size, context.global_batch_size)[0]
                      > self.cursor.epoch)
        self.training.after_step(context.step, context.rank, applied, loss, metrics, epoch_over)

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

    def _drop_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _optimizer_step(self, lr_factor: float) -> float:
        """One optimizer step with the learning rate scaled by `lr_factor` for this step only
        (the optimizer's and scheduler's own values are left as they were). Returns the
        learning rate applied to the first parameter group."""
        groups = self.optimizer.param_groups
        if lr_factor == 1.0:
            self.optimizer.step()
            return float(groups[0]["lr"])
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_factor
        applied = float(groups[0]["lr"])
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, saved, strict=True):
                group["lr"] = lr
        return applied


def _release_frames(error: BaseException) -> None:
    """Clears the local variables of the finished frames in `error`'s traceback (the tensors
    of a failed attempt: activations, half-allocated buffers), so that an error that is kept
    (as a cause, or until the caller handles it) holds no memory; the traceback stays."""
    traceback.clear_frames(error.__traceback__)


def _first_with_share(plan: BatchPlan) -> int:
    """The lowest rank that ran a forward pass in a step of `plan`."""
    return next((r for r, share in enumerate(plan.shares) if share > 0), 0)


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
