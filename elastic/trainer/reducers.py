"""The reduce phase's strategies, behind one protocol: how a replica's gradients become the
summed gradients of the global batch, and the step's metadata with them.

- `FlatReducer`: after the backward pass, the gradients are joined into one buffer per dtype
  and each is summed in one allreduce (`elastic.trainer.flat`); on CPU workers the buffers
  may be the communicator's registered shared memory, on GPU workers of a host plane they
  are staged in host memory (`elastic.trainer.staging`: that region, page-locked).
- `BucketReducer`: buckets reduced while the backward pass runs (`elastic.trainer.buckets`),
  staged in host memory as the flat buffers are on GPU workers of a host plane.
- `ExactReducer`: exact mode's fixed-point integer sums (`elastic.trainer.exact`), the same
  bits for any split.
- `ShardedReducer`: buckets as `BucketReducer`, each rank keeping the summed gradients of the
  parameters it owns only (sharding stage 2), and every parameter's gradient norm for
  clipping.

The replica picks one when it is built (`make_reducer`) and drives it through the step: `reset`
as the step begins, `begin` first in the compute phase (inside the step's vote: what it
allocates may run out of memory), `arm`/`after_forward`/`after_backward` around each piece,
`used` at the end of the compute phase, `reduce` in the reduce phase and `assign` in the apply
phase. What a reducer needs of its replica comes in as a `StepHost`, never as the replica
itself: this module does not import `elastic.trainer.replica`.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any, Protocol

import torch

from elastic.errors import CollectiveError
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.device import is_allocation_failure, release_cached_memory
from elastic.trainer.exact import ExactSum
from elastic.trainer.flat import all_finite, allreduce_flat, flatten_grads, unflatten_grads
from elastic.trainer.loss import LossForm
from elastic.trainer.metrics import exchange_names, read_section
from elastic.trainer.staging import HostStaging
from elastic.trainer.step import Computed, Reduced, StepContext, Vote

logger = logging.getLogger(__name__)

# Elements of step metadata the registered gradient buffers leave room for: the votes, the
# loss, the ledger (one per sample of the global batch) and the metrics; a step whose metadata
# is longer copies its buffers through the transport instead (correct, a little slower).
META_ROOM = 1 << 16

# The step's metadata from what the reducer decided: (loss_sum, vote, count) -> float64 meta.
Pack = Callable[[float, Vote, float], torch.Tensor]


class StepHost(Protocol):
    """What a reducer needs of the replica it reduces for."""

    device: torch.device

    def drop_grads(self) -> None:
        """Sets every parameter's gradient to None."""
        ...


class Reducer(Protocol):
    """One way of summing the gradients of a step over the ranks (see the module)."""

    def registered_bytes(self) -> int:
        """Shared memory the communicator should lend for this reducer's buffers (0: none)."""
        ...

    def reset(self, meta_len: int) -> None:
        """The step (or a redo of it) begins: nothing is summed yet."""
        ...

    def begin(self, context: StepContext) -> None:
        """First in the compute phase, inside the step's vote (an allocation that fails here
        is this rank's out-of-memory vote)."""
        ...

    def arm(self, last: bool) -> None:
        """Before each backward pass; `last`: the step's last on this rank."""
        ...

    def after_forward(self, loss: torch.Tensor, items: float | torch.Tensor,
                      form: LossForm) -> None:
        """After each forward pass, before its backward (the loss it will backpropagate)."""
        ...

    def after_backward(self) -> None:
        """After each backward pass."""
        ...

    def used(self) -> torch.Tensor:
        """At the end of the compute phase: 1 for each parameter this rank's backward passes
        gave a gradient, else 0 (float64)."""
        ...

    def reduce(self, context: StepContext, computed: Computed, pack: Pack,
               comm_start: float) -> Reduced:
        """The reduce phase: the gradients and the metadata summed over ranks.

        Raises:
            CollectiveError: the communication failed or was aborted, or this rank could not
                allocate what it needs to take part.
        """
        ...

    def assign(self, reduced: Reduced) -> None:
        """Sets every parameter's `grad` to its summed gradient (None where this rank does
        not keep it: sharded gradients)."""
        ...

    def grad_norms(self) -> list[torch.Tensor] | None:
        """After `assign`: every parameter's summed gradient's 2-norm, when this rank does not
        hold every summed gradient (sharded gradients with clipping on); else None (the norms
        come from the gradients themselves)."""
        ...

    def abandon(self) -> None:
        """The step's reduce will not run (an error before it): what `begin` started stops
        waiting for it."""
        ...

    def release(self) -> None:
        """Another reducer takes over from the next step (a generation of one rank, or of
        several again): what this one kept from its last step (buffers) is freed."""
        ...


