"""The NCCL simulator's own contract: what `elastic.collective.nccl` relies on NCCL for, so that
the transport's tests against it mean something (the deadlock of one group per call included).

Ranks are threads; one test puts a rank in a process of its own and kills it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from elastic.collective import nccl_sim as sim
from tests.procs import warm_context

pytestmark = pytest.mark.timeout(60)


def _communicators(n: int) -> list[sim.NcclCommunicator]:
    uid = sim.get_unique_id()
    comms: list[sim.NcclCommunicator | None] = [None] * n

    def build(rank: int) -> None:
        comms[rank] = sim.NcclCommunicator(n, uid, rank)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(c is not None for c in comms)
    return comms  # type: ignore[return-value]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ring_step(comm, stream, send: torch.Tensor, recv: torch.Tensor, grouped: bool) -> sim.Event:
    """One ring step: receive from the left, send to the right; as one group, or as two groups
    (receive first), as the old transport issued them."""
    n, r = comm.size(), comm.rank_id()
    if grouped:
        sim.groupStart()
    else:
        sim.groupStart()
        comm.recv(recv.data_ptr(), _nbytes(recv), sim.NCCL_UINT8, (r - 1) % n, stream.cuda_stream)
        sim.groupEnd()
        sim.groupStart()
    if grouped:
        comm.recv(recv.data_ptr(), _nbytes(recv), sim.NCCL_UINT8, (r - 1) % n, stream.cuda_stream)
    comm.send(send.data_ptr(), _nbytes(send), sim.NCCL_UINT8, (r + 1) % n, stream.cuda_stream)
    sim.groupEnd()
    return stream.record_event()


@pytest.mark.parametrize("n", [2, 3])
def test_a_ring_step_issued_as_one_group_completes(n):
    comms = _communicators(n)
    streams = [sim.Stream() for _ in range(n)]
    sends = [torch.full((1001,), float(r)) for r in range(n)]
    recvs = [torch.zeros(1001) for _ in range(n)]
    events = [_ring_step(comms[r], streams[r], sends[r], recvs[r], grouped=True) for r in range(n)]
    assert all(e.synchronize(10) for e in events)
    for r in range(n):
        assert torch.equal(recvs[r], sends[(r - 1) % n])
        comms[r].check_async_error()
    for c in comms:
        c.destroy()


@pytest.mark.parametrize("n", [2, 3])
def test_receive_then_send_as_two_groups_deadlocks_on_every_rank(n):
    """Each stream runs its groups in order and a receive group completes only when the
    matching send runs: the send queued behind it never does."""
    comms = _communicators(n)
    streams = [sim.Stream() for _ in range(n)]
    sends = [torch.full((64,), float(r + 1)) for r in range(n)]
    recvs = [torch.zeros(64) for _ in range(n)]
    events = [_ring_step(comms[r], streams[r], sends[r], recvs[r], grouped=False) for r in range(n)]
    assert not any(e.synchronize(0.5) for e in events)
    assert all(c.busy for c in comms)
    for c in comms:  # abort cleans up: every stream gives up and moves on
        c.abort()
    assert all(e.synchronize(5) for e in events)
    assert all(torch.all(t == 0) for t in recvs)  # nothing was written


def test_construction_blocks_until_every_rank_arrived():
    uid = sim.get_unique_id()
    built: dict[int, sim.NcclCommunicator] = {}

    def build(rank: int) -> None:
        built[rank] = sim.NcclCommunicator(2, uid, rank)

    first = threading.Thread(target=build, args=(0,))
    first.start()
    first.join(0.5)
    assert first.is_alive() and not built
    second = threading.Thread(target=build, args=(1,))
    second.start()
    first.join(10)
    second.join(10)
    assert set(built) == {0, 1}
    for c in built.values():
        c.destroy()


def test_a_stream_runs_its_work_in_order_and_events_order_streams():
    """a1 is held at a gate the test opens: while it is, neither the work queued behind it on
    `a` nor the work of `b` (which waits for `a`) has run, and neither stream is idle."""
    order: list[str] = []
    a, b = sim.Stream(), sim.Stream()
    running, gate = threading.Event(), threading.Event()

    def a1() -> None:
        running.set()
        assert gate.wait(30)
        order.append("a1")

    sim.launch(a1, a)
    sim.launch(lambda: order.append("a2"), a)
    b.wait_stream(a)
    sim.launch(lambda: order.append("b1"), b)
    done = b.record_event()
    assert running.wait(10)
    assert not done.query() and not a.query() and not b.query()
    assert order == []
    gate.set()
    assert done.synchronize(10)
    assert order == ["a1", "a2", "b1"]
    # An event never recorded is complete; one recorded on an idle stream at once.
    assert sim.Event().query()
    assert sim.Stream().record_event().query()


def test_the_current_stream_is_per_thread_and_can_be_switched():
    mine = sim.current_stream()
    assert sim.current_stream() is mine
    other: list[sim.Stream] = []
    t = threading.Thread(target=lambda: other.append(sim.current_stream()))
    t.start()
    t.join()
    assert other[0] is not mine
    s = sim.Stream()
    with sim.stream(s):
        assert sim.current_stream() is s
    assert sim.current_stream() is mine


def test_collectives_complete_only_when_every_rank_reached_them():
    comms = _communicators(3)
    streams = [sim.Stream() for _ in range(3)]
    data = [torch.tensor([1.0, 5.0, -2.0]) * (r + 1) for r in range(3)]

    def allreduce(r: int, op: int) -> sim.Event:
        t = data[r]
        comms[r].allReduce(t.data_ptr(), t.data_ptr(), t.numel(), sim.NCCL_FLOAT32, op,
                           streams[r].cuda_stream)
        return streams[r].record_event()

    early = [allreduce(0, sim.NCCL_SUM), allreduce(1, sim.NCCL_SUM)]
    assert not any(e.synchronize(0.3) for e in early)
    assert allreduce(2, sim.NCCL_SUM).synchronize(5) and all(e.synchronize(5) for e in early)
    for t in data:
        assert t.tolist() == [6.0, 30.0, -12.0]
    events = [allreduce(r, sim.NCCL_MAX) for r in range(3)]
    assert all(e.synchronize(5) for e in events)
    assert data[1].tolist() == [6.0, 30.0, -12.0]
    # Broadcast from rank 2.
    buffers = [torch.arange(7, dtype=torch.int64) * (r + 1) for r in range(3)]
    for r in range(3):
        comms[r].bcast(buffers[r].data_ptr(), 7 * 8, sim.NCCL_UINT8, 2, streams[r].cuda_stream)
    assert all(s.record_event().synchronize(5) for s in streams)
    assert all(b.tolist() == [3 * i for i in range(7)] for b in buffers)
    for c in comms:
        c.destroy()


def test_abort_while_a_group_runs_stops_it_and_later_calls_fail():
    comms = _communicators(2)
    stream = sim.Stream()
    buffer = torch.zeros(16)
    comms[0].recv(buffer.data_ptr(), _nbytes(buffer), sim.NCCL_UINT8, 1, stream.cuda_stream)
    done = stream.record_event()
    assert not done.synchronize(0.2)
    comms[0].abort()
    assert done.synchronize(2)  # the stream gave up the group and moved on
    assert torch.all(buffer == 0)
    with pytest.raises(sim.NcclError, match="INVALID_ARGUMENT"):
        comms[0].send(buffer.data_ptr(), 64, sim.NCCL_UINT8, 1, 0)
    with pytest.raises(sim.NcclError, match="INVALID_ARGUMENT"):
        comms[0].check_async_error()
    comms[0].abort()  # a second abort and a destroy after it do nothing
    comms[0].destroy()
    # The peer sees a remote error: CuPy cannot name code 6 and raises KeyError(6).
    assert sim.wait_error(comms[1], 10), "the peer of an aborted rank saw no remote error"
    with pytest.raises(KeyError) as raised:
        comms[1].check_async_error()
    assert raised.value.args == (6,)
    comms[1].abort()


def test_an_injected_result_code_is_raised_as_cupy_raises_it():
    (comm,) = _communicators(1)
    comm.check_async_error()
    comm.inject_error(7)
    with pytest.raises(KeyError) as raised:
        comm.check_async_error()
    assert raised.value.args == (7,)
    comm.inject_error(5)  # the first error sticks, as NCCL's does
    with pytest.raises(KeyError):
        comm.check_async_error()
    (other,) = _communicators(1)
    other.inject_error(2)
    with pytest.raises(sim.NcclError, match="SYSTEM_ERROR"):
        other.check_async_error()
    comm.abort()
    other.abort()


def test_a_receive_of_another_size_than_the_send_is_invalid_usage():
    comms = _communicators(2)
    small, big = torch.ones(4), torch.zeros(8)
    streams = [sim.Stream(), sim.Stream()]
    comms[0].send(small.data_ptr(), 16, sim.NCCL_UINT8, 1, streams[0].cuda_stream)
    comms[1].recv(big.data_ptr(), 32, sim.NCCL_UINT8, 0, streams[1].cuda_stream)
    assert sim.wait_error(comms[1], 10), "a size mismatch went unnoticed"
    with pytest.raises(sim.NcclError) as raised:
        comms[1].check_async_error()
    assert raised.value.status == sim.ncclInvalidUsage
    assert torch.all(big == 0)  # nothing of the mismatched message was written
    for c in comms:
        c.abort()


def test_destroy_after_clean_use_leaves_the_peer_without_error():
    comms = _communicators(2)
    x = torch.ones(3)
    streams = [sim.Stream(), sim.Stream()]
    comms[0].send(x.data_ptr(), 12, sim.NCCL_UINT8, 1, streams[0].cuda_stream)
    y = torch.zeros(3)
    comms[1].recv(y.data_ptr(), 12, sim.NCCL_UINT8, 0, streams[1].cuda_stream)
    assert sim.wait_idle(comms[0], 5) and sim.wait_idle(comms[1], 5)
    comms[0].destroy()
    # Rank 1's reader of rank 0 ends once it has seen the goodbye and the closed connection,
    # and sets the error then if it takes the departure for one: after it, nothing can.
    reader = comms[1]._readers[0]
    reader.join(10)
    assert not reader.is_alive()
    comms[1].check_async_error()
    assert torch.equal(y, x)
    comms[1].destroy()


def test_a_peer_that_finished_and_left_does_not_fail_a_collective_still_waiting_for_another():
    """Rank 0 has every contribution and destroys its communicator while rank 1 still waits
    for rank 2's (held until the test lets it go): rank 1's allreduce completes."""
    comms = _communicators(3)
    real_transmit = comms[2]._transmit
    release = threading.Event()

    def held_to_rank_one(peer, kind, seq, payload):
        if peer == 1:
            release.wait()
        real_transmit(peer, kind, seq, payload)

    comms[2]._transmit = held_to_rank_one
    # Set once rank 1, still waiting, has looked for departed peers after rank 0 left.
    real_check = comms[1]._fail_if_peer_left
    checked_after_rank_zero_left = threading.Event()

    def check(remaining, others):
        try:
            real_check(remaining, others)
        finally:
            if 0 in comms[1]._bye:
                checked_after_rank_zero_left.set()

    comms[1]._fail_if_peer_left = check
    streams = [sim.Stream() for _ in range(3)]
    data = [torch.full((5,), float(r + 1)) for r in range(3)]
    try:
        for r in range(3):
            comms[r].allReduce(data[r].data_ptr(), data[r].data_ptr(), 5, sim.NCCL_FLOAT32,
                               sim.NCCL_SUM, streams[r].cuda_stream)
        events = [s.record_event() for s in streams]
        assert events[0].synchronize(10)
        comms[0].destroy()
        assert checked_after_rank_zero_left.wait(10)
        assert not events[1].query()  # rank 2's contribution is still held
        comms[1].check_async_error()
    finally:
        release.set()
    assert events[1].synchronize(10) and events[2].synchronize(10)
    comms[1].check_async_error()
    assert all(torch.equal(t, torch.full((5,), 6.0)) for t in data)
    comms[1].destroy()
    comms[2].destroy()


def _rank_one(uid, conn) -> None:
    comm = sim.NcclCommunicator(2, uid, 1)
    conn.send(comm.rank_id())
    time.sleep(600)  # killed by the test


def test_a_killed_process_is_a_remote_error_for_its_peer():
    ctx = warm_context()
    uid = sim.get_unique_id()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rank_one, args=(uid, child), daemon=True)
    proc.start()
    try:
        comm = sim.NcclCommunicator(2, uid, 0)
        assert parent.poll(30) and parent.recv() == 1
        stream = sim.Stream()
        buffer = torch.zeros(4)
        comm.recv(buffer.data_ptr(), 16, sim.NCCL_UINT8, 1, stream.cuda_stream)
        done = stream.record_event()
        assert not done.synchronize(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        assert done.synchronize(10)  # the group gave up
        with pytest.raises(KeyError) as raised:
            comm.check_async_error()
        assert raised.value.args == (6,)
        comm.abort()
    finally:
        proc.kill()
        proc.join(10)
