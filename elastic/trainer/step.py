"""The phases of one global step on one rank, and what passes between them.

`Replica.run_step` drives four phases, in this order, on every rank of a generation:

1. compute: forward and backward over the micro-batches of this rank's share; an error in
   user code or an out-of-memory error is latched into this rank's vote, never raised
   (`Computed`).
2. reduce: the gradients and the step's metadata (summed loss, one vote per rank, the item
   count and every rank's loss form, the ledger) summed over ranks, in buckets that overlap
   the backward pass or flat after it (`Reduced`).
3. verdict: what the summed votes decide; a pure function of them, so every rank decides the
   same (`verdict`: `Commit` or a voted-down outcome).
4. apply: on a commit, the gradients divided by the global item count (`LossSum` losses only),
   the optimizer and scheduler step, the cursor advance and the record.

Every rank runs the reduce whatever its vote, so that no rank is left waiting in a collective.
The metadata is one float64 vector: `[loss_sum, vote of rank 0, ..., vote of rank w-1, count,
form of rank 0, ..., form of rank w-1, yield, ledger..., buffers..., metrics...]`; each rank
writes only its own vote and form slots and its own part of the ledger, so the sum over ranks
holds every rank's vote, form and index exactly (and the count: integers, exact below 2**24
even when the metadata rides in a float32 buffer). The buffers section is
`BufferSync.section`: the BatchNorm running-statistic terms every rank adds, so that all ranks
write the same buffers. `yield` counts the ranks the controller asked to end their chunk
(`Replica.yielding`), so that all end it after the same step. The metrics section is
`elastic.trainer.metrics`'s: a new-names flag, then (sum, weight) per user metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

import torch

from elastic.adapt.plan import BatchPlan
from elastic.collective import Communicator
from elastic.config import ChaosEvent
from elastic.trainer.loss import LossForm, form_error
from elastic.trainer.metrics import MetricSums, section_length
from elastic.trainer.outcomes import NonFinite, OutOfMemory, UserFailure


class Vote(IntEnum):
    """One rank's vote on the step, written into its own slot of the metadata."""

    OK = 0
    USER_ERROR = 1  # user code raised (data, loss, backward)
    OUT_OF_MEMORY = 2
    NONFINITE = 3  # the loss or a gradient is NaN or infinite
    RESCALE = 4  # exact mode: a group's values do not fit the fixed-point scale; redo the step


@dataclass(frozen=True)
class StepContext:
    """What every phase of one step on this rank reads; fixed when the step begins.

    Attributes:
        step: the global step being run (the committed step count).
        epoch: the epoch the global batch comes from.
        plan: shares and micro-batches of this generation.
        comm: the generation's communicator.
        indices: this rank's share of the global batch, as data set indices.
        chaos: this rank's faults to inject at this step.
        lr_factor: scales this step's learning rate only.
        ledger: whether the metadata carries the batch's indices.
        buffers: length of the metadata's buffers section (`BufferSync.length`).
        first_piece: the global position of this rank's first forward pass among the step's
            (rank 0's pieces come first, then rank 1's, ...).
        metric_names: the user metrics the replica knows when the step begins.
        params: the parameters that take gradients: length of the metadata's section that
            says which of them the step's backward passes reached (`pack_meta`'s `used`).
        scale: the loss scale of 'fp16-mixed' (1.0 otherwise).
        started: `time.perf_counter()` when the step began.
        wall_start: `time.time()` when the step began.
    """

    step: int
    epoch: int
    plan: BatchPlan
    comm: Communicator
    indices: torch.Tensor
    chaos: tuple[ChaosEvent, ...]
    lr_factor: float
    ledger: bool
    started: float
    wall_start: float
    buffers: int = 0
    first_piece: int = 0
    metric_names: tuple[str, ...] = ()
    params: int = 0
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def meta_len(self) -> int:
        """Length of the step's metadata vector."""
        return (3 + 2 * self.world_size + (self.global_batch_size if self.ledger else 0)
                + self.buffers + self.params + section_length(self.metric_names))

    @property
    def pieces(self) -> int:
        """Forward passes of the step over all ranks."""
        return sum(self.plan.accumulation(r) for r in range(self.world_size))


