"""The apply phase of a committed step: the buffers committed, the summed gradients assigned
(divided by the global count with `LossSum` losses; none for parameters no rank reached),
clipped, the optimizer and the scheduler stepped, the cursor advanced; and what happens when
this rank runs out of memory there (it leaves the generation, to be restored from a peer).

The replica calls `apply_step` with itself as the `ApplyHost`: the parts of it this phase
uses, declared below, so that this module does not import the replica.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from elastic.adapt.plan import BatchPlan
from elastic.config import FitConfig
from elastic.errors import CollectiveError
from elastic.trainer.buffers import BufferSync
from elastic.trainer.data import Cursor, SampleOrder
from elastic.trainer.device import is_allocation_failure
from elastic.trainer.exact import ExactSum
from elastic.trainer.faults import FaultInjector
from elastic.trainer.metrics import read_section
from elastic.trainer.outcomes import StepRecord
from elastic.trainer.reducers import Reducer, release_frames
from elastic.trainer.sharding import OptimizerShards, PendingStep, staged_streams
from elastic.trainer.step import Commit, Computed, Reduced, StepContext
from elastic.trainer.training import Training, after_step


class ApplyHost(Protocol):
    """What the apply phase reads and changes of a replica."""

    config: FitConfig
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extra: dict[str, Any]
    order: SampleOrder
    cursor: Cursor
    buffers: BufferSync
    reducer: Reducer
    training: Training
    faults: FaultInjector
    exact: ExactSum | None
    metric_names: tuple[str, ...]
    torn_at: int | None
    shards: OptimizerShards | None
    unfinished: Callable[[], None] | None
    _params: list[torch.nn.Parameter]

    def drop_grads(self) -> None: ...

    _exponents: list[int]


def apply_step(host: ApplyHost, context: StepContext, computed: Computed, reduced: Reduced,
            commit: Commit, alone: bool = False) -> StepRecord:
    """`_apply`, and if it runs out of memory before the step is committed here (the
    cursor has not moved), `_apply_out_of_memory`. `alone`: sharded state, a step whose sums
    this rank holds applied while a new generation forms (`OptimizerShards.pending`), with no
    collective: the buffers and the parameters of others' parts come from the generation's
    source and owners, and the step's end (`_after`) runs once they have.

    Raises:
        CollectiveError: out of memory in the apply phase (this rank left the generation).
    """
    try:
        return _apply(host, context, computed, reduced, commit, alone)
    except Exception as e:
        if not is_allocation_failure(e) or host.cursor.step != context.step:
            raise
        raise _apply_out_of_memory(host, context, e) from e


def _apply_out_of_memory(host: ApplyHost, context: StepContext, error: BaseException) -> CollectiveError:
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
    host.buffers.rollback()
    host.drop_grads()
    context.comm.abort()
    release_frames(error)
    return CollectiveError(
        f"rank {context.rank} ran out of memory in the apply phase of step {context.step} "
        f"(optimizer, clipping or buffers), where its peers commit it; it left the "
        f"generation to be restored from a peer: {error}", rank=context.rank)


def _apply(host: ApplyHost, context: StepContext, computed: Computed, reduced: Reduced,
           commit: Commit, alone: bool = False) -> StepRecord:
    """The apply phase of a committed step.

    Guarantees: every rank applies the same update, from the summed gradients (divided by
    the global count with `LossSum` losses; none when `commit` skips it: every rank drops
    it); the scheduler steps with the optimizer; the
    cursor advances by the global batch either way and the gradients are cleared. The
    optimizer chaos faults fire here.
    """
    optimizer_start = time.perf_counter()
    host.faults.enter("optimizer")
    host.faults.fire(context.chaos, "optimizer")
    grad_norm = None
    gather_failed = None
    # First: if the scheduler raises there, nothing of the step is applied on this rank.
    host.training.before_step(context.step, context.epoch, context.rank)
    _buffers_and_agreement(host, context, computed, reduced, commit, alone)
    if commit.skipped:  # the samples count as consumed
        lr = float(host.optimizer.param_groups[0]["lr"]) * context.lr_factor
    else:
        _assign_grads(host, reduced, commit)
        grad_norm = host.training.unscale_and_clip(host._params, _norms(host, commit))
        if host.shards is not None:
            host.shards.drop_unowned_grads()  # the optimizer steps this rank's parts only
        # From here until the step is committed, the model and the optimizer may be half
        # updated: a failure in between leaves this replica without a committed state.
        host.torn_at = context.step
        lr = _optimizer_step(host, context.lr_factor)
        if host.exact is not None:
            host.exact.advance()
        if host.shards is not None:
            gather_failed = ("applied alone as a generation formed" if alone
                             else _gather(host, context))
    host.drop_grads()
    host.cursor = host.cursor.advance(host.order.dataset_size, context.global_batch_size)
    host.torn_at = None
    metrics = read_section(reduced.metrics, host.metric_names)[1]
    if gather_failed is None and not alone:
        _after(host, context, reduced.loss, metrics, applied=not commit.skipped)
    else:  # run by the next generation once the parameters are whole again
        host.unfinished = functools.partial(_after, host, context, reduced.loss, metrics,
                                            applied=not commit.skipped)
    optimizer_s = time.perf_counter() - optimizer_start
    host.faults.enter("idle")
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
        scale=context.scale if host.config.training.precision == "fp16-mixed" else None,
        yielded=reduced.yielded, interrupted=gather_failed,
    )


def _buffers_and_agreement(host: ApplyHost, context: StepContext, computed: Computed,
                           reduced: Reduced, commit: Commit, alone: bool) -> None:
    """The step's buffers committed (rolled back when the step is applied `alone`: then they
    come with the source's state; and when it is skipped with non-finite statistics: a skip
    for an overflow in the scaled gradients ran finite forward passes, whose statistics a
    `GradScaler` loop keeps too), then, with sharded state, the agreement that every rank
    holds the step's sums (`elastic.trainer.apply.agree`), the step's last collective before
    anything is stepped."""
    if alone or (commit.skipped and (host.exact is not None
                                     or not bool(torch.isfinite(reduced.buffers).all()))):
        host.buffers.rollback()
    else:
        try:  # before the optimizer: a failed broadcast leaves nothing half-applied
            host.buffers.commit(reduced.buffers, context.comm, first_with_share(context.plan))
        except BaseException:
            host.drop_grads()
            raise
    if host.shards is not None and not alone:
        agree(host, context, computed, reduced, commit)


def agree(host: ApplyHost, context: StepContext, computed: Computed, reduced: Reduced,
          commit: Commit) -> None:
    """Sharded state, in the apply phase after the step's last other collective (the
    buffers' broadcast) and before anything is stepped: one more sum over the control plane,
    which completes on a rank only once every rank added its part, which each does once it
    got that far. So a rank applies the step only when every rank holds its sums, and a kill
    in the step's collectives leaves no owner of a part a step behind the others
    (`elastic.trainer.sharding.PendingStep`).

    Raises:
        CollectiveError: the sum failed; this rank keeps the step, unapplied, for the next
            generation to apply or drop (`hold`).
    """
    try:
        context.comm.control.allreduce(torch.ones(1, dtype=torch.float64))
    except CollectiveError:
        hold(host, context, computed, reduced, commit)
        raise


def hold(host: ApplyHost, context: StepContext, computed: Computed, reduced: Reduced,
         commit: Commit) -> None:
    """Keeps a step whose agreement failed (`OptimizerShards.pending`), to apply alone or
    drop as the next generation forms."""
    assert host.shards is not None
    quiet = replace(context, chaos=())
    exponents = host._exponents

    def apply() -> None:
        apply_step(host, quiet, computed, reduced, commit, alone=True)

    def drop() -> None:
        host.buffers.rollback()
        host.drop_grads()
        if host.exact is not None:
            host.exact.exponents = exponents

    host.shards.pending = PendingStep(context.step + 1, apply, drop)


def _gather(host: ApplyHost, context: StepContext) -> str | None:
    """Sharded state, after the optimizer stepped this rank's parts: every rank takes the
    parts it does not own from their primaries (`OptimizerShards.gather`). The gather chaos
    faults fire first. Returns None, or the text of the collective error that ended it: the
    step is committed here all the same (this rank's parts are stepped), but the parameters
    of others' parts may be stale, so the chunk ends and the next generation takes them from
    their owners."""
    assert host.shards is not None
    host.faults.enter("gather")
    host.faults.fire(context.chaos, "gather")
    comm = context.comm
    try:
        host.shards.gather(comm, staged_streams(host.device, comm))
    except CollectiveError as e:
        return str(e)
    except Exception as e:
        if not is_allocation_failure(e):
            raise
        # Out of memory for the gather's buffer: this rank's parts are stepped all the same
        # (not half updated); it leaves the generation, whose next one completes the step.
        comm.abort()
        release_frames(e)
        return f"rank {context.rank} ran out of memory in the gather of step {context.step}: {e}"
    return None


def _assign_grads(host: ApplyHost, reduced: Reduced, commit: Commit) -> None:
    """Every parameter's `grad`: its summed gradient (exact mode's sums, the buckets' or
    the flat buffers' slices), none for those no rank reached (`_unreached`), divided by
    the global count with `LossSum` losses, before the optimizer (and clipping) reads it."""
    host.reducer.assign(reduced)
    _unreached(host, reduced.used)
    if commit.divisor is not None:
        for p in host._params:
            if p.grad is not None:
                p.grad.div_(commit.divisor)


def _norms(host: ApplyHost, commit: Commit) -> list[torch.Tensor] | None:
    """Sharded gradients: every parameter's summed gradient's norm (`Reducer.grad_norms`,
    divided by the global count with `LossSum` losses, as the gradients are), for clipping
    over all of them; else None."""
    norms = host.reducer.grad_norms()
    if norms is not None and commit.divisor is not None:
        norms = [n / commit.divisor for n in norms]
    return norms


def _unreached(host: ApplyHost, used: torch.Tensor) -> None:
    """Leaves the parameters that no rank's backward passes reached in this step without
    a gradient, as in one process over the global batch (`zero_grad` sets gradients to
    None): the optimizer skips them (no weight decay, no momentum or Adam moment steps
    them, no state is created for them), where a gradient of zeros would step them. A
    data-dependent branch, an expert no sample was routed to, a layer not called."""
    if used.numel() and not bool(used.all()):
        for p, ranks in zip(host._params, used.tolist(), strict=True):
            if ranks == 0:
                p.grad = None


def _after(host: ApplyHost, context: StepContext, loss: float, metrics: dict[str, float],
           applied: bool) -> None:
    """Once the step is committed: the extra state's `after_step` hooks (applied steps),
    the loss scale and the scheduler.

    Raises:
        AfterStepError: user code raised there (the step stays committed).
    """
    if applied:
        after_step(host.extra, host.model, context.step, context.rank)
    epoch_over = (host.cursor.start(host.order.dataset_size, context.global_batch_size)[0]
                  > host.cursor.epoch)
    # A metric the run has that no sample of this step weighed (returned only for some
    # batches, a count of 0) has no value here, as a skipped step's: NaN, which the scheduler
    # passes over; a name the run never had is the user's mistake.
    values = {name: metrics.get(name, math.nan) for name in host.metric_names}
    host.training.after_step(context.step, context.rank, applied, loss, values, context.epoch,
                             epoch_over)


def _optimizer_step(host: ApplyHost, lr_factor: float) -> float:
    """One optimizer step with the learning rate scaled by `lr_factor` for this step only
    (the optimizer's and scheduler's own values are left as they were). Returns the
    learning rate applied to the first parameter group."""
    groups = host.optimizer.param_groups
    if lr_factor == 1.0:
        host.optimizer.step()
        return float(groups[0]["lr"])
    saved = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = group["lr"] * lr_factor
    applied = float(groups[0]["lr"])
    try:
        host.optimizer.step()
    finally:
        for group, lr in zip(groups, saved, strict=True):
            group["lr"] = lr
    return applied


def first_with_share(plan: BatchPlan) -> int:
    """The lowest rank that ran a forward pass in a step of `plan`."""
    return next((r for r, share in enumerate(plan.shares) if share > 0), 0)
