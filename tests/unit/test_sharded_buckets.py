"""Sharded gradients in the buckets (sharding stage 2), one rank with a fake communicator
whose sum doubles each buffer (as two ranks with the same gradients would): each parameter's
gradient is freed once its hook copied it, each bucket once it is summed (on a GPU, after the
communication stream's work on it: fake streams here), the rank keeps the sums of its own
parameters only, and every parameter's norm comes from the whole sum; a parameter the backward
pass did not reach is filled with zeros and reported unreached. And, at every stage, a gradient
accumulated twice in one backward pass (reentrant checkpointing): summed whole while its bucket
waits, refused once the bucket was sent."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from elastic.trainer.buckets import GradientBuckets
from tests import streams


class Streams:
    def __init__(self) -> None:
        self.retired: list[int] = []
        self.lock = threading.Lock()

    def current(self) -> str:
        return streams.current("stream")

    def own_stream(self) -> None:
        return

    def fence(self, stream: str) -> tuple:
        return ("event", stream)

    def wait(self, event: tuple) -> None:
        return

    def retire(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.retired.append(tensor.numel())


class Doubling:
    """A communicator whose allreduce sums two equal contributions."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.control = self
        self.sizes: list[int] = []

    def allreduce(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.sizes.append(tensor.numel())
        tensor.mul_(2)
        return tensor

    def start_allreduce(self, tensor: torch.Tensor) -> None:
        return None  # the host sums each bucket (`allreduce`)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1))


def test_a_rank_keeps_its_share_of_the_sums_and_frees_the_rest_as_it_goes():
    model = _model()
    params = list(model.parameters())
    x = torch.randn(8, 16)
    model(x).sum().backward()
    expected = [2 * p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)

    keep = {0, 3, 7}
    streams = Streams()
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024,
                              streams=streams, keep=lambda: keep, norms=True)
    assert len(buckets.buckets) >= 3
    comm = Doubling()
    meta = torch.zeros(3, dtype=torch.float64)
    buckets.begin(comm, meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
    state = buckets._state
    assert all(b is None for b in state.buffers)  # allocated as their gradients come
    buckets.arm(True)
    model(x).sum().backward()
    assert all(p.grad is None for p in params)  # each freed once in its bucket
    assert buckets.taken() == {id(p) for p in params}  # each taken, so reached
    buckets.materialise()
    buckets.finish(meta)
    buckets.wait()
    assert all(b is None for b in state.buffers)  # every bucket freed, the last after wait
    # On a GPU each freed bucket is first tied to the communication stream's work on it, and
    # so is each kept sum (allocated on the caller's stream, written on that one).
    kept = sorted(params[i].numel() for i in keep)
    retired = sorted(streams.retired)
    for n in kept:
        retired.remove(n)
    assert len(retired) == len(buckets.buckets) - 1
    buckets.assign_grads()
    for i, p in enumerate(params):
        if i in keep:
            assert torch.equal(p.grad, expected[i])
        else:
            assert p.grad is None
    norms = buckets.norms()
    assert norms is not None and len(norms) == len(params)
    for norm, grad in zip(norms, expected, strict=True):
        torch.testing.assert_close(norm, torch.linalg.vector_norm(grad))


def test_a_parameter_the_backward_did_not_reach_is_summed_as_zeros_and_reported():
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024,
                              keep=lambda: range(len(params)), norms=True)
    comm = Doubling()
    meta = torch.zeros(3, dtype=torch.float64)
    buckets.begin(comm, meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    h = torch.randn(4, 16)
    for layer in list(model)[1:]:  # the first layer is not called
        h = layer(h)
    h.sum().backward()
    from elastic.trainer.reducers import used_params

    reached = used_params(params, buckets.taken()).tolist()
    assert reached[:2] == [0.0, 0.0] and all(reached[2:])
    buckets.materialise()  # the first layer's bucket had no hook: allocated here
    buckets.finish(meta)
    buckets.wait()
    buckets.assign_grads()
    assert torch.count_nonzero(params[0].grad) == 0 and torch.count_nonzero(params[1].grad) == 0
    assert float(buckets.norms()[0]) == 0.0
    assert sum(comm.sizes) == sum(p.numel() for p in params) + len(meta)


def test_without_keep_the_buckets_hold_every_sum_as_before():
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024)
    buckets.begin(Doubling(), meta_len=3, vote_slot=0, nonfinite_vote=2.0)
    assert all(b is not None for b in buckets._state.buffers)
    buckets.arm(True)
    model(torch.randn(4, 16)).sum().backward()
    assert all(p.grad is not None for p in params)  # stage 0 and 1 leave them
    buckets.finish(torch.zeros(3, dtype=torch.float64))
    buckets.wait()
    buckets.assign_grads()
    assert all(p.grad is not None for p in params) and buckets.norms() is None


class _Host:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.dropped = 0

    def drop_grads(self) -> None:
        self.dropped += 1