@dataclass(frozen=True)
class Computed:
    """What the compute phase leaves for the reduce. With `vote` OK, each parameter's `grad`
    holds this rank's gradient of its part of the global mean loss (with `LossSum` losses: of
    its part of the global summed loss, which the apply phase divides by the global count).

    Attributes:
        loss_sum: the sum of this rank's scaled micro-batch losses, or of its `LossSum` totals
            (so far, if one raised).
        count: the sum of this rank's `LossSum` counts (0 with scalar losses).
        form: the form of this rank's losses in this step.
        vote: OK, USER_ERROR or OUT_OF_MEMORY.
        error: the traceback behind a vote other than OK.
        data_s: seconds spent loading and collating samples.
        compute_s: seconds from the step's start to the end of the last backward pass.
        metrics: this rank's user metric sums.
        used: which parameters this rank's backward passes reached (`pack_meta`'s `used`);
            None when the compute did not finish (the step is voted down).
    """

    loss_sum: float
    count: float
    form: LossForm
    vote: Vote
    error: str | None
    data_s: float
    compute_s: float
    metrics: MetricSums = field(default_factory=MetricSums)
    used: torch.Tensor | None = None

    @property
    def user_traceback(self) -> str | None:
        """The traceback of an error in user code on this rank, if there was one."""
        return self.error if self.vote == Vote.USER_ERROR else None