def make_reducer(host: StepHost, params: list[torch.nn.Parameter], overlap: bool,
                 bucket_bytes: int, first_bucket_bytes: int,
                 exact: ExactSum | None, loss_slot: int,
                 keep: Callable[[], Collection[int]] | None = None,
                 norms: bool = False, staging: HostStaging | None = None) -> Reducer:
    """Exact mode's reducer when `exact` is given, else sharded buckets with `keep` (the
    indices of the parameters whose sums this rank keeps; `norms`: clipping needs the
    norms), else buckets with `overlap`, else flat. `staging`: GPU workers on the host plane
    sum their gradients in host memory (`elastic.trainer.staging`; not with `keep`)."""
    if exact is not None:
        return ExactReducer(params, exact, loss_slot)
    if keep is not None:
        assert staging is None, "sharded gradients are not staged in host memory"
        return ShardedReducer(host, params, GradientBuckets(
            params, bucket_bytes, first_bucket_bytes, keep=keep, norms=norms))
    if overlap:
        return BucketReducer(host, params, GradientBuckets(
            params, bucket_bytes, first_bucket_bytes, staging=staging))
    return FlatReducer(host, params, staging)


def used_params(params: list[torch.nn.Parameter],
                taken: Collection[int] = frozenset()) -> torch.Tensor:
    """1 for each parameter with a gradient, else 0 (float64). `taken`: the ids of parameters
    whose gradient a bucket's hook already took (and freed: sharded gradients), reached too.

    Raises:
        TypeError: a backward pass left a sparse gradient (`F.embedding(..., sparse=True)`,
            a custom autograd function; sparse layers are refused when the model is built):
            an error of this rank's user code, as the step sums dense gradients.
    """
    reached = []
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("the backward pass left a sparse gradient, which elastic does "
                            "not support: its steps sum dense gradients over the ranks; "
                            "compute it dense (sparse=False)")
        reached.append(p.grad is not None or id(p) in taken)
    return torch.tensor(reached, dtype=torch.float64)


def take_part(host: StepHost, context: StepContext, allocate: Callable[[], Any]) -> Any:
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
    host.drop_grads()
    release_cached_memory(host.device)
    try:
        return allocate()
    except Exception as e:
        out_of_memory = is_allocation_failure(e)
        context.comm.abort()
        release_frames(e)
        what = ("ran out of memory for its gradient buffers" if out_of_memory else
                f"could not allocate its gradient buffers ({type(e).__name__}: {e})")
        error = CollectiveError(
            f"rank {context.rank} {what} in step {context.step}, even with its gradients "
            "freed, so it could not take part in the step's collectives",
            rank=context.rank)
        error.__cause__ = e
    # Out of the except block: the failed allocation's frames are gone before the cache
    # is released.
    release_cached_memory(host.device)
    raise error


def fits(device: torch.device, allocate: Callable[[], Any]) -> tuple[bool, Any]:
    """Runs `allocate`; if it runs out of memory, releases the allocator's cache and runs it
    once more. Returns (True, what it returned), or (False, None) if it did not fit either
    time (other errors propagate)."""
    for attempt in range(2):
        failed = False
        try:
            return True, allocate()
        except Exception as e:
            if not is_allocation_failure(e):
                raise
            failed = True  # retried below: out of this block, its frames released
        if failed and attempt == 0:
            release_cached_memory(device)
    return False, None


