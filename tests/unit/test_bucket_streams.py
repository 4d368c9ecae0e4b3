"""The gradient buckets' stream ordering, with fake streams on CPU: the hooks copy on the stream
autograd gives them (a user's side stream under `torch.cuda.stream(s)`), so every bucket's
copies are fenced on each stream that made them, the communication thread's stream waits for
those fences before it reduces the bucket, and the caller's stream waits for the communication
thread's before the step reads the results. On a GPU the fakes are `torch.cuda`'s streams and
events; without the fences the communication stream could read a bucket still being copied."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elastic.trainer.buckets import GradientBuckets
from tests import streams


class FakeStreams:
    """Each thread's current stream is CUDA's default ('user') until it takes its own (the
    communication thread: 'comm'; `tests.streams.Threads`); every call is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.threads = streams.Threads()

    def _name(self) -> str:
        return self.threads.name()

    def current(self) -> str:
        return streams.current(self._name())

    def own_stream(self) -> None:
        self.threads.own_stream()

    def fence(self, stream: str) -> tuple:
        with self.lock:
            event = ("event", stream, len(self.log))
            self.log.append(("fence", stream, event))
        return event

    def wait(self, event: tuple) -> None:
        with self.lock:
            self.log.append(("wait", self._name(), event))


class Comm:
    rank, world_size = 0, 1

    def __init__(self, log: list, lock: threading.Lock) -> None:
        self.control = self
        self.log, self.lock = log, lock

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        with self.lock:
            self.log.append(("allreduce", tensor.numel()))
        return tensor

    def start_allreduce(self, tensor: torch.Tensor) -> None:
        return None  # the host sums each bucket (`allreduce`)


def test_each_bucket_is_reduced_after_the_fences_of_the_streams_that_filled_it():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1))
    params = list(model.parameters())
    streams = FakeStreams()
    buckets = GradientBuckets(params, bucket_bytes=64 * 65 * 4, first_bucket_bytes=1024,
                              streams=streams)
    assert len(buckets.buckets) >= 3
    comm = Comm(streams.log, streams.lock)
    meta = torch.zeros(4, dtype=torch.float64)
    buckets.begin(comm, meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    model(torch.randn(8, 64)).sum().backward()
    buckets.finish(meta)
    buckets.wait()
    log = streams.log
    reductions = [i for i, entry in enumerate(log) if entry[0] == "allreduce"]
    assert len(reductions) == len(buckets.buckets)
    fences = [entry[2] for entry in log if entry[0] == "fence" and entry[1] == "user"]
    assert len(fences) == len(buckets.buckets)  # one per bucket: all its copies on one stream
    for fence in fences:
        waited = log.index(("wait", "comm", fence))
        # the communication thread waited for it before the reduction of that bucket
        assert any(r > waited for r in reductions)
    for b, r in enumerate(reductions):
        waits = [i for i, e in enumerate(log[:r]) if e[0] == "wait" and e[1] == "comm"]
        assert len(waits) >= b + 1, "a bucket was reduced before its fence was waited for"
    # Last: the caller's stream waits for the communication thread's, after every reduction.
    comm_fence = next(e for e in log if e[0] == "fence" and e[1] == "comm")
    assert log.index(("wait", "user", comm_fence[2])) > reductions[-1]
    buckets.assign_grads()
    assert all(p.grad is not None for p in params)


def test_a_gradient_accumulated_again_on_another_stream_lands_after_the_first_copy():
    # Reentrant checkpointing can run the second accumulation on another stream: the whole
    # gradient's copy must not race the part's copy into the same place.
    class Named(FakeStreams):
        def _name(self) -> str:
            name = threading.current_thread().name
            return "comm" if name.startswith("elastic-grad-comm") else name

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    streams = Named()
    buckets = GradientBuckets(list(model.parameters()), bucket_bytes=1 << 20,
                              first_bucket_bytes=1 << 20, streams=streams)
    meta = torch.zeros(4, dtype=torch.float64)
    buckets.begin(Comm(streams.log, streams.lock), meta_len=len(meta), vote_slot=0,
                  nonfinite_vote=2.0)
    buckets.arm(True)
    head = model[1]
    side = threading.Thread(target=torch.autograd.backward, name="side",
                            args=(head(torch.randn(2, 64)).sum(),), kwargs={"inputs": [head.weight]})
    try:
        side.start()
        side.join()
        torch.autograd.backward(head(torch.randn(2, 64)).sum(), inputs=[head.weight])
        [fence] = [e[2] for e in streams.log if e[0] == "fence" and e[1] == "side"]
        assert ("wait", threading.current_thread().name, fence) in streams.log
    finally:
        buckets.abandon()  # the communication thread ends whatever happened


@pytest.mark.parametrize("overlap", [True, False], ids=["buckets", "flat"])
def test_float16_gradients_whose_sum_exceeds_float16_are_finite(overlap):
    """Finiteness is read off a sum; in float16 one of 100,000 gradients of 1 is infinite
    (the largest float16 is 65504), which voted a finite step down."""
    from elastic.trainer.flat import all_finite

    weight = nn.Parameter(torch.zeros(100_000, dtype=torch.float16))
    if not overlap:
        assert all_finite({torch.float16: torch.ones(100_000, dtype=torch.float16)})
        assert not all_finite({torch.float16: torch.tensor([1.0, float("nan")],
                                                           dtype=torch.float16)})
        return
    buckets = GradientBuckets([weight], bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    log: list = []
    meta = torch.zeros(2, dtype=torch.float64)
    buckets.begin(Comm(log, threading.Lock()), meta_len=len(meta), vote_slot=1,
                  nonfinite_vote=3.0)
    buckets.arm(True)
    weight.sum().backward()
    buckets.finish(meta)
    summed = buckets.wait()
    assert float(summed[1]) == 0.0  # the vote slot: OK
    buckets.release()