def pack_meta(context: StepContext, loss_sum: float, vote: Vote, count: float = 0.0,
              form: LossForm = LossForm.NONE, buffers: torch.Tensor | None = None,
              metrics: MetricSums | None = None, yielding: bool = False,
              used: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's contribution to the step's metadata (float64, `context.meta_len` long);
    `buffers` is this rank's buffers section (`context.buffers` long), `metrics` its user
    metric sums, `yielding` whether the controller asked this rank to end its chunk, `used`
    1 for each parameter this rank's backward passes gave a gradient, else 0 (`context.params`
    long; summed over ranks, a 0 is a parameter the global batch did not reach)."""
    flags = torch.zeros(2 * context.world_size + 2, dtype=torch.float64)
    flags[context.rank] = float(vote)
    flags[context.world_size] = count
    flags[context.world_size + 1 + context.rank] = float(form)
    flags[2 * context.world_size + 1] = float(yielding)
    ledger = torch.zeros(context.global_batch_size if context.ledger else 0, dtype=torch.float64)
    if context.ledger:
        offset = context.plan.offset(context.rank)
        ledger[offset : offset + len(context.indices)] = context.indices.to(torch.float64)
    section = (buffers.to(torch.float64) if buffers is not None
               else torch.zeros(context.buffers, dtype=torch.float64))
    if len(section) != context.buffers:
        raise ValueError(f"a buffers section of {len(section)} values; the step expects "
                         f"{context.buffers}")
    reached = (used.to(torch.float64) if used is not None
               else torch.zeros(context.params, dtype=torch.float64))
    if len(reached) != context.params:
        raise ValueError(f"a used section of {len(reached)} values; the step expects "
                         f"{context.params}")
    user = (metrics or MetricSums()).section(context.metric_names)
    return torch.cat([torch.tensor([loss_sum], dtype=torch.float64), flags, ledger, section,
                      reached, user])


@dataclass(frozen=True)
class Reduced:
    """What the reduce phase leaves: the metadata summed over ranks, and the summed gradients.

    Attributes:
        loss: the loss of the global batch: the sum of every rank's `loss_sum`, divided by
            the global count with `LossSum` losses.
        votes: every rank's vote, in rank order.
        count: the global `LossSum` item count (0 with scalar losses).
        forms: every rank's `LossForm`, in rank order.
        indices: the global batch's indices, when the ledger is on.
        buffers: the summed buffers section.
        used: per parameter, the ranks whose backward passes gave it a gradient (the apply
            phase leaves a parameter that none did without one, as one process would).
        metrics: the summed metrics section (`elastic.trainer.metrics.read_section`).
        yielded: some rank was asked to end its chunk: every rank ends it after this step.
        flat: the summed gradients of the flat reduce, one buffer per dtype; None when they
            are in the gradient buckets.
        comm_s: seconds spent in the reduce (the communication nothing overlapped).
    """

    loss: float
    votes: tuple[float, ...]
    count: float
    forms: tuple[float, ...]
    indices: tuple[int, ...] | None
    buffers: torch.Tensor
    flat: dict[torch.dtype, torch.Tensor] | None
    comm_s: float
    metrics: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))
    yielded: bool = False
    used: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    @classmethod
    def unpack(cls, meta: torch.Tensor, context: StepContext,
               flat: dict[torch.dtype, torch.Tensor] | None, comm_s: float) -> Reduced:
        """Reads the summed metadata `meta` (see `pack_meta`)."""
        world = context.world_size
        ledger = 3 + 2 * world
        section = ledger + (context.global_batch_size if context.ledger else 0)
        indices = (tuple(int(i) for i in meta[ledger:section].tolist()) if context.ledger
                   else None)
        buffers = meta[section : section + context.buffers].to(torch.float64)
        reached = section + context.buffers
        used = meta[reached : reached + context.params].to(torch.float64)
        user = meta[reached + context.params :].to(torch.float64)
        count = float(meta[1 + world])
        forms = tuple(meta[2 + world : 2 + 2 * world].tolist())
        loss = float(meta[0])
        if LossForm.SUM in forms and count > 0:
            loss /= count
        return cls(loss=loss, votes=tuple(meta[1 : 1 + world].tolist()), count=count,
                   forms=forms, indices=indices, buffers=buffers, flat=flat, comm_s=comm_s,
                   metrics=user, yielded=float(meta[2 + 2 * world]) > 0, used=used)


@dataclass(frozen=True)
class Commit:
    """The vote lets the step through on every rank.

    Attributes:
        skipped: ranks whose loss or gradients were not finite under the policy 'skip'; when
            there are any, no rank applies the update (its samples count as consumed).
        divisor: the global item count the summed gradients are divided by before the
            optimizer step (`LossSum` losses); None for scalar losses.
    """

    skipped: tuple[int, ...] = ()
    divisor: float | None = None


@dataclass(frozen=True)
class Rescale:
    """Exact mode: some group's values did not fit the fixed-point scale; every rank widens
    the scale (`ExactSum.rescale`) and runs the step again. Never leaves `Replica.run_step`."""

    step: int
    ranks: tuple[int, ...]


def verdict(step: int, votes: Sequence[float], nonfinite: Literal["stop", "skip"],
            traceback: str | None, forms: Sequence[float] = (),
            count: float = 0.0) -> Commit | UserFailure | OutOfMemory | NonFinite | Rescale:
    """What the summed votes decide for step `step`.

    Pure, so every rank, reading the same summed votes, reaches the same verdict. A user error
    on any rank outranks everything else, and so do loss forms that cannot make a step (ranks
    that disagree, or a global `LossSum` count of 0: a user error on every rank that computed a
    loss); then out of memory (its ranks are every rank that voted down, so a redo lowers their
    micro-batches); then, in exact mode, values too large for the fixed-point scale (the step
    is run again at a wider scale; any non-finite values show in the redo); a step only
    non-finite ranks voted down is skipped or stops the run, as `nonfinite` says.

    Args:
        step: the step voted on.
        votes: every rank's vote (a `Vote` value), in rank order.
        nonfinite: the run's policy for non-finite losses and gradients.
        traceback: this rank's traceback, when it voted `Vote.USER_ERROR`.
        forms: every rank's `LossForm` value, in rank order.
        count: the global `LossSum` item count.

    Returns:
        `Commit` (possibly skipping the update; dividing the gradients by `count` with
        `LossSum` losses), or the outcome that voted the step down.
    """
    failed = tuple(rank for rank, vote in enumerate(votes) if vote != Vote.OK)
    bad = tuple(rank for rank in failed if votes[rank] == Vote.NONFINITE)
    rescale = tuple(rank for rank in failed if votes[rank] == Vote.RESCALE)
    users = tuple(rank for rank in failed if votes[rank] == Vote.USER_ERROR)
    if users:
        return UserFailure(step=step, ranks=users, traceback=traceback)
    message = form_error(step, tuple(forms), count, complete=len(bad) == len(failed))
    if message is not None:
        ranks = tuple(rank for rank, form in enumerate(forms) if form != LossForm.NONE)
        return UserFailure(step=step, ranks=ranks, traceback=message)
    divisor = count if LossForm.SUM in forms else None
    if not failed:
        return Commit(divisor=divisor)
    if len(bad) + len(rescale) < len(failed):
        return OutOfMemory(step=step, ranks=tuple(r for r in failed if r not in rescale))
    if rescale:
        return Rescale(step=step, ranks=rescale)
    return (Commit(skipped=bad, divisor=divisor) if nonfinite == "skip"
            else NonFinite(step=step, ranks=bad))