def left_collectives(context: StepContext, error: BaseException) -> CollectiveError:
    """An out-of-memory error inside the reduce, past the allocations the vote covers (in the
    communication itself): this rank may have left the step's collectives half done, so it
    aborts its communicator and reports a collective error caused by it (which
    `elastic.trainer.device.is_out_of_memory` classifies as out of memory)."""
    context.comm.abort()
    release_frames(error)
    return CollectiveError(f"rank {context.rank} ran out of memory in the collectives of "
                           f"step {context.step}: {error}", rank=context.rank)


class NamedMetrics(Protocol):
    metric_names: tuple[str, ...]  # the metric names every rank knows


def with_metric_names(host: NamedMetrics, context: StepContext, computed: Computed,
                      reduced: Reduced) -> Reduced:
    """After the reduce: the step's metrics under the names every rank knows, learning them
    into `host.metric_names` first (`metrics.exchange_names`, then one more sum) when some
    rank's metrics named a new one.

    Raises:
        CollectiveError: the exchange or the sum failed, or a peer announced malformed names.
    """
    new, _ = read_section(reduced.metrics, context.metric_names)
    if not new:
        return reduced
    host.metric_names = exchange_names(context.comm.control, list(computed.metrics.sums),
                                       host.metric_names)
    section = computed.metrics.section(host.metric_names)
    context.comm.control.allreduce(section)
    return replace(reduced, metrics=section)


def release_frames(error: BaseException) -> None:
    """Clears the local variables of the finished frames in `error`'s traceback (the tensors
    of a failed attempt: activations, half-allocated buffers), so that an error that is kept
    (as a cause, or until the caller handles it) holds no memory; the traceback stays."""
    traceback.clear_frames(error.__traceback__)


class _Hooks:
    """The `Reducer` hooks a strategy has nothing to do in, as no-ops (each overrides its
    own), and `used` from the parameters' gradients."""

    params: list[torch.nn.Parameter]

    def registered_bytes(self) -> int:
        return 0

    def reset(self, meta_len: int) -> None:
        return

    def begin(self, context: StepContext) -> None:
        return

    def arm(self, last: bool) -> None:
        return

    def after_forward(self, loss: torch.Tensor, items: float | torch.Tensor,
                      form: LossForm) -> None:
        return

    def after_backward(self) -> None:
        return

    def used(self) -> torch.Tensor:
        return used_params(self.params)

    def grad_norms(self) -> list[torch.Tensor] | None:
        return None

    def abandon(self) -> None:
        return

    def release(self) -> None:
        return


class SoloReducer(_Hooks):
    """A generation of one rank (stage 0 and 1, not exact mode): the sum of the gradients
    over one rank is that rank's own, so they stay where the backward passes left them: no
    buffer, no copy, no collective (DDP and the other reducers copy them all, which on a GPU
    is a kernel per parameter; the buckets' hooks are removed while it is in use). The loss and
    gradients are checked for finiteness as the others check them, and the packed metadata
    is its own sum. The replica picks it for a generation of one rank (`Replica._begin`)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def reduce(self, context: StepContext, computed: Computed, pack: Pack,
               comm_start: float) -> Reduced:
        vote = computed.vote
        if vote == Vote.OK and not (math.isfinite(computed.loss_sum)
                                    and grads_finite(self.params)):
            vote = Vote.NONFINITE
        meta = pack(computed.loss_sum, vote, computed.count)
        return Reduced.unpack(meta, context, None, time.perf_counter() - comm_start)

    def assign(self, reduced: Reduced) -> None:
        return  # each gradient is its own sum


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    """Whether every element of every gradient is finite: each gradient's largest absolute
    value (which, unlike a sum, cannot overflow), in its own dtype, a few fused kernels per
    device and dtype, and one read per device."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and p.grad.numel():  # an empty gradient has no peak
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    finite = [torch.isfinite(torch.stack(torch._foreach_norm(grads, ord=math.inf))).all()
              .reshape(1) for grads in groups.values()]
    return bool(torch.cat([t.cpu() for t in finite]).all()) if finite else True


