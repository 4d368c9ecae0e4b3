"""One worker's replica of the model and its part of each global step.

The step contract (DESIGN.md): rank r of a generation takes its share of the global batch,
runs forward/backward per micro-batch with each micro-batch's mean loss scaled by
`len/B`, and the gradients are summed over ranks in one allreduce, so that every rank applies
the same optimizer step as one process with batch B would. The same allreduce carries the
summed loss, one error flag per rank (a rank whose user code raised votes the step down on
every rank, so nobody is left waiting in the collective), and with the ledger on the indices
the step consumed, so that what is recorded is exactly what was committed.
"""

from __future__ import annotations

import io
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from elastic.adapt.plan import BatchPlan
from elastic.collective import Communicator
from elastic.config import ChaosEvent, ChaosPhase, FitConfig
from elastic.errors import CollectiveError, ConfigError, InjectedFault
from elastic.job import TrainJob
from elastic.private import ensure_private_dir, write_private
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.data import Cursor, SampleOrder, steps_per_epoch

# Largest data set whose indices travel exactly in a float32 buffer.
_FLOAT32_EXACT = 1 << 24


@dataclass(frozen=True)
class StepRecord:
    """What one committed global step did, as seen by one rank."""

    step: int
    epoch: int
    loss: float
    world_size: int
    global_batch_size: int
    shares: tuple[int, ...]
    micro_batch: int
    step_time_s: float
    compute_time_s: float  # data, forward and backward on this rank (its throughput)
    end_time: float
    lr: float
    indices: tuple[int, ...] | None = None
    skipped_ranks: tuple[int, ...] = ()  # non-finite loss or gradients: no update was applied
    # (wall-clock start, data, forward+backward, communication, optimizer) in seconds: the
    # step timeline (communication is the exposed part: nothing overlaps it).
    timeline: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class UserFailure:
    """User code raised on some rank; the step was voted down on all ranks."""

    step: int
    ranks: tuple[int, ...]
    traceback: str | None  # this rank's traceback, if it was one of them


@dataclass(frozen=True)
class NonFinite:
    """The loss or gradients were NaN or infinite on some ranks and the policy is 'stop'."""

    step: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class OutOfMemory:
    """Some ranks ran out of memory (and no rank's user code raised otherwise); the step was
    voted down on all ranks and can be redone with smaller micro-batches on those ranks."""

    step: int
    ranks: tuple[int, ...]


# Error votes in the step's allreduce: each rank writes only its own slot.
_USER_ERROR, _OUT_OF_MEMORY, _NONFINITE = 1.0, 2.0, 3.0


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


