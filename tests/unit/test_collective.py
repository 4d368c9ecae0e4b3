"""Correctness of every collective and algorithm against a locally computed reference.

Ranks run as threads with real gloo transports; hypothesis draws world sizes, lengths, dtypes,
algorithms, the transport (shared memory or not) and how many hosts the ranks act as."""

from datetime import timedelta
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.collective import Communicator, Endpoint, RendezvousServer, direct
from elastic.config import ALGORITHMS, CollectiveConfig
from elastic.errors import CollectiveError
from tests.threads import run_ranks

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


def _inputs(world_size: int, length: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [(torch.randn(length, generator=g, dtype=torch.float64) * 10).to(dtype)
                for _ in range(world_size)]
    return [torch.randint(-1000, 1000, (length,), generator=g, dtype=dtype)
            for _ in range(world_size)]


def _reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "max":
        return stacked.max(0).values
    total = stacked.sum(0)
    return total / len(inputs) if op == "avg" else total


def _assert_matches(result: torch.Tensor, expected: torch.Tensor, world_size: int) -> None:
    if result.dtype == torch.int64:
        assert torch.equal(result, expected.to(torch.int64))
        return
    tolerance = {
        torch.float64: (1e-12, 1e-9),
        torch.float32: (1e-5, 1e-4),
        torch.bfloat16: (2e-2 * world_size, 0.5 * world_size),
    }[result.dtype]
    torch.testing.assert_close(
        result.to(torch.float64), expected, rtol=tolerance[0], atol=tolerance[1]
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_size=st.integers(1, 6),
    length=st.one_of(st.integers(0, 40), st.integers(1000, 70_001)),
    dtype=st.sampled_from(DTYPES),
    algorithm=st.sampled_from(ALGORITHMS),
    op=st.sampled_from(["sum", "max", "avg"]),
    seed=st.integers(0, 2**31),
    shared_memory=st.booleans(),
    hosts=st.sampled_from([None, 2, 3]),
    registered=st.booleans(),
)
def test_allreduce_matches_reference(server, world_size, length, dtype, algorithm, op, seed,
                                     shared_memory, hosts, registered):
    if op == "avg" and not dtype.is_floating_point:
        op = "sum"
    if algorithm == "native" and dtype == torch.bfloat16 and op == "avg":
        op = "sum"
    inputs = _inputs(world_size, length, dtype, seed)
    # A small segment size makes the ring pipeline many segments even on short inputs; a
    # shared-memory ring of 4 KiB wraps around inside messages and message headers; 4 KiB
    # direct-allreduce buffers take long inputs in many chunks, alternating buffers.
    config = CollectiveConfig(segment_bytes=4096, shared_memory=shared_memory,
                              shm_channel_bytes=4096, shm_chunk_bytes=4096,
                              simulated_hosts=hosts)

    def body(comm: Communicator) -> torch.Tensor:
        # A registered buffer (shared memory the communicator lends): 'direct' reduces it
        # where it lies; to the other algorithms it is a tensor like any other.
        lent = comm.shared_buffers({dtype: length}) if registered else None
        tensor = inputs[comm.rank].clone() if lent is None else lent[dtype].copy_(inputs[comm.rank])
        return comm.allreduce(tensor, op, algorithm).clone()

    expected = _reference(inputs, op)
    lend = length * inputs[0].element_size() + 64 if registered else 0
    took: set[int] = set()  # the ranks that reduced in place in the lent regions
    reduce_registered = direct._registered

    def spy(comm, *args, **kwargs):
        took.add(comm.rank)
        return reduce_registered(comm, *args, **kwargs)

    with mock.patch.object(direct, "_registered", spy):
        results = run_ranks(server, world_size, body, config, shared_bytes=lend)
    # On one host every rank lends a region, so a buffer taken from it is reduced where it
    # lies; a caller's own tensor never is.
    if registered and shared_memory and hosts is None and world_size > 1 and length > 0 \
            and algorithm in ("auto", "direct", "hierarchical"):
        assert took == set(range(world_size))
    elif not registered:
        assert not took
    for result in results:
        _assert_matches(result, expected, world_size)
    # Replicas stay identical: every element is reduced by one rank, and all copy its bits.
    if algorithm != "native":
        for result in results[1:]:
            assert torch.equal(result.view(torch.uint8), results[0].view(torch.uint8))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6])
