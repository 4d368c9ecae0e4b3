"""The compute phase of a step: this rank's pieces of the global batch loaded (read ahead by
loader processes, or here), forward and backward, the loss and metrics summed, errors and
out-of-memory latched into the step's vote.

The replica calls `compute` with itself as the `ComputeHost`: the few parts of it this phase
uses, declared below, so that this module does not import the replica.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Protocol

import torch

from elastic.adapt.groups import forward_seed
from elastic.adapt.plan import BatchPlan
from elastic.config import FitConfig
from elastic.job import TrainJob
from elastic.trainer.buffers import BufferSync
from elastic.trainer.current import set_current_step
from elastic.trainer.data import Cursor, SampleOrder
from elastic.trainer.device import (
    MoveBatch,
    host_values,
    is_allocation_failure,
    read_later,
    release_cached_memory,
)
from elastic.trainer.faults import FaultInjector
from elastic.trainer.loader import (
    Piece,
    Prefetcher,
    load_piece,
    pin_batch,
    seed_torch,
    set_generator_state,
)
from elastic.trainer.loss import LossForm, loss_term
from elastic.trainer.metrics import MetricSums, split_output
from elastic.trainer.reducers import Reducer
from elastic.trainer.step import Computed, StepContext, Vote
from elastic.trainer.training import Training


class ComputeHost(Protocol):
    """What the compute phase reads and drives of a replica."""

    job: TrainJob
    config: FitConfig
    model: torch.nn.Module
    device: torch.device
    dataset: Any
    collate: Any
    move: MoveBatch
    order: SampleOrder
    cursor: Cursor
    prefetcher: Prefetcher | None
    buffers: BufferSync
    reducer: Reducer
    training: Training
    faults: FaultInjector

    def drop_grads(self) -> None: ...


def ahead(host: ComputeHost, plan: BatchPlan, rank: int) -> list[Piece]:
    """This rank's pieces of the current step and of the next `data.prefetch_steps` steps
    should the plan stay as it is, in the order they will be trained on."""
    pieces: list[Piece] = []
    cursor, base, batch = host.cursor, plan.offset(rank), plan.global_batch_size
    for _ in range(1 + host.config.data.prefetch_steps):
        share = host.order.batch(cursor, batch)[1][base : base + plan.shares[rank]].tolist()
        pieces += [Piece(cursor.step, forward_seed(host.config.seed, cursor.step, base + start),
                         tuple(share[start : start + length]))
                   for start, length in plan.pieces(rank)]
        cursor = cursor.advance(host.order.dataset_size, batch)
    return pieces


def load(host: ComputeHost, step: int, seed: int, samples: torch.Tensor) -> Any:
    """One piece's batch on this replica's device (`TrainJob.move_batch`, or every tensor
    in it), with the generators where reading it left them: read ahead by a loader process
    if it was (pinned with `data.pin_memory`), else here (`elastic.trainer.loader` says
    why both are the same)."""
    indices = samples.tolist()
    if host.prefetcher is not None:
        taken = host.prefetcher.take(Piece(step, seed, tuple(indices)))
        if taken is not None:
            batch, state = taken
            seed_torch(seed)  # for CUDA's generators: the CPU ones continue from `state`
            set_generator_state(state)
            return host.move(batch, host.device)
    batch = load_piece(host.dataset, host.collate, indices, seed,
                       one_thread=host.config.batch.exact)
    if host.config.data.pin_memory and host.device.type == "cuda":
        # Read here (no loader processes, or a piece they did not have): pinned here, on the
        # step's path, as DataLoader with num_workers=0 pins.
        batch = pin_batch(batch)
    return host.move(batch, host.device)


def compute(host: ComputeHost, context: StepContext) -> Computed:
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
    losses: list[float | torch.Tensor] = []  # on a GPU read by the host after the last piece
    counts: list[float | torch.Tensor] = []
    host.reducer.reset(context.meta_len)  # each attempt of the step sums afresh
    set_current_step(context.step)
    try:
        host.reducer.begin(context)  # buckets: allocated here, inside the vote
        host.faults.enter("data")
        host.faults.fire(context.chaos, "data")
        for index, (start, length) in enumerate(pieces):
            loss, items, form, loading_s = _piece(host, context, index, start, length,
                                                       index == len(pieces) - 1, form,
                                                       metrics)
            losses.append(loss)
            counts.append(items)
            data_s += loading_s
        # One read of the step's scalars: losses, counts, the metrics beside them and (on a
        # GPU) the check of the BatchNorm layers' calls.
        unread = metrics.unread()
        read = host_values([*losses, *counts, *unread, *host.buffers.unread()])
        for value in read[: len(losses)]:  # summed in order, as each piece's float
            loss_sum += value
        for value in read[len(losses) : 2 * len(losses)]:
            count += value
        metrics.settle(read[2 * len(losses) : 2 * len(losses) + len(unread)], context.metric_names)
        host.buffers.settle(read[2 * len(losses) + len(unread) :])
        used = host.reducer.used()
        host.faults.stretch(context.step, context.started)
    except Exception as e:  # latched into the vote
        error = traceback.format_exc()
        vote = Vote.OUT_OF_MEMORY if is_allocation_failure(e) else Vote.USER_ERROR
    if vote != Vote.OK:
        # Out of the except block, so that the failed attempt's frames (its batch,
        # activations, half-allocated buffers) are gone; its gradients are never sent. Its
        # metrics are dropped, those not read yet unread: the step is not committed, and a
        # read after a failure on the device would raise its error again outside the vote.
        metrics.discard()
        host.drop_grads()
        if vote == Vote.OUT_OF_MEMORY:
            release_cached_memory(host.device)
    return Computed(loss_sum=loss_sum, count=count, form=form, vote=vote, error=error, data_s=data_s,
                    compute_s=time.perf_counter() - context.started, metrics=metrics, used=used)


def _piece(host: ComputeHost, context: StepContext, index: int, start: int, length: int, last: bool,
           form: LossForm, metrics: MetricSums
           ) -> tuple[float | torch.Tensor, float | torch.Tensor, LossForm, float]:
    """One micro-batch of the compute phase (`index` of this rank's, `length` samples from
    `start` of its share; `last`: the step's last backward pass): loaded, forward and
    backward. Returns its loss and item count (floats, or on a GPU as `read_later` keeps
    them, not read yet), loss form and loading seconds."""
    piece = context.first_piece + index
    loading = time.perf_counter()
    seed = forward_seed(host.config.seed, context.step, context.plan.offset(context.rank) + start)
    batch = load(host, context.step, seed, context.indices[start : start + length])
    loading_s = time.perf_counter() - loading
    host.faults.enter("forward")
    if index == 0:  # a step's faults fire once (a second SIGTERM would end a preempted worker)
        host.faults.fire(context.chaos, "forward")
    host.buffers.before_piece(piece)
    loss, items, form = _forward(host, batch, length / context.plan.global_batch_size, form,
                                      metrics, length)
    # Read before backward: activation checkpointing runs the layers again there.
    host.buffers.after_piece(piece)
    host.reducer.after_forward(loss, items, form)
    host.faults.enter("backward")
    if index == 0:
        host.faults.fire(context.chaos, "backward")
    host.reducer.arm(last)
    if loss.requires_grad or not _weighs_nothing(items, form):
        (loss * context.scale if context.scale != 1.0 else loss).backward()
    # else: a `LossSum` of count 0 whose total is a constant (`LossSum(torch.zeros(()), 0)`
    # for a micro-batch of padding alone): it adds nothing to any gradient, as in one
    # process over the global batch; its backward would raise ("does not require grad").
    value = read_later(loss, "the loss")
    del batch, loss
    host.reducer.after_backward()
    return value, items, form, loading_s


def _weighs_nothing(items: float | torch.Tensor, form: LossForm) -> bool:
    """Whether a micro-batch's loss is a `LossSum` of count 0 (read here if it is a tensor
    on a GPU: only for a loss that needs no gradient, which is rare)."""
    return form == LossForm.SUM and float(items) == 0.0


def _forward(host: ComputeHost, batch: Any, scale: float, form: LossForm, metrics: MetricSums,
             samples: int) -> tuple[torch.Tensor, float | torch.Tensor, LossForm]:
    """One micro-batch's forward and loss (under autocast with mixed precision): the
    tensor to backpropagate, its item count and form; its user metrics into `metrics`."""
    with host.training.autocast(host.model):
        out, piece_metrics = split_output(host.job.loss(host.model, batch))
    loss, items, form = loss_term(out, scale, form)
    if piece_metrics:
        metrics.add(piece_metrics, samples)
    return loss, items, form
