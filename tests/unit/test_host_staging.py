"""Host staging (GPU workers on the host plane) on the CPU, with streams whose copies run late.

`DeferredStreams` stands in for `torch.cuda`: a copy is queued on the calling thread's stream and
its target holds NaN until the copy runs, which is only when a fence after it is waited for
(`block` by the host, `wait` by another stream) or its stream is synchronised. A copy that
has run still reads its source until the host has waited for something after it: a host write
into that source before then is recorded as a violation (on a GPU the copy could have read
the new bytes). So a step that reads a host buffer before the copies into it are done sums NaN,
a step that skips the copies back trains on NaN, and a host write into a buffer the last
step's copies back still read is caught, none of which CPU tensors alone would show.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import threading

import pytest
import torch
from torch import nn

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.collective import RendezvousServer, shm
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveError
from elastic.trainer.buckets import GradientBuckets
from elastic.trainer.flat import flatten_grads, unflatten_grads
from elastic.trainer.replica import Replica
from elastic.trainer.staging import HostStaging
from tests import streams
from tests.threads import train_two_ranks

pytestmark = pytest.mark.timeout(120)


class DeferredStreams:
    """Each thread's current stream is CUDA's default ('user') until it takes its own (the
    buckets' communication thread: 'comm'; `tests.streams.Threads`). See the module."""

    def __init__(self, fail_register: str | None = None) -> None:
        self.lock = threading.RLock()
        self.queued: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self.count = itertools.count()
        # copies that ran and may still read their source: (order, stream, source, its bytes
        # then, the streams whose later work is ordered after the copy)
        self.reading: list[list] = []
        self.violations: list[str] = []
        self.log: list[tuple] = []
        self.registered: dict[int, int] = {}
        self.fail_register = fail_register
        self.threads = streams.Threads()

    def current(self) -> str:
        return self.threads.current()

    def own_stream(self) -> None:
        self.threads.own_stream()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            stream = self.current()
            dst.fill_(float("nan"))  # undefined until the copy has run
            self._device_wrote(stream, dst)
            self.queued.setdefault(stream, []).append((next(self.count), dst, src))

    def fence(self, stream: str) -> tuple:
        with self.lock:
            return ("fence", stream, next(self.count))

    def _device_wrote(self, stream: str, dst: torch.Tensor) -> None:
        """A copy on `stream` wrote `dst`: the copies this stream's work is ordered after had
        read their sources by then, so the bytes written there are not the host's."""
        low, high = dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size()
        for e in self.reading:
            src, seen = e[2], e[3]
            start = src.data_ptr()
            a, b = max(low, start), min(high, start + src.numel() * src.element_size())
            if stream in e[4] and a < b:
                _bytes(seen)[a - start : b - start] = _bytes(src)[a - start : b - start]

    def _run(self, stream: str, upto: int, waiter: str | None = None) -> None:
        """Runs `stream`'s copies before `upto`; `waiter`: a stream whose later work is
        ordered after them."""
        queue = self.queued.get(stream, [])
        for entry in [e for e in queue if e[0] < upto]:
            _, dst, src = entry
            dst.copy_(src)
            self._device_wrote(stream, dst)
            queue.remove(entry)
            self.reading.append([entry[0], stream, src, src.clone(), {stream}])
        for e in self.reading:
            if waiter is not None and e[1] == stream and e[0] < upto:
                e[4].add(waiter)

    def _host_waited(self, upto: int, stream: str | None) -> None:
        """The host waited for `stream`'s work before `upto` (None: every stream's): the
        copies ordered before it (run on it, or on a stream it waited for) have read their
        sources; a source that changed meanwhile was written while it could still be read."""
        for entry in [e for e in self.reading
                      if e[0] < upto and (stream is None or stream in e[4])]:
            if not torch.equal(_bytes(entry[2]), _bytes(entry[3])):
                self.violations.append(f"a copy's source of {entry[2].numel()} elements was written "
                                       "by the host before the host waited for the copy")
            self.reading.remove(entry)

    def wait(self, event: tuple) -> None:
        with self.lock:
            self.log.append(("wait", self.current(), event))
            self._run(event[1], event[2], waiter=self.current())

    def block(self, event: tuple) -> None:
        with self.lock:
            self.log.append(("block", self.current(), event))
            self._run(event[1], event[2])
            self._host_waited(event[2], event[1])

    def synchronize(self) -> None:
        with self.lock:
            upto = next(self.count)
            self.log.append(("synchronize", self.current()))
            self._run(self.current(), upto)
            self._host_waited(upto, self.current())

    def idle(self) -> None:
        with self.lock:
            upto = next(self.count)
            self.log.append(("idle",))
            for stream in list(self.queued):
                self._run(stream, upto)
            self._host_waited(upto, None)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        # In stream order (what this stream does next sees it), but the host does not know
        # when it has read `host`.
        with self.lock:
            self.reading.append([next(self.count), self.current(), host, host.clone(),
                                 {self.current()}])
            return host.clone()

    def retire(self, tensor: torch.Tensor) -> None:
        return

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.log.append(("pinned", numel, dtype))
        return torch.full((numel,), float("nan"), dtype=dtype)

    def register(self, address: int, nbytes: int) -> str | None:
        self.log.append(("register", address, nbytes))
        if self.fail_register is not None:
            return self.fail_register
        self.registered[address] = nbytes
        return None

    def unregister(self, address: int) -> None:
        self.log.append(("unregister", address))
        del self.registered[address]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as bytes, in address order (a gradient laid out as its parameter, say
    transposed, is one block too: a view of it, not a copy in logical order)."""
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


# --- the lifecycle of the registered region --------------------------------------------------

class Region:
    """A lender over a page-aligned mapping, as `Communicator.shared_buffers` lends."""

    def __init__(self, nbytes: int = 3 * mmap.PAGESIZE, offset: int = 64) -> None:
        self.mm = mmap.mmap(-1, nbytes)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.offset = offset
        self.calls = 0

    def lend(self, sizes: dict[torch.dtype, int]) -> dict[torch.dtype, torch.Tensor] | None:
        self.calls += 1
        out, at = {}, self.offset
        for dtype, numel in sizes.items():
            size = numel * torch.empty(0, dtype=dtype).element_size()
            if at + size > self.bytes.numel():
                return None
            out[dtype] = self.bytes[at : at + size].view(dtype)
            at = -(-(at + size) // 64) * 64
        return out


def test_a_lent_region_is_page_locked_once_per_generation_and_unlocked_after_its_last_copy():
    streams = DeferredStreams()
    staging = HostStaging(streams)
    first, second = Region(), Region()
    sizes = {torch.float32: 100, torch.float64: 50}
    lent = staging.buffers(sizes, first.lend)
    base = first.bytes.data_ptr()
    # The whole pages around the buffers, once, however often the same buffers are lent.
    assert streams.log == [("register", base, mmap.PAGESIZE)]
    assert staging.registered
    assert lent[torch.float32].data_ptr() == base + 64
    again = staging.buffers(sizes, first.lend)
    assert again[torch.float64].data_ptr() == lent[torch.float64].data_ptr()
    assert len(streams.log) == 1
    # A larger request reaches the next page: registered again, the old pages unlocked first,
    # once the device is idle.
    staging.buffers({torch.float32: 1500}, first.lend)
    assert streams.log[1:] == [("idle",), ("unregister", base), ("register", base, 2 * mmap.PAGESIZE)]
    # The next generation's region replaces it.
    del streams.log[:]
    staging.buffers(sizes, second.lend)
    assert streams.log == [("idle",), ("unregister", base),
                           ("register", second.bytes.data_ptr(), mmap.PAGESIZE)]
    # No region lent (a host with one rank): buffers of its own, page-locked by the allocator,
    # kept from step to step and grown when too small.
    del streams.log[:]
    own = staging.buffers(sizes, lambda sizes: None)
    assert streams.log == [("idle",), ("unregister", second.bytes.data_ptr()),
                           ("pinned", 100, torch.float32), ("pinned", 50, torch.float64)]
    assert not staging.registered and streams.registered == {}
    del streams.log[:]
    kept = staging.buffers(sizes, None)
    assert kept[torch.float32].data_ptr() == own[torch.float32].data_ptr() and streams.log == []
    staging.buffers({torch.float32: 200, torch.float64: 50}, None)
    assert streams.log == [("pinned", 200, torch.float32)]
    staging.buffers(sizes, first.lend)
    del streams.log[:]
    staging.release()
    assert streams.log == [("idle",), ("unregister", base)] and streams.registered == {}


def test_a_region_that_cannot_be_page_locked_is_used_as_it_is_and_said_once(caplog):
    streams = DeferredStreams(fail_register="cudaHostRegister returned CUDA error 712")
    staging = HostStaging(streams)
    region = Region()
    with caplog.at_level(logging.WARNING, logger="elastic.trainer.staging"):
        for _ in range(3):
            lent = staging.buffers({torch.float32: 10}, region.lend)
        assert lent[torch.float32].data_ptr() == region.bytes.data_ptr() + 64
        assert not staging.registered
        assert [e[0] for e in streams.log] == ["register"]  # asked once, not every step
        # The next generation's communicator may map its region where the last one was: it
        # is asked again all the same (said once more only if the reason changes).
        again = Region()
        again.bytes, again.mm = region.bytes, region.mm
        staging.buffers({torch.float32: 10}, again.lend)
        staging.buffers({torch.float32: 10}, again.lend)
        assert [e[0] for e in streams.log] == ["register"] * 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "error 712" in warnings[0] and "page-locked" in warnings[0]


# --- buckets: what the host reads, writes and copies back -----------------------------------

class IdentityComm:
    """One rank: an allreduce leaves its tensor as it is (and logs it)."""

    rank, world_size = 0, 1

    def __init__(self, lend=None) -> None:
        self.control = self
        self.sums: list[int] = []
        self.lend = lend

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert torch.isfinite(tensor).all(), "a bucket was summed before its copies were done"
        self.sums.append(tensor.numel())
        return tensor

    def shared_buffers(self, sizes):
        return self.lend(sizes) if self.lend is not None else None


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        return self.out(torch.tanh(h))


def _staged_two_branches(transposed: bool = False) -> tuple[
        TwoBranches, list[nn.Parameter], DeferredStreams, Region, HostStaging]:
    """The model of the two tests below, its parameters, and a staging over deferred streams
    with a region it may be lent; `transposed`: `a`'s weight stored transposed (dense, not
    contiguous, as a channels-last convolution's), and so its gradient."""
    torch.manual_seed(0)
    model = TwoBranches()
    if transposed:
        model.a.weight = nn.Parameter(model.a.weight.detach().t().contiguous().t())
    streams = DeferredStreams()
    return (model, list(model.parameters()), streams, Region(nbytes=16 * mmap.PAGESIZE),
            HostStaging(streams))


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("lent", [True, False], ids=["lent", "own"])
def test_buckets_sum_what_the_gpu_copied_and_copy_the_sums_back_before_the_step_reads_them(
        lent, transposed):
    # Step 1 reaches every parameter; step 2 leaves `b` out, so the host writes zeros into
    # b's part of a host buffer that step 1's copies back read: only after they are done.
    model, params, streams, region, staging = _staged_two_branches(transposed)
    buckets = GradientBuckets(params, bucket_bytes=16 * 17 * 4, first_bucket_bytes=1024,
                              staging=staging)
    assert len(buckets.buckets) >= 3 and buckets.staged
    comm = IdentityComm(region.lend if lent else None)
    meta = torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)
    x = torch.randn(4, 16)
    for use_b in (True, False):
        model.zero_grad(set_to_none=True)
        model(x, use_b).sum().backward()  # unarmed: nothing copied
        expected = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                    for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        buckets.begin(comm, meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
        buckets.arm(True)
        model(x, use_b).sum().backward()
        buckets.finish(meta)
        summed = buckets.wait()
        buckets.assign_grads()
        torch.testing.assert_close(summed, meta)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
            assert p.grad.stride() == p.stride(), name
    assert comm.sums[: len(buckets.buckets)] == [
        b.numel + (len(meta) if i == len(buckets.buckets) - 1 else 0)
        for i, b in enumerate(buckets.buckets)]
    assert streams.violations == []
    # every bucket's host buffer was read by the host only after the copies into it were done:
    # one wait per bucket and step (all its copies on one stream; a wait per parameter before)
    blocks = [e for e in streams.log if e[0] == "block" and e[1] == "comm"]
    assert len(blocks) == len(buckets.buckets) * 2
    assert (len(streams.registered) == 1) == lent
    buckets.release()
    assert streams.registered == {}


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("lent", [True, False], ids=["lent", "own"])
def test_flat_buffers_are_filled_by_the_gpu_before_the_host_writes_zeros_into_them(lent,
                                                                                    transposed):
    # As above, after the backward pass: step 2's zeros for `b` go into host memory that step
    # 1's copy back to the device read, only once the copies of step 2 are done (which the
    # stream orders after step 1's).
    model, params, streams, region, staging = _staged_two_branches(transposed)
    x = torch.randn(4, 16)
    for use_b in (True, False):
        model.zero_grad(set_to_none=True)
        model(x, use_b).sum().backward()
        expected = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = flatten_grads(params, zero=False, meta_len=3, lend=region.lend if lent else None,
                             staging=staging)
        assert all(torch.isfinite(b).all() for b in flat.values())  # the copies were done
        assert (flat[torch.float32].data_ptr() == region.bytes.data_ptr() + 64) == lent
        flat[torch.float32] = flat[torch.float32][:-3]  # as allreduce_flat leaves it
        unflatten_grads(params, flat, staging)
        for p, want in zip(params, expected, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
            assert p.grad.stride() == p.stride()
    streams.synchronize()
    assert streams.violations == []


def test_a_failed_reduce_waits_for_the_copies_back_it_queued_before_it_raises():
    # The second bucket's allreduce fails after the first bucket's sums were queued back to
    # the device: the step raises only once they are done (the next step reuses the memory).
    torch.manual_seed(0)
    model = TwoBranches()
    streams = DeferredStreams()
    buckets = GradientBuckets(list(model.parameters()), bucket_bytes=16 * 17 * 4,
                              first_bucket_bytes=1024, staging=HostStaging(streams))

    class Failing(IdentityComm):
        def allreduce(self, tensor, *args, **kwargs):
            if self.sums:
                raise CollectiveError("a peer left")
            return super().allreduce(tensor)

    meta = torch.zeros(3, dtype=torch.float64)
    buckets.begin(Failing(), meta_len=3, vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    model(torch.randn(4, 16), True).sum().backward()
    buckets.finish(meta)
    with pytest.raises(CollectiveError):
        buckets.wait()
    assert streams.queued.get("comm") == [] and ("idle",) in streams.log
    assert streams.violations == []


def test_the_fake_catches_a_host_write_before_the_copy_back_is_done():
    # The oracle of the test above: without the wait before the host writes zeros, the write
    # is seen (on a GPU, the copy back of the last step could have read the zeros).
    streams = DeferredStreams()
    host, device = torch.ones(8), torch.zeros(8)
    streams.copy(device, host)
    streams.wait(streams.fence("user"))
    host.zero_()
    streams.synchronize()
    assert streams.violations and torch.equal(device, torch.ones(8))


# --- a replica of two ranks whose gradients are staged in host memory -----------------------

@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


@pytest.mark.skipif(shm.supported() is not None, reason=str(shm.supported()))
@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_two_staged_ranks_sum_in_their_registered_regions_and_train_as_plain_pytorch(
        tmp_path, server, registered_calls, monkeypatch, overlap):
    steps, batch = 3, 16
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=batch, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=steps, ledger=True)
    fakes: list[DeferredStreams] = []

    def staging(replica: Replica) -> HostStaging:  # as a GPU worker on the host plane
        fakes.append(DeferredStreams())
        return HostStaging(fakes[-1])

    monkeypatch.setattr(Replica, "_staging", staging)
    replicas = train_two_ranks(server, config, str(tmp_path), steps, release=True)
    # every sum was made where the gradients lay: in the registered regions
    assert registered_calls and sorted(set(registered_calls)) == [0, 1]
    assert len(registered_calls) == 2 * steps * (1 if not overlap else len(
        replicas[0].reducer.buckets.buckets))
    built = fakes[1:]  # the first built the replica that asked the region's size
    for fake in built:
        assert fake.violations == []
        assert [e[0] for e in fake.log if e[0] in ("register", "unregister")] == [
            "register", "unregister"]  # once for the generation, and unlocked when released