def test_every_algorithm_sums_exactly_on_integers(server, algorithm, world_size):
    inputs = _inputs(world_size, 1237, torch.int64, seed=world_size)
    results = run_ranks(
        server, world_size, lambda c: c.allreduce(inputs[c.rank].clone(), "sum", algorithm)
    )
    for result in results:
        assert torch.equal(result, torch.stack(inputs).sum(0))


@pytest.mark.parametrize(("world_size", "hosts"), [(4, 2), (5, 2), (6, 3), (5, 3), (4, 4)])
def test_hierarchical_sums_exactly_on_hosts_of_any_size(server, world_size, hosts):
    # Hosts of unequal size (5 ranks on 2 hosts: 3 + 2) give ranks of the smaller host several
    # slices; 3 hosts allreduce each slice in a ring; 4 hosts of one rank use no shared memory.
    inputs = _inputs(world_size, 50_003, torch.int64, seed=world_size * hosts)
    config = CollectiveConfig(shm_chunk_bytes=8192, simulated_hosts=hosts)
    results = run_ranks(server, world_size, lambda c: (
        c.transport, c.allreduce(inputs[c.rank].clone(), "sum", "hierarchical")), config)
    for transport, result in results:
        assert transport == ("gloo" if hosts == world_size else "shared_memory+gloo")
        assert torch.equal(result, torch.stack(inputs).sum(0))


def test_allreduce_of_a_non_contiguous_tensor_writes_back(server):
    base = [torch.arange(24, dtype=torch.float64).reshape(4, 6) * (r + 1) for r in range(3)]

    def body(comm):
        view = base[comm.rank].t()  # not contiguous
        comm.allreduce(view, "sum", "ring")
        return base[comm.rank]

    for result in run_ranks(server, 3, body):
        torch.testing.assert_close(result, torch.arange(24, dtype=torch.float64).reshape(4, 6) * 6)


def test_avg_on_integers_is_refused(server):
    def body(comm):
        with pytest.raises(ValueError, match="floating-point"):
            comm.allreduce(torch.ones(3, dtype=torch.int64), "avg")

    run_ranks(server, 2, body)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 6), length=st.integers(0, 5000), seed=st.integers(0, 2**31))
def test_reduce_scatter_returns_each_ranks_reduced_chunk(server, world_size, length, seed):
    inputs = _inputs(world_size, length, torch.int64, seed)
    results = run_ranks(server, world_size, lambda c: c.reduce_scatter(inputs[c.rank].clone()))
    expected = torch.stack(inputs).sum(0).tensor_split(world_size)
    for rank, result in enumerate(results):
        assert torch.equal(result, expected[rank])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 6), rows=st.integers(0, 7), seed=st.integers(0, 2**31))
def test_allgather_stacks_every_ranks_tensor_in_rank_order(server, world_size, rows, seed):
    inputs = [t.reshape(rows, 3) if rows else t.reshape(0, 3)
              for t in _inputs(world_size, rows * 3, torch.float32, seed)]
    results = run_ranks(server, world_size, lambda c: c.allgather(inputs[c.rank]))
    for result in results:
        assert torch.equal(result, torch.stack(inputs))


@pytest.mark.parametrize("src", [0, 2])
def test_broadcast_copies_the_source_everywhere(server, src):
    inputs = _inputs(3, 999, torch.float64, seed=src)
    results = run_ranks(server, 3, lambda c: c.broadcast(inputs[c.rank].clone(), src))
    for result in results:
        assert torch.equal(result, inputs[src])


def test_send_recv_and_barrier(server):
    def body(comm):
        if comm.rank == 0:
            comm.send(torch.arange(10, dtype=torch.bfloat16), dst=1, tag=5)
            comm.barrier()
            return None
        got = comm.recv(torch.zeros(10, dtype=torch.bfloat16), src=0, tag=5)
        comm.barrier()
        return got

    assert torch.equal(run_ranks(server, 2, body)[1], torch.arange(10, dtype=torch.bfloat16))


