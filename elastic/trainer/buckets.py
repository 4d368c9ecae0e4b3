"""Gradient buckets whose allreduce overlaps the backward pass, as DDP and Horovod do it.

Parameters are grouped, in reverse order (the order backward produces their gradients), into
buckets of about `bucket_bytes` (the first one smaller, so that communication starts early).
During the backward pass of a step's last micro-batch, a hook copies each gradient into its
bucket as soon as it is accumulated; a bucket whose gradients are all in is reduced at once by
a communication thread, while backward goes on. Buckets are reduced strictly in index order,
so every rank issues the same collectives in the same order whatever order its hooks fire in.
On NCCL with its native allreduce (`CollectiveConfig.algorithm` 'auto' or 'native') the thread
only starts a bucket's allreduce and goes on to the next bucket, which NCCL runs behind it on
its stream with no host round trip between them; it finishes them in order, each as it is
found done while the next bucket fills (four at most are started and not finished). Elsewhere
(the host plane, the CPU transports, the host's algorithms over NCCL) the host sums a bucket
before the next.

The last bucket also carries the step's metadata (summed loss, one vote per rank, the ledger),
so it is launched only when the backward pass has finished on this rank; a rank whose user
code raised still launches every bucket (its content is then ignored), so nobody waits. With
two planes (NCCL) the metadata is summed on its own over the control plane, after the last
bucket.

Host staging (GPU workers on the host plane, `elastic.trainer.staging`): each bucket also has a
host buffer, a slice of the communicator's registered region where it lends one. The hooks
queue a copy of each gradient into it (a DMA into page-locked memory, which the host does not
wait for); the communication thread waits until a bucket's copies are done, sums the host
buffer with the host allreduce while the backward pass goes on, and queues the copy of the sums
back into the bucket's buffer on the device, on the communication thread's own stream
(`CudaStreams.own_stream`). The copies out run on the backward pass's stream and take turns
with its kernels; what overlaps is the host's work (the sums, and a rank's wait for its
peers). The host writes into the host buffers (zeros for a gradient that did not come) only
once the last step's copies back are done.

The buffers live on the parameters' device; the communication thread binds that device and
works on a stream of its own, so that a bucket's reduction waits for that bucket's fences
only, not for all the backward pass has queued on the default stream meanwhile. On a
GPU the hooks copy on the stream autograd runs them on (the user's, under
`torch.cuda.stream(s)`), not the communication thread's: each bucket's copies are fenced with
an event on every stream that made them, which the communication thread's stream waits for
before reducing the bucket, and the caller's stream waits for the communication thread's when
the step reads the results (`wait`). The finiteness of the gradients is checked once per
step, not once per bucket (each check waits for the device). The
buffers are allocated when a step begins (`begin`), which the replica runs inside the step's
vote: a rank whose allocation runs out of memory votes the step down and allocates again
(with its gradients freed) to take part in the collectives.

Sharded gradients (`keep`, stage 2 of `ShardingConfig`): a rank keeps the summed gradients of
the parameters it owns only. `begin` allocates those (the rank's share); a bucket's buffer is
allocated when its first gradient arrives and freed once it is reduced and the owned
gradients are copied out of it; each parameter's own gradient is freed as soon as its hook
copied it. So after the backward pass a rank holds its share and the buckets still in
flight, and at the optimizer step its share alone. Every rank still sees each bucket's whole
sum (an allreduce, as DeepSpeed's ZeRO-2 does with `reduce_scatter` off), from which it
computes each parameter's gradient norm (`norms`), so that clipping uses the norm over all
parameters with no further collective.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.collective import Communicator
from elastic.collective.transport import Pending
from elastic.trainer.device import bind_thread, finite_sum, shaped_like
from elastic.trainer.staging import CudaStreams, HostStaging

# NCCL: buckets started and not finished at most, so that the host never queues so much that
# NCCL's enqueue waits in host code (out of reach of the communicator's abort and deadline)
# behind a collective that a lost peer never lets end; and how often the thread looks for
# finished ones while it waits for the next bucket to fill.
_RUNNING = 4
_POLL_S = 0.0005


@dataclass
class _Bucket:
    dtype: torch.dtype
    params: list[torch.nn.Parameter] = field(default_factory=list)
    numel: int = 0


@dataclass
class _StepState:
    buffers: list[torch.Tensor | None]  # None: not allocated yet, or freed once reduced (keep)
    # Host staging (GPU workers on the host plane): each bucket's host buffer, which the hooks
    # copy into and the host allreduce sums (the last with room for the metadata); the sums
    # are copied back into `buffers`, on the device.
    host: list[torch.Tensor] | None
    ready: list[threading.Event]
    filled: list[int]
    copied: set[int]
    meta_len: int
    vote_slot: int
    nonfinite_vote: float
    meta_separate: torch.Tensor | None = None
    future: Future | None = None
    # per bucket: the streams its copies were made on (GPU only), fenced when it is complete
    streams: list[dict[object, object]] = field(default_factory=list)
    fences: list[list[object]] = field(default_factory=list)
    # Sharded gradients: parameter index -> its summed gradient, for the parameters this
    # rank keeps; and each parameter's summed gradient's 2-norm (when norms are wanted).
    kept: dict[int, torch.Tensor] | None = None
    norms: list[torch.Tensor | None] | None = None
    reduced: set[int] = field(default_factory=set)  # buckets reduced and freed (keep)
    abandoned: bool = False  # the reduce ended before `finish`: no more buckets come


class GradientBuckets:
    """Owns the hooks, the bucket layout and the communication thread of one replica.

    Args:
        params: the parameters that take gradients, in model order.
        bucket_bytes: the size of every bucket but the first.
        first_bucket_bytes: the size of the first bucket (the last layers' gradients).
        keep: sharded gradients (see the module): returns, as each step begins, the indices
            of the parameters whose summed gradients this rank keeps. None: all, in the
            buckets (stage 0 and 1).
        norms: with `keep`, whether to compute every parameter's gradient norm (`norms`).
        staging: GPU workers on the host plane: the buckets are summed in host memory (see
            the module); not with `keep`.
        streams: the stream operations; default: `staging`'s, else CUDA's on a GPU, else none
            (a test may pass a fake).
    """

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int,
                 first_bucket_bytes: int, streams: object | None = None,
                 keep: Callable[[], Collection[int]] | None = None, norms: bool = False,
                 staging: HostStaging | None = None) -> None:
        assert staging is None or keep is None, "sharded gradients are not staged in host memory"
        self.params = params
        self._keep, self._want_norms = keep, norms
        self._staging = staging
        self._index = {id(p): i for i, p in enumerate(params)}
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> bucket, offset in it
        cap = first_bucket_bytes
        for p in reversed(params):
            current = self.buckets[-1] if self.buckets else None
            size = p.numel() * p.element_size()
            if current is None or current.dtype != p.dtype or (
                    current.numel and (current.numel * p.element_size() + size > cap)):
                if current is not None:
                    cap = bucket_bytes
                current = _Bucket(p.dtype)
                self.buckets.append(current)
            self._where[id(p)] = (len(self.buckets) - 1, current.numel)
            current.params.append(p)
            current.numel += p.numel()
        self._lock = threading.Lock()
        self._joined = self._meta_fits_last  # the metadata rides in the last bucket
        self._armed = False
        self._state: _StepState | None = None
        device = params[0].device if params else torch.device("cpu")
        # Stream operations: CUDA's on a GPU, none on the CPU (a test may pass a fake).
        if streams is None and staging is not None:
            streams = staging.streams
        self._streams: Any = streams if streams is not None else (
            CudaStreams() if device.type == "cuda" else None)
        # Host staging: where each bucket starts in its dtype's host buffer.
        self._host_offsets: list[int] = []
        ends: dict[torch.dtype, int] = {}
        for bucket in self.buckets:
            self._host_offsets.append(ends.get(bucket.dtype, 0))
            ends[bucket.dtype] = self._host_offsets[-1] + bucket.numel
        # Host staging: a fence after the last step's copies back to the device (they read the
        # host buffers, which the host then writes only once they are done).
        self._copied_back: object | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="elastic-grad-comm",
                                        initializer=_comm_thread,
                                        initargs=(device, self._streams))
        self._handles: list[object] = []
        self._hooked()

    def _hooked(self) -> None:
        """Each parameter's post-accumulate hook, registered unless it is (`release` removes
        them: a generation that sums without buckets pays no Python call per parameter). A
        parameter frozen since (no gradient to hook) gets none: were it thawed, `finish`
        copies its gradient. Registered again, they run after hooks a user added meanwhile."""
        if self._handles:
            return
        handles = []
        try:
            for p in self.params:
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._hook))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        self._handles = handles

    @property
    def staged(self) -> bool:
        """Whether the buckets are summed in host memory (host staging)."""
        return self._staging is not None

    @property
    def _meta_fits_last(self) -> bool:
        return bool(self.buckets) and self.buckets[-1].dtype in (torch.float32, torch.float64)

    @property
    def begun(self) -> bool:
        """Whether the current step's buffers exist (False after a `begin` that raised)."""
        return self._state is not None

    def begin(self, comm: Communicator, meta_len: int, vote_slot: int, nonfinite_vote: float) -> None:
        """Prepares this step's buffers and starts the communication thread, which waits for
        buckets to fill.

        Raises:
            torch.OutOfMemoryError: the buffers did not fit; nothing was started and `begun`
                is False.
        """
        with self._lock:
            self._state = None  # the last step's buffers go before the new ones are allocated
        self._hooked()
        self._joined = self._meta_fits_last and comm.control is comm
        host = None
        if self._staging is not None:
            buffers: list[torch.Tensor | None] = list(self._allocate(0))
            host = self._host_buffers(comm, meta_len if self._joined else 0)
            kept = None
        elif self._keep is None:
            buffers = list(self._allocate(meta_len if self._joined else 0))
            kept = None
        else:  # the buffers come as their gradients do (`_buffer`)
            buffers = [None] * len(self.buckets)
            kept = {i: torch.empty_like(self.params[i], memory_format=torch.preserve_format)
                    for i in sorted(self._keep())}
        state = _StepState(buffers=buffers, host=host,
                           ready=[threading.Event() for _ in self.buckets],
                           filled=[0] * len(self.buckets), copied=set(), meta_len=meta_len,
                           vote_slot=vote_slot, nonfinite_vote=nonfinite_vote,
                           streams=[{} for _ in self.buckets],
                           fences=[[] for _ in self.buckets], kept=kept,
                           norms=[None] * len(self.params) if kept is not None and self._want_norms
                           else None)
        with self._lock:
            self._state = state
        state.future = self._pool.submit(self._reduce_all, comm, state)

    def _allocate(self, meta_room: int) -> list[torch.Tensor]:
        """One buffer per bucket on its parameters' device, the last with `meta_room` more
        elements for the metadata."""
        last = len(self.buckets) - 1
        return [torch.empty(bucket.numel + (meta_room if i == last else 0), dtype=bucket.dtype,
                            device=bucket.params[0].device)
                for i, bucket in enumerate(self.buckets)]

    def host_sizes(self, meta_room: int) -> dict[torch.dtype, int]:
        """Host staging: the elements of each dtype's host buffer, the metadata's room
        included (what the communicator lends)."""
        sizes: dict[torch.dtype, int] = {}
        for bucket in self.buckets:
            sizes[bucket.dtype] = sizes.get(bucket.dtype, 0) + bucket.numel
        if self.buckets:
            sizes[self.buckets[-1].dtype] += meta_room
        return sizes

    def _host_buffers(self, comm: Communicator, meta_room: int) -> list[torch.Tensor]:
        """Host staging: each bucket's host buffer, a slice of its dtype's buffer (lent by
        the communicator where it can, so that the allreduce sums it where it lies)."""
        assert self._staging is not None
        whole = self._staging.buffers(self.host_sizes(meta_room), comm.shared_buffers)
        last = len(self.buckets) - 1
        return [whole[bucket.dtype][start : start + bucket.numel + (meta_room if b == last else 0)]
                for b, (bucket, start) in enumerate(zip(self.buckets, self._host_offsets, strict=True))]

    def _target(self, state: _StepState, b: int) -> torch.Tensor:
        """Where the gradients of bucket `b` are copied: its host buffer (host staging), else
        its buffer. Called with the lock held."""
        return state.host[b] if state.host is not None else self._buffer(state, b)

    def _put(self, state: _StepState, target: torch.Tensor, p: torch.nn.Parameter) -> None:
        """`p`'s gradient (None: zeros) into `target`, its slice of a bucket, laid out as `p`
        (`shaped_like`): on a GPU on the current stream; into a host buffer (host staging) as
        a copy the device makes, or as zeros the host writes once the last step's copies out
        of it are done."""
        grad = p.grad
        if state.host is None:
            if grad is None:
                target.zero_()
            else:
                shaped_like(target, p).copy_(grad)
        elif grad is not None:
            self._streams.copy(shaped_like(target, p), grad)
        else:
            self._settle()
            target.zero_()

    def _settle(self) -> None:
        """Host staging: the host waits until the last step's copies back to the device are
        done (they read the host buffers it is about to write)."""
        done, self._copied_back = self._copied_back, None
        if done is not None:
            self._streams.block(done)

    def _buffer(self, state: _StepState, b: int) -> torch.Tensor:
        """Bucket `b`'s buffer, allocated now if it is not yet (sharded gradients; the last
        bucket with room for the metadata when it carries it). Called with the lock held."""
        buffer = state.buffers[b]
        if buffer is None:
            assert b not in state.reduced, f"bucket {b} was reduced and freed"
            bucket = self.buckets[b]
            room = state.meta_len if self._joined and b == len(self.buckets) - 1 else 0
            buffer = state.buffers[b] = torch.empty(bucket.numel + room, dtype=bucket.dtype,
                                                    device=bucket.params[0].device)
        return buffer

    def materialise(self) -> None:
        """Sharded gradients: allocates every bucket buffer not allocated yet (those whose
        gradients did not all come through hooks), before `finish` fills them in; a no-op
        otherwise.

        Raises:
            torch.OutOfMemoryError: some did not fit (those that did are kept).
        """
        with self._lock:
            state = self._state
            assert state is not None, "materialise without begin"
            for b in range(len(self.buckets)):
                if b not in state.reduced:
                    self._buffer(state, b)

    def arm(self, armed: bool) -> None:
        """Hooks copy gradients only while armed (the step's last backward pass)."""
        self._armed = armed

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self._armed or p.grad is None:
            return
        with self._lock:
            state = self._state
            if state is None:
                return
            b, offset = self._where[id(p)]
            again = id(p) in state.copied
            if again:
                # Accumulated again in this backward pass (reentrant activation checkpointing
                # calls backward once per segment): the whole gradient replaces the part
                # copied, unless that part is gone (stage 2 freed it) or on its way.
                self._again(state, p, b)
            self._put(state, self._target(state, b)[offset : offset + p.numel()], p)
            self._copied_on(state, b)
            if again:
                return
            state.copied.add(id(p))
            if state.kept is not None:
                p.grad = None  # in its bucket now; the rank keeps its share of the sums only
            state.filled[b] += 1
            last = b == len(self.buckets) - 1
            if state.filled[b] == len(self.buckets[b].params) and not last:
                self._release(state, b)

    def _again(self, state: _StepState, p: torch.nn.Parameter, b: int) -> None:
        """A second accumulation of `p`'s gradient in one backward pass, into bucket `b`:
        refused where the first part can no longer be replaced by the whole.

        Raises:
            RuntimeError: stage 2 (the part copied was freed), or the bucket was already
                handed to the communication thread (its sum would miss the rest).
        """
        where = (f"a parameter of shape {tuple(p.shape)} had its gradient accumulated twice in "
                 "one backward pass (reentrant activation checkpointing calls backward once per "
                 "segment)")
        fix = "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
        if state.kept is not None:
            raise RuntimeError(f"{where}, after its bucket took it, which sharding.stage 2 "
                               f"cannot sum; {fix}, or sharding.stage=1 with "
                               "collective.overlap=False")
        if state.ready[b].is_set():
            raise RuntimeError(f"{where}, after its bucket was sent to be summed; {fix}, or "
                               "collective.overlap=False (the gradients are then summed after "
                               "the backward pass)")
        if self._streams is not None:  # the whole gradient lands after the part, on any stream
            current = self._streams.current()
            for stream in state.streams[b].values():
                if stream != current:
                    self._streams.wait(self._streams.fence(stream))

    def _copied_on(self, state: _StepState, b: int) -> None:
        """Notes the stream the calling thread copied into bucket `b` on (GPU only)."""
        if self._streams is not None:
            # Keyed by the stream itself: torch.cuda.current_stream() builds a new object at
            # each call, equal to the others of its CUDA stream (by `id`, each copy was a
            # stream of its own: an event and a wait per parameter).
            stream = self._streams.current()
            state.streams[b].setdefault(stream, stream)

    def _release(self, state: _StepState, b: int) -> None:
        """Bucket `b` is complete: a fence on every stream that copied into it, then it goes
        to the communication thread."""
        if self._streams is not None:
            state.fences[b] = [self._streams.fence(s) for s in state.streams[b].values()]
        state.ready[b].set()

    def finish(self, meta: torch.Tensor) -> None:
        """Backward is over on this rank (or failed): gradients that no hook delivered (unused
        parameters, an error) are filled in, the metadata is put in, and every bucket left is
        released to the communication thread."""
        self._armed = False
        with self._lock:
            state = self._state
            assert state is not None, "finish without begin"
            for p in self.params:
                if id(p) in state.copied:
                    continue
                b, offset = self._where[id(p)]
                self._put(state, self._target(state, b)[offset : offset + p.numel()], p)
                self._copied_on(state, b)
                if state.kept is not None:
                    p.grad = None
            if self._joined:  # the host's metadata: no copy back to the device reads it
                last = len(self.buckets) - 1
                self._target(state, last)[-state.meta_len :].copy_(meta.to(self.buckets[-1].dtype))
                self._copied_on(state, last)
            else:
                state.meta_separate = meta.clone()
            for b, event in enumerate(state.ready):
                if not event.is_set():
                    self._release(state, b)

    def abandon(self) -> None:
        """The step's reduce failed on this rank (before `finish`, or in it): the
        communication thread stops at the next bucket it waits for instead of waiting for
        good, and issues no more collectives (the rank's error re-forms the generation)."""
        with self._lock:
            state = self._state
            if state is None:
                return
            state.abandoned = True
        for event in state.ready:
            event.set()

    def release(self) -> None:
        """Frees the last step's buffers, unregisters the host staging's region and removes
        the hooks (the next generation sums without buckets); `begin` starts afresh and hooks
        them again."""
        self._armed = False
        with self._lock:
            self._state = None
        if self._staging is not None:
            self._staging.release()  # the device is idle then: no copy back is pending
            self._copied_back = None
        for handle in self._handles:
            handle.remove()  # type: ignore[attr-defined]
        self._handles = []

    def wait(self) -> torch.Tensor:
        """Waits for every bucket's allreduce; returns the reduced metadata (float64).

        Raises:
            CollectiveError: the communication failed or was aborted.
        """
        state = self._state
        assert state is not None and state.future is not None
        try:
            done = state.future.result()
        except BaseException:
            if state.host is not None:  # the copies back queued before the failure end first
                with contextlib.suppress(Exception):
                    self._streams.idle()
            raise
        if done is not None and self._streams is not None:
            self._streams.wait(done)  # what the step reads next follows the reductions
        if state.host is not None:
            self._copied_back = done
        if self._joined:
            last = state.host[-1] if state.host is not None else state.buffers[-1]
            assert last is not None
            meta = last[-state.meta_len :].to("cpu", torch.float64)
        else:
            assert state.meta_separate is not None
            meta = state.meta_separate
        if state.kept is not None:
            with self._lock:  # the rank's share is copied out: the last bucket goes too
                state.buffers[-1] = None
        return meta

    def assign_grads(self) -> None:
        """Sets every parameter's gradient to its reduced slice (a view, no copy); with
        sharded gradients, the kept parameters' to their summed gradients and the others'
        to None."""
        state = self._state
        assert state is not None
        if state.kept is not None:
            for i, p in enumerate(self.params):
                p.grad = state.kept.get(i)
            return
        for p in self.params:
            b, offset = self._where[id(p)]
            buffer = state.buffers[b]
            assert buffer is not None
            p.grad = shaped_like(buffer[offset : offset + p.numel()], p)

    def taken(self) -> frozenset[int]:
        """The ids of the parameters whose gradient a hook copied into a bucket this step
        (with sharded gradients it freed them: they were reached all the same)."""
        state = self._state
        return frozenset(state.copied) if state is not None else frozenset()

    def norms(self) -> list[torch.Tensor] | None:
        """Sharded gradients with norms: every parameter's summed gradient's 2-norm (a 0-d
        tensor on its device), the same on every rank; else None."""
        state = self._state
        if state is None or state.norms is None:
            return None
        assert all(n is not None for n in state.norms), "norms read before the reduce ended"
        return [n for n in state.norms if n is not None]

    def _reduce_all(self, comm: Communicator, state: _StepState) -> object | None:
        """The communication thread's step: every bucket reduced in order, each after its
        fences; returns a fence on this thread's stream after the last (GPU), else None.

        On NCCL (the native allreduce) a bucket's allreduce is only started
        (`Communicator.start_allreduce`): the next one goes out as soon as its bucket is
        ready, while the earlier ones run (`_RUNNING` at most), and the thread finishes them
        in order (with sharded gradients, a bucket's sums are read then). Elsewhere the host
        sums each bucket before the next."""
        sums: list[torch.Tensor] = []
        last = len(self.buckets) - 1
        running: collections.deque[tuple[int, list[Pending]]] = collections.deque()
        for i, bucket in enumerate(self.buckets):
            # While buckets run, the ones that finish are taken as this one fills (their
            # sums read, their buffers freed with sharded gradients, an error seen early).
            while not state.ready[i].wait(_POLL_S if running else None):
                self._take_finished(comm, state, running)
            if state.abandoned:
                return None  # the communicator is aborted as the generation re-forms
            if state.host is not None:  # the host reads what the device copied
                for fence in state.fences[i]:
                    self._streams.block(fence)
                buffer = state.host[i]
            else:
                if self._streams is not None:
                    for fence in state.fences[i]:
                        self._streams.wait(fence)
                buffer = state.buffers[i]
                assert buffer is not None, f"bucket {i} released without a buffer"
            # Read once, before the metadata goes.
            sums.append(finite_sum(buffer[: bucket.numel]).reshape(1).to(torch.float64))
            if i == last and self._joined:
                self._vote_nonfinite(buffer[bucket.numel :], state, _finite(sums))
            if state.host is None and len(running) >= _RUNNING:  # the cap: the oldest first
                self._finished(comm, state, *running.popleft())
            started = None if state.host is not None else comm.start_allreduce(buffer)
            if started is None:
                comm.allreduce(buffer)
                self._summed(state, i, buffer)
                continue
            running.append((i, started))
            self._take_finished(comm, state, running)
        while running:
            self._finished(comm, state, *running.popleft())
        if not self._joined:
            assert state.meta_separate is not None
            self._vote_nonfinite(state.meta_separate, state, _finite(sums))
            comm.control.allreduce(state.meta_separate)
        return self._streams.fence(self._streams.current()) if self._streams is not None else None

    def _take_finished(self, comm: Communicator, state: _StepState,
                       running: collections.deque[tuple[int, list[Pending]]]) -> None:
        """Finishes the started buckets that are done, in order (never blocks)."""
        while running and all(h.is_done() for h in running[0][1]):
            self._finished(comm, state, *running.popleft())

    def _finished(self, comm: Communicator, state: _StepState, b: int,
                  started: list[Pending]) -> None:
        """Waits for bucket `b`'s started allreduce (this thread's stream then follows it)."""
        comm.wait(started)
        buffer = state.buffers[b]
        assert buffer is not None, f"bucket {b} released while it was summed"
        self._summed(state, b, buffer)

    def _summed(self, state: _StepState, b: int, buffer: torch.Tensor) -> None:
        """Bucket `b` is summed in `buffer`: on the host plane the sums go back to the device
        (on this thread's stream), and sharded gradients take their share."""
        if state.host is not None:
            device = state.buffers[b]
            assert device is not None
            self._streams.copy(device, buffer[: self.buckets[b].numel])
            # Not reused before the copy is done, whoever frees it (an error ends the
            # step before the caller's stream waits for this one).
            self._streams.retire(device)
        if state.kept is not None:
            self._keep_share(state, b, buffer, last=b == len(self.buckets) - 1)

    def _keep_share(self, state: _StepState, b: int, buffer: torch.Tensor, last: bool) -> None:
        """Sharded gradients, on the communication thread once bucket `b` is summed: the
        norms of its parameters' sums (if wanted), the kept parameters' sums copied out, and
        the buffer freed (the last one once `wait` read the metadata in it)."""
        assert state.kept is not None
        for p in self.buckets[b].params:
            i = self._index[id(p)]
            _, offset = self._where[id(p)]
            piece = buffer[offset : offset + p.numel()]
            if state.norms is not None:  # float32 at least: a half sum's norm may overflow
                state.norms[i] = torch.linalg.vector_norm(
                    piece, dtype=torch.float32 if piece.element_size() < 4 else None)
            if i in state.kept:
                state.kept[i].copy_(shaped_like(piece, p))
                if self._streams is not None:  # allocated on the caller's stream
                    self._streams.retire(state.kept[i])
        if last:
            return
        if self._streams is not None:
            self._streams.retire(buffer)  # allocated on the backward's stream
        with self._lock:
            state.buffers[b] = None
            state.reduced.add(b)

    @staticmethod
    def _vote_nonfinite(meta: torch.Tensor, state: _StepState, finite: bool) -> None:
        # Slot 0 is the loss; votes follow. A rank that already voted (user error, out of
        # memory) keeps its vote.
        if not finite and meta[1 + state.vote_slot] == 0:
            meta[1 + state.vote_slot] = state.nonfinite_vote


def _comm_thread(device: torch.device, streams: Any) -> None:
    """The communication thread's start: bound to the device, on a stream of its own
    (`CudaStreams.own_stream`) where there are streams."""
    bind_thread(device)
    if streams is not None:
        streams.own_stream()


def _finite(sums: list[torch.Tensor]) -> bool:
    """Whether every bucket's sum is finite (one read from the device)."""
    return bool(torch.isfinite(torch.cat(sums)).all()) if sums else True