class Replica:
    """Model, optimizer, scheduler and data of one worker.

    Args:
        job: the user's factories.
        config: the run's configuration.
        run_dir: where chaos kill timestamps are written (for recovery timing).
    """

    def __init__(self, job: TrainJob, config: FitConfig, run_dir: str) -> None:
        self.job = job
        self.config = config
        self.run_dir = run_dir
        torch.manual_seed(config.seed)
        self.model = job.model()
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(
                f"TrainJob.model returned {type(self.model).__name__}, not a torch.nn.Module"
            )
        self.optimizer = job.optimizer(self.model.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"TrainJob.optimizer returned {type(self.optimizer).__name__}, not a "
                "torch.optim.Optimizer"
            )
        self.scheduler = job.lr_scheduler(self.optimizer) if job.lr_scheduler else None
        self.dataset = job.dataset()
        if not (hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__")):
            raise ConfigError(
                f"TrainJob.dataset returned {type(self.dataset).__name__}, not a map-style "
                "dataset (it needs __len__ and __getitem__)"
            )
        self.collate: Callable[[list[Any]], Any] = job.collate_fn or default_collate
        try:
            steps_per_epoch(len(self.dataset), config.batch.global_batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.order = SampleOrder(len(self.dataset), config.seed)
        if config.ledger and len(self.dataset) > _FLOAT32_EXACT:
            raise ConfigError("ledger=True supports data sets of up to 2**24 samples")
        self.cursor = Cursor()
        self._slow: tuple[float, int | None] | None = None  # chaos: (factor, last step)
        self.progress = Progress()
        self.comm: Communicator | None = None
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        collective = config.collective
        self._buckets = (GradientBuckets(self._params, collective.bucket_bytes,
                                         collective.first_bucket_bytes)
                         if collective.overlap_enabled else None)

    # --- state --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The committed state: model, optimizer, scheduler, RNG and the data cursor."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "rng": torch.get_rng_state(),
            "cursor": {"global_step": self.cursor.step, "epoch": self.cursor.epoch,
                       "offset": self.cursor.offset, "samples": self.cursor.samples},
        }

    @property
    def global_step(self) -> int:
        """Steps committed."""
        return self.cursor.step

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"])
        self.cursor = Cursor.from_dict(state["cursor"], self.order.dataset_size,
                                       self.config.batch.global_batch_size)

    def state_bytes(self) -> bytes:
        """The committed state, serialised for a peer."""
        buffer = io.BytesIO()
        torch.save(self.state(), buffer)
        return buffer.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        # weights_only: a peer's bytes are data, never code.
        self.load_state(torch.load(io.BytesIO(data), weights_only=True))

    def sync_from(self, src: int) -> None:
        """Every rank of the generation calls this; afterwards all hold `src`'s state."""
        comm = self._comm()
        payload = self.state_bytes() if comm.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        comm.broadcast(size, src)
        announced = int(size.item())
        if comm.rank != src:
            # Checked before a byte is allocated: a peer cannot make this rank exhaust memory.
            limit = max_state_bytes(self.model, self.optimizer)
            if not 0 < announced <= limit:
                raise CollectiveError(
                    f"rank {src} announced a committed state of {announced} bytes; this rank "
                    f"expects at most {limit} for its model and optimizer; refused",
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
        self.progress.phase = phase
        self.progress.since = time.monotonic()

    def _chaos(self, events: list[ChaosEvent], phase: ChaosPhase, started: float) -> None:
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
        """Runs one global step on this rank. Collective failures raise `CollectiveError`
        (the step is then not applied here); user errors and out-of-memory errors are voted on
        and returned. `lr_factor` scales the learning rate of this step only (batch policy
        'scale_with_workers')."""
        comm = self._comm()
        rank, world = comm.rank, comm.world_size
        step = self.global_step
        started = time.perf_counter()
        wall_start = time.time()
        data_s = 0.0
        self.progress.step = step
        b = plan.global_batch_size
        epoch, global_batch = self.order.batch(self.cursor, b)
        mine = global_batch[plan.offset(rank) : plan.offset(rank) + plan.shares[rank]]
        loss_sum = 0.0
        error: str | None = None
        vote = 0.0
        for event in chaos:
            if event.action == "slow":
                self._slow = (event.factor, None if event.steps is None else step + event.steps - 1)
        for p in self._params:
            p.grad = None
        self.model.train()
        buckets = self._buckets
        meta_len = 1 + world + (b if self.config.ledger else 0)
        if buckets is not None:
            buckets.begin(comm, meta_len, rank, _NONFINITE)
        pieces = plan.pieces(rank)
        try:
            self._enter("data")
            self._chaos(chaos, "data", started)
            for index, (start, length) in enumerate(pieces):
                loading = time.perf_counter()
                batch = self.collate([self.dataset[int(i)] for i in mine[start : start + length]])
                data_s += time.perf_counter() - loading
                self._enter("forward")
                self._chaos(chaos, "forward", started)
                loss = self.job.loss(self.model, batch) * (length / b)
                self._enter("backward")
                self._chaos(chaos, "backward", started)
                if buckets is not None:  # gradients are complete in the last backward pass
                    buckets.arm(index == len(pieces) - 1)
                loss.backward()
                loss_sum += float(loss.detach())
                del loss
            self._stretch(step, started)
        except torch.OutOfMemoryError:
            error, vote = traceback.format_exc(), _OUT_OF_MEMORY
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            error, vote = traceback.format_exc(), _USER_ERROR
        compute_time = time.perf_counter() - started
        comm_start = time.perf_counter()
        self._enter("allreduce")
        self._chaos(chaos, "allreduce", started)
        flags = torch.zeros(world, dtype=torch.float64)
        flags[rank] = vote
        ledger = torch.zeros(b if self.config.ledger else 0, dtype=torch.float64)
        if self.config.ledger:
            ledger[plan.offset(rank) : plan.offset(rank) + len(mine)] = mine.to(torch.float64)
        meta = torch.cat([torch.tensor([loss_sum], dtype=torch.float64), flags, ledger])
        if buckets is not None:
            if vote == 0.0 and not math.isfinite(loss_sum):
                vote = _NONFINITE
                meta[1 + rank] = vote
            buckets.finish(meta)  # gradients are checked for NaN/inf as they are sent
            meta = buckets.wait()
            if meta[1 + rank] == _NONFINITE:
                vote = _NONFINITE
        else:
            buffers = self._flatten_grads(zero=error is not None)
            if vote == 0.0 and not (math.isfinite(loss_sum)
                                    and all(math.isfinite(float(t.sum())) for t in buffers.values())):
                vote = _NONFINITE
                meta[1 + rank] = vote
            self._allreduce(comm, buffers, meta)
        comm_s = time.perf_counter() - comm_start
        votes = meta[1 : 1 + world]
        failed = tuple(int(r) for r in torch.nonzero(votes).flatten().tolist())
        nonfinite = tuple(r for r in failed if votes[r] == _NONFINITE)
        skip = bool(nonfinite) and len(nonfinite) == len(failed) \
            and self.config.failure.nonfinite == "skip"
        if nonfinite and len(nonfinite) == len(failed) and not skip:
            for p in self._params:
                p.grad = None
            self._enter("idle")
            return NonFinite(step=step, ranks=nonfinite)
        if failed and not skip:
            for p in self._params:
                p.grad = None
            self._enter("idle")
            users = tuple(r for r in failed if votes[r] == _USER_ERROR)
            if users:
                return UserFailure(step=step, ranks=users,
                                   traceback=error if vote == _USER_ERROR else None)
            return OutOfMemory(step=step, ranks=failed)
        optimizer_start = time.perf_counter()
        self._enter("optimizer")
        self._chaos(chaos, "optimizer", started)
        if skip:  # every rank drops this update; the samples count as consumed
            lr = float(self.optimizer.param_groups[0]["lr"]) * lr_factor
        else:
            if buckets is not None:
                buckets.assign_grads()
            else:
                self._unflatten_grads(buffers)
            lr = self._optimizer_step(lr_factor)
            if self.scheduler is not None:
                self.scheduler.step()
        for p in self._params:
            p.grad = None
        self.cursor = self.cursor.advance(self.order.dataset_size, b)
        optimizer_s = time.perf_counter() - optimizer_start
        self._enter("idle")
        indices = tuple(int(i) for i in meta[1 + world :].tolist()) if self.config.ledger else None
        return StepRecord(
            step=step, epoch=epoch, loss=float(meta[0]), world_size=world, global_batch_size=b,
            shares=plan.shares, micro_batch=plan.micro_batches[rank],
            step_time_s=time.perf_counter() - started, compute_time_s=compute_time,
            end_time=time.time(), lr=lr, indices=indices, skipped_ranks=nonfinite if skip else (),
            timeline=(wall_start, data_s, compute_time - data_s, comm_s, optimizer_s),
        )

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

    # --- gradient buffers ---------------------------------------------------------------

    def _flatten_grads(self, zero: bool) -> dict[torch.dtype, torch.Tensor]:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._params:
            g = p.grad if (p.grad is not None and not zero) else torch.zeros_like(p)
            groups.setdefault(p.dtype, []).append(g.reshape(-1))
        return {dtype: torch.cat(parts) for dtype, parts in groups.items()}

    def _unflatten_grads(self, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        offsets = dict.fromkeys(buffers, 0)
        for p in self._params:
            n = p.numel()
            start = offsets[p.dtype]
            p.grad = buffers[p.dtype][start : start + n].view_as(p).clone()
            offsets[p.dtype] = start + n

    def _allreduce(self, comm: Communicator, buffers: dict[torch.dtype, torch.Tensor],
                   meta: torch.Tensor) -> None:
        # The step's metadata rides in the float64 gradient buffer when there is one, so a
        # typical step costs one allreduce.
        if torch.float64 in buffers:
            joined = torch.cat([buffers[torch.float64], meta])
            comm.allreduce(joined)
            n = buffers[torch.float64].numel()
            buffers[torch.float64] = joined[:n]
            meta.copy_(joined[n:])
        elif torch.float32 in buffers:  # ledger indices < 2**24 are exact (checked at start)
            joined = torch.cat([buffers[torch.float32], meta.to(torch.float32)])
            comm.allreduce(joined)
            n = buffers[torch.float32].numel()
            buffers[torch.float32] = joined[:n]
            meta.copy_(joined[n:].to(torch.float64))
        else:
            comm.allreduce(meta)
        for dtype, buffer in buffers.items():
            if dtype not in (torch.float64, torch.float32) or (
                dtype == torch.float32 and torch.float64 in buffers
            ):
                comm.allreduce(buffer)


# Per-parameter tensors an optimizer may keep that a fresh one has not created yet (Adam with
# amsgrad keeps three: exp_avg, exp_avg_sq, max_exp_avg_sq), and room for everything that is
# not a tensor of the model's size (cursor, RNG state, scheduler, pickling).
_OPTIMIZER_SLOTS = 3
_STATE_SLACK_BYTES = 16 << 20


def max_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """An upper bound of the serialised committed state of a replica of `model`: its own
    parameters and buffers plus up to `_OPTIMIZER_SLOTS` tensors per parameter in the
    optimizer (or what the optimizer already holds, if more), plus a fixed slack."""
    tensors = list(model.state_dict().values())
    model_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(_tensor_bytes(v) for st in optimizer.state.values() for v in st.values())
    return model_bytes + max(_OPTIMIZER_SLOTS * params, held) + _STATE_SLACK_BYTES


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):  # LBFGS keeps its history as lists of tensors
        return sum(_tensor_bytes(v) for v in value)
    return 0