def test_generations_on_one_endpoint_do_not_collide(server):
    # Two generations of different sizes live at once on the same store.
    def body(comm):
        return comm.allreduce(torch.ones(5), "sum").tolist()

    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", run_ranks(server, 3, body)))
    t.start()
    out["b"] = run_ranks(server, 2, body)
    t.join()
    assert out["a"] == [[3.0] * 5] * 3
    assert out["b"] == [[2.0] * 5] * 2


def test_rank_out_of_range_is_refused(server):
    with pytest.raises(ValueError, match="rank must be in"):
        Communicator(3, 3, server.endpoint, generation=10_000, secret=server.secret)


def test_endpoint_parse_round_trips_and_rejects_garbage():
    assert Endpoint.parse("10.0.0.1:2345") == Endpoint("10.0.0.1", 2345)
    assert str(Endpoint("h", 1)) == "h:1"
    with pytest.raises(ValueError, match="host:port"):
        Endpoint.parse("nohost")


def test_a_release_that_never_ends_is_reported_instead_of_waited_out(server):
    """A backend whose state cannot be released (an NCCL kernel that never ends) must not
    wedge the worker: `close(timeout)` says so, and the worker ends its process."""
    import threading

    comm = Communicator(0, 1, server.endpoint, 0, secret=server.secret)
    stuck = threading.Event()
    real_close = comm._transport.close

    def hangs() -> None:
        stuck.wait()
        real_close()

    comm._transport.close = hangs
    try:
        assert comm.close(timeout=0.05) is False
        assert comm.aborted
    finally:
        stuck.set()
    released = Communicator(0, 1, server.endpoint, 1, secret=server.secret)
    assert released.close(timeout=30) is True


def test_bad_input_refused_by_a_transport_is_raised_as_is_and_leaves_the_communicator_usable(server):
    """Every rank passes the same tensors, so a refusal (wrong device, a dtype the backend
    lacks) happens on every rank alike: aborting would only break the generation."""
    comm = Communicator(0, 1, server.endpoint, 0, secret=server.secret)
    real = comm._transport.exchange

    def refuses(sends, recvs, tag):
        raise ValueError("the data plane takes CUDA tensors only")

    comm._transport.exchange = refuses
    try:
        with pytest.raises(ValueError, match="CUDA tensors only"):
            comm.send(torch.zeros(2), 0)
        assert not comm.aborted and comm._broken is None
        comm._transport.exchange = real
        comm.barrier()  # still usable
    finally:
        comm.close()


def test_a_gloo_group_closed_cleanly_is_released_and_an_aborted_one_is_kept(server):
    # Before, inverted: every cleanly closed group was kept until the process ended (a group
    # of W - 1 connections and its threads leaked at each resize), and an aborted one was
    # dropped while its helpers might still be blocked in it.
    from elastic.collective import gloo

    config = CollectiveConfig(simulated_hosts=2)  # two hosts of one rank: gloo between them
    before = len(gloo._ABANDONED)
    ones = run_ranks(server, 2, lambda c: (c.transport, c.allreduce(torch.ones(3), "sum")),
                     config)
    assert [t for t, _ in ones] == ["gloo", "gloo"] and torch.equal(ones[0][1], torch.full((3,), 2.0))
    assert len(gloo._ABANDONED) == before

    def aborted(comm):
        comm.allreduce(torch.ones(3), "sum")
        comm.abort()

    run_ranks(server, 2, aborted, config)
    assert len(gloo._ABANDONED) == before + 2

    def timed_out(comm):  # rank 0 never sends: rank 1's receive fails, nobody aborts it
        if comm.rank == 1:
            with pytest.raises(CollectiveError):
                comm.recv(torch.zeros(4), src=0)

    short = CollectiveConfig(simulated_hosts=2, timeout=timedelta(seconds=0.3))
    run_ranks(server, 2, timed_out, short)
    assert len(gloo._ABANDONED) == before + 3  # rank 1's: a helper may still wait in it