class _Failing:
    """Bucket buffers whose allocation fails the first `fail` times."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls = fail, 0

    def materialise(self) -> None:
        self.calls += 1
        if self.calls <= self.fail:
            raise torch.OutOfMemoryError("injected: out of memory for a bucket")


@pytest.mark.parametrize(("fail", "vote", "voted", "dropped"), [
    (1, "OK", "OK", 0),  # the cache released, then it fits
    (2, "OK", "OUT_OF_MEMORY", 1),  # fits only with the gradients freed: voted down
    (2, "USER_ERROR", "USER_ERROR", 1),  # a vote already cast stays
])
def test_buckets_that_do_not_fit_vote_the_step_down_and_still_take_part(fail, vote, voted,
                                                                         dropped):
    from types import SimpleNamespace

    from elastic.trainer.reducers import ShardedReducer
    from elastic.trainer.step import Vote

    host, buckets = _Host(), _Failing(fail)
    reducer = ShardedReducer(host, [], buckets)
    context = SimpleNamespace(rank=0, step=3, comm=SimpleNamespace(abort=lambda: None))
    assert reducer._materialise(context, Vote[vote]) == Vote[voted]
    assert host.dropped == dropped and buckets.calls == fail + 1


def test_buckets_that_never_fit_leave_the_generation():
    from types import SimpleNamespace

    from elastic.errors import CollectiveError
    from elastic.trainer.reducers import ShardedReducer
    from elastic.trainer.step import Vote

    aborted = []
    reducer = ShardedReducer(_Host(), [], _Failing(5))
    context = SimpleNamespace(rank=1, step=3, comm=SimpleNamespace(abort=lambda: aborted.append(1)))
    with pytest.raises(CollectiveError, match="rank 1 ran out of memory for its gradient buffers"):
        reducer._materialise(context, Vote.OK)
    assert aborted == [1]


def test_a_reduce_that_fails_before_the_buckets_are_finished_releases_the_thread():
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024,
                              keep=lambda: {0}, norms=True)
    comm = Doubling()
    buckets.begin(comm, meta_len=3, vote_slot=0, nonfinite_vote=2.0)
    future = buckets._state.future
    buckets.abandon()  # as the reducer does when its reduce raises before `finish`
    assert future.result(timeout=30) is None  # the thread ended, waiting for nothing
    assert comm.sizes == []  # and issued no collective


def test_a_gradient_accumulated_twice_in_one_backward_is_refused_at_stage_2():
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024,
                              keep=lambda: range(len(params)))
    buckets.begin(Doubling(), meta_len=3, vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    layer = model[0]
    out = layer(torch.randn(2, 16)).sum()
    torch.autograd.backward(out, inputs=[layer.weight])  # as a reentrant segment does
    with pytest.raises(RuntimeError, match="accumulated twice in one backward pass"):
        torch.autograd.backward(layer(torch.randn(2, 16)).sum(), inputs=[layer.weight])
    buckets.abandon()


def test_a_gradient_accumulated_twice_before_its_bucket_is_sent_is_summed_whole():
    # Stages 0 and 1 keep each gradient: the whole one replaces the part copied first, and the
    # bucket still waits for every one of its parameters (counting the second accumulation
    # as another parameter would send it without the last one).
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024)
    first = [id(p) for p in buckets.buckets[0].params]
    assert first == [id(model[3].bias), id(model[3].weight), id(model[2].bias)]
    meta = torch.zeros(3, dtype=torch.float64)
    buckets.begin(Doubling(), meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    head = model[3]
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    torch.autograd.backward(head(x).sum(), inputs=[head.weight])  # as a reentrant segment
    torch.autograd.backward(head(y).sum(), inputs=[head.weight])
    torch.autograd.backward(head(x).sum(), inputs=[head.bias])
    assert not buckets._state.ready[0].is_set()  # 2.bias is not in yet
    torch.autograd.backward(model(x).sum(), inputs=[model[2].bias])
    assert buckets._state.ready[0].is_set()
    expected = [2 * p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    buckets.finish(meta)
    buckets.wait()
    buckets.assign_grads()
    for p, want in zip(params, expected, strict=True):
        assert torch.equal(p.grad, want)


def test_a_gradient_accumulated_twice_after_its_bucket_was_sent_is_refused():
    # Summing the first part only would train on a wrong gradient without a word.
    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, bucket_bytes=1024, first_bucket_bytes=1024)
    assert len(buckets.buckets) >= 2
    meta = torch.zeros(3, dtype=torch.float64)
    buckets.begin(Doubling(), meta_len=len(meta), vote_slot=0, nonfinite_vote=2.0)
    buckets.arm(True)
    model(torch.randn(2, 16)).sum().backward()  # every bucket but the last is sent
    last = model[3]  # its parameters come first in backward order: the first bucket
    with pytest.raises(RuntimeError, match=r"after its bucket was sent to be summed.*"
                                           r"use_reentrant=False.*collective\.overlap=False"):
        torch.autograd.backward(last(torch.randn(2, 16)).sum(), inputs=[last.weight])
    buckets.abandon()


def test_a_sharded_reducer_whose_reduce_raises_abandons_its_buckets():
    from types import SimpleNamespace

    from elastic.errors import CollectiveError
    from elastic.trainer.reducers import ShardedReducer
    from elastic.trainer.step import Vote

    class Buckets(_Failing):
        begun, abandoned = True, False

        def abandon(self) -> None:
            self.abandoned = True

    buckets = Buckets(5)
    reducer = ShardedReducer(_Host(), [], buckets)
    context = SimpleNamespace(rank=0, step=3, comm=SimpleNamespace(abort=lambda: None))
    computed = SimpleNamespace(vote=Vote.OK)
    with pytest.raises(CollectiveError):
        reducer.reduce(context, computed, pack=None, comm_start=0.0)
    assert buckets.abandoned