def region_bytes(sizes: Iterable[int]) -> int:
    """The registered region that holds buffers of `sizes` bytes, one per dtype (each
    64-byte aligned), and room for the step's metadata up to `META_ROOM` elements (and for
    the alignment after it)."""
    return sum(-(-n // 64) * 64 for n in sizes) + META_ROOM * 8 + 64


class FlatReducer(_Hooks):
    """One buffer per dtype after the backward pass, each summed in one allreduce."""

    def __init__(self, host: StepHost, params: list[torch.nn.Parameter],
                 staging: HostStaging | None = None) -> None:
        self.host, self.params, self.staging = host, params, staging

    def registered_bytes(self) -> int:
        """One copy of the gradients, each dtype 64-byte aligned, and room for the step's
        metadata up to `META_ROOM` elements, where they are summed in host memory (CPU
        workers, and GPU workers on the host plane); else 0."""
        if self.host.device.type != "cpu" and self.staging is None:
            return 0
        sizes: dict[torch.dtype, int] = {}
        for p in self.params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        return region_bytes(sizes.values())

    def release(self) -> None:
        if self.staging is not None:
            self.staging.release()

    def reduce(self, context: StepContext, computed: Computed, pack: Pack,
               comm_start: float) -> Reduced:
        room = context.meta_len if context.comm.control is context.comm else 0
        vote, flat = self._flatten(context, computed.vote, room)
        if vote == Vote.OK and not (math.isfinite(computed.loss_sum) and all_finite(flat)):
            vote = Vote.NONFINITE
        meta = pack(computed.loss_sum, vote, computed.count)
        allreduce_flat(context.comm, flat, meta, room=room > 0)
        return Reduced.unpack(meta, context, flat, time.perf_counter() - comm_start)

    def assign(self, reduced: Reduced) -> None:
        assert reduced.flat is not None
        unflatten_grads(self.params, reduced.flat, self.staging)

    def _flatten(self, context: StepContext, vote: Vote,
                 room: int) -> tuple[Vote, dict[torch.dtype, torch.Tensor]]:
        """The flat gradient buffers (`flatten_grads`; zeros when this rank voted the step
        down; `room` for the metadata) and this rank's vote. If they do not fit, the
        allocator's cache is released and they are allocated once more; if they still do not
        fit, the vote is OUT_OF_MEMORY (if it was OK) and they are zeros, allocated with the
        gradients freed. Their size does not depend on the micro-batch: the backoff that the
        vote brings frees no memory they need, which the warning logged then says.

        Raises:
            CollectiveError: they did not fit even then (`take_part`).
        """
        lend = context.comm.shared_buffers
        # GPU gradients on the host plane (no NCCL: several workers may share the GPU) are
        # staged in host memory (`elastic.trainer.staging`).
        staging = self.staging

        def zeros() -> dict[torch.dtype, torch.Tensor]:
            return flatten_grads(self.params, zero=True, meta_len=room, lend=lend, staging=staging)

        if vote != Vote.OK:
            return vote, take_part(self.host, context, zeros)
        ok, flat = fits(self.host.device, lambda: flatten_grads(
            self.params, zero=False, meta_len=room, lend=lend, staging=staging))
        if ok:
            return vote, flat
        nbytes = sum(p.numel() * p.element_size() for p in self.params)
        logger.warning(
            "rank %d: out of memory for the flat gradient buffers of step %d (%d bytes on %s, "
            "beside the gradients themselves); their size does not depend on the micro-batch, "
            "so the step is voted down as out of memory, but halving the micro-batch frees "
            "only activation memory", context.rank, context.step, nbytes, self.host.device)
        return Vote.OUT_OF_MEMORY, take_part(self.host, context, zeros)


class BucketReducer(_Hooks):
    """Buckets reduced while the backward pass runs (`GradientBuckets`)."""

    def __init__(self, host: StepHost, params: list[torch.nn.Parameter],
                 buckets: GradientBuckets) -> None:
        self.host, self.params, self.buckets = host, params, buckets

    def registered_bytes(self) -> int:
        """Host staging (GPU workers on the host plane): the buckets' host buffers, as
        `FlatReducer.registered_bytes`; else 0 (the buckets are summed where they lie)."""
        if not self.buckets.staged:
            return 0
        return region_bytes(n * torch.empty(0, dtype=dtype).element_size()
                            for dtype, n in self.buckets.host_sizes(0).items())

    def begin(self, context: StepContext) -> None:
        """Allocates the step's buffers and starts the communication thread that the last
        backward pass feeds.

        Raises:
            torch.OutOfMemoryError: the buffers did not fit (nothing was started).
        """
        self.buckets.begin(context.comm, context.meta_len, context.rank, float(Vote.NONFINITE))

    def arm(self, last: bool) -> None:
        self.buckets.arm(last)  # gradients are complete in the last backward pass

    def abandon(self) -> None:
        self.buckets.abandon()

    def release(self) -> None:
        self.buckets.release()

    def reduce(self, context: StepContext, computed: Computed, pack: Pack,
               comm_start: float) -> Reduced:
        try:
            return self._reduce(context, computed, pack, comm_start)
        except BaseException:
            self.buckets.abandon()  # the communication thread must not wait for good
            raise

    def _reduce(self, context: StepContext, computed: Computed, pack: Pack,
                comm_start: float) -> Reduced:
        vote = computed.vote
        if not self.buckets.begun:
            # Beginning them raised (the vote says why: out of memory, or an error); this rank
            # still issues every collective, so they are begun again, their content ignored.
            take_part(self.host, context, lambda: self.begin(context))
        if vote == Vote.OK and not math.isfinite(computed.loss_sum):
            vote = Vote.NONFINITE  # the gradients' finiteness is checked as they are sent
        meta = pack(computed.loss_sum, vote, computed.count)
        self.buckets.finish(meta)
        meta = self.buckets.wait()
        return Reduced.unpack(meta, context, None, time.perf_counter() - comm_start)

    def assign(self, reduced: Reduced) -> None:
        self.buckets.assign_grads()


class ShardedReducer(BucketReducer):
    """Buckets whose sums each rank keeps only for the parameters it owns (`GradientBuckets`
    with `keep`: each parameter's gradient is freed once its hook copied it, each bucket once
    it is summed and the owned sums copied out)."""

    def used(self) -> torch.Tensor:
        """The parameters this rank's backward passes reached, those whose gradient a hook
        already took into a bucket (and freed) included."""
        return used_params(self.params, self.buckets.taken())

    def _reduce(self, context: StepContext, computed: Computed, pack: Pack,
                comm_start: float) -> Reduced:
        if not self.buckets.begun:  # beginning them raised: begun again to take part
            take_part(self.host, context, lambda: self.begin(context))
        vote = self._materialise(context, computed.vote)
        if vote != computed.vote:
            computed = replace(computed, vote=vote)
        return super()._reduce(context, computed, pack, comm_start)

    def _materialise(self, context: StepContext, vote: Vote) -> Vote:
        """The bucket buffers that no hook allocated (their gradients come in `finish`; their
        content does not matter when this rank voted the step down, but every rank takes part
        in every bucket's sum), before the metadata is packed: if they do not fit, the
        allocator's cache is released and they are allocated once more; if they still do not
        fit, this rank votes the step down as out of memory (if it voted OK) and allocates
        them with its gradients freed.

        Raises:
            CollectiveError: they did not fit even then (`take_part`).
        """
        if fits(self.host.device, self.buckets.materialise)[0]:
            return vote
        logger.warning("rank %d: out of memory for the gradient buckets of step %d; the step "
                       "is voted down as out of memory", context.rank, context.step)
        take_part(self.host, context, self.buckets.materialise)
        return Vote.OUT_OF_MEMORY if vote == Vote.OK else vote

    def grad_norms(self) -> list[torch.Tensor] | None:
        return self.buckets.norms()


class ExactReducer(_Hooks):
    """Exact mode: each group's loss and gradients in fixed-point integers
    (`elastic.trainer.exact.ExactSum`), summed exactly in one float64 allreduce with the
    metadata (integers there too: votes, forms, flags, the ledger)."""

    def __init__(self, params: list[torch.nn.Parameter], exact: ExactSum, loss_slot: int) -> None:
        self.params, self.exact, self.loss_slot = params, exact, loss_slot

    def reset(self, meta_len: int) -> None:
        self.exact.begin(meta_len)  # each attempt of the step sums afresh

    def after_forward(self, loss: torch.Tensor, items: float | torch.Tensor,
                      form: LossForm) -> None:
        """One group's loss (and `LossSum` count, where it lies) into the exact sums."""
        values = [(self.loss_slot, loss.detach().reshape(1))]
        if form == LossForm.SUM:
            values.append((self.loss_slot + 1,
                           items.reshape(1).to(torch.float64) if isinstance(items, torch.Tensor)
                           else torch.tensor([items], dtype=torch.float64)))
        self.exact.add_many(values)

    def after_backward(self) -> None:
        """One group's gradient into the exact sums, each group's on its own (the next
        backward starts from no gradient)."""
        fused = []  # on a GPU: every gradient read in one go (`ExactSum.add_many`)
        for slot, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.exact.fused(p.grad.device):
                fused.append((slot, p.grad))
            else:  # on the CPU one at a time, and freed at once
                self.exact.add(slot, p.grad)
                p.grad = None
        self.exact.add_many(fused)
        for p in self.params:
            p.grad = None

    def used(self) -> torch.Tensor:
        added = self.exact.added
        return torch.tensor([slot in added for slot in range(len(self.params))],
                            dtype=torch.float64)

    def reduce(self, context: StepContext, computed: Computed, pack: Pack,
               comm_start: float) -> Reduced:
        exact = self.exact
        vote = computed.vote
        if vote == Vote.OK and exact.overflowed:
            vote = Vote.RESCALE
        elif vote == Vote.OK and exact.nonfinite:
            vote = Vote.NONFINITE
        meta = pack(0.0, vote, 0.0)
        # The count travels whatever the vote, as in the default reduce: whether a LossSum
        # step's count is 0 must not depend on which ranks' groups were non-finite.
        joined = exact.payload(zero=vote not in (Vote.OK, Vote.RESCALE), meta=meta,
                               keep=(self.loss_slot + 1,))
        context.comm.allreduce(joined)
        exact.finish(joined)
        reduced = Reduced.unpack(joined[exact.payload_length :], context, None,
                                 time.perf_counter() - comm_start)
        total, count = exact.scalar(self.loss_slot), exact.scalar(self.loss_slot + 1)
        loss = total / count if LossForm.SUM in reduced.forms and count > 0 else total
        return replace(reduced, loss=loss, count=count)

    def assign(self, reduced: Reduced) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for slot, p in enumerate(self.params):
            if self.exact.fused(p.device):
                by_device.setdefault(p.device, []).append(slot)
            else:  # on the CPU one at a time
                p.grad = self.exact.value(slot).to(p.dtype).view_as(p)
        for device, slots in by_device.items():  # one copy of the sums to each GPU
            for slot, value in zip(slots, self.exact.values(slots, device), strict=True):
                p = self.params[slot]
                p.grad = value.to(p.dtype).view_as(p)
