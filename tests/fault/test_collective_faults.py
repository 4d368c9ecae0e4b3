"""Abort and peer death with real processes: survivors always get a CollectiveError, never
a hang or a crash, and can form a new generation on the same endpoint."""

import os
import signal
from multiprocessing.connection import Connection

import pytest
import torch

from elastic.collective import Communicator, Endpoint, RendezvousServer
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveError
from tests.procs import Ranks, warm_context

pytestmark = pytest.mark.fault


@pytest.fixture
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


TRANSPORTS = pytest.mark.parametrize(
    ("shared_memory", "transport"),
    [(True, "shared_memory"), (False, "gloo")], ids=["shm", "gloo"],
)


@TRANSPORTS
def test_abort_wakes_a_recv_that_would_wait_forever(server, shared_memory, transport):
    ranks = Ranks(2, server, "recv_forever", shared_memory=shared_memory)
    try:
        assert ranks.expect(0, "connected")[2] == transport
        assert ranks.expect(1, "connected")[2] == transport
        ranks.send(1, "abort")
        assert ranks.expect(1, "error")[1:] == ("CollectiveAbortedError", True)
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


@TRANSPORTS
def test_operation_past_its_timeout_raises_collective_timeout(server, shared_memory, transport):
    ranks = Ranks(2, server, "recv_forever", timeout_s=0.5, shared_memory=shared_memory)
    try:
        ranks.expect(0, "connected")
        ranks.expect(1, "connected")
        assert ranks.expect(1, "error")[1:] == ("CollectiveTimeoutError", True)
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


def test_abort_cuts_a_rendezvous_short_when_a_member_never_comes(server):
    ranks = Ranks(3, server, "recv_forever", start=[0, 1])
    try:
        for rank in (0, 1):
            ranks.send(rank, "abort")
        for rank in (0, 1):
            assert ranks.expect(rank, "error")[1:] == ("CollectiveAbortedError", True)
    finally:
        ranks.close()


# (shared_memory, algorithm, simulated hosts, transport): the byte-ring transport, the direct
# allreduce on one host, the hierarchical one on 2 hosts x 2 ranks, gloo alone.
ALLREDUCES = pytest.mark.parametrize(
    ("shared_memory", "algorithm", "hosts", "transport"),
    [(True, "ring", None, "shared_memory"), (True, "direct", None, "shared_memory"),
     (True, "direct+registered", None, "shared_memory"),
     (True, "hierarchical", 2, "shared_memory+gloo"), (False, "ring", None, "gloo")],
    ids=["shm-ring", "shm-direct", "shm-registered", "hierarchical", "gloo"],
)
SHARED_ALLREDUCES = pytest.mark.parametrize(
    ("algorithm", "hosts", "transport"),
    [("direct", None, "shared_memory"), ("direct+registered", None, "shared_memory"),
     ("hierarchical", 2, "shared_memory+gloo"),
     ("hierarchical+registered", 2, "shared_memory+gloo")],
    ids=["direct", "registered", "hierarchical", "hierarchical-registered"],
)


@SHARED_ALLREDUCES
def test_abort_wakes_an_allreduce_that_waits_for_an_absent_peer(server, algorithm, hosts,
                                                                 transport):
    # Rank 0 never joins; the others wait for it (rank 1 through shared memory). Rank 1 is
    # aborted first and fails as aborted, its tensor never written; its host peers learn of it
    # through the shared segment (or their own abort, sent after) and fail too. (Aborted all
    # at once, rank 1 could see a peer's failure before its own abort: a plain CollectiveError.)
    ranks = Ranks(4, server, "allreduce_alone", algorithm=algorithm, hosts=hosts)
    try:
        for rank in range(4):
            assert ranks.expect(rank, "connected")[2] == transport
        ranks.send(1, "abort")
        assert ranks.expect(1, "untouched")[1] is True
        assert ranks.expect(1, "error")[1:] == ("CollectiveAbortedError", True)
        for rank in (2, 3):
            ranks.send(rank, "abort")
        for rank in (2, 3):
            ranks.expect(rank, "untouched")
            _, kind, is_collective_error = ranks.expect(rank, "error")
            assert is_collective_error, kind
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


@SHARED_ALLREDUCES
def test_allreduce_past_its_timeout_raises_collective_timeout(server, algorithm, hosts, transport):
    # Ranks 1-3 wait for rank 0, which never joins, and time out at about the same moment:
    # whichever times out first fails its host peers through the shared segment, so a rank
    # raises either its own timeout or a peer's failure; at least one raises the timeout.
    # Rank 1's tensor is never written (its host peer 0 never came; on 2 hosts, ranks 2 and 3
    # may have reduced their own slices in place before waiting on the network).
    ranks = Ranks(4, server, "allreduce_alone", timeout_s=0.5, algorithm=algorithm, hosts=hosts)
    try:
        for rank in range(4):
            ranks.expect(rank, "connected")
        kinds = []
        for rank in (1, 2, 3):
            untouched = ranks.expect(rank, "untouched")[1]
            assert untouched or rank != 1
            _, kind, is_collective_error = ranks.expect(rank, "error")
            assert is_collective_error, kind
            kinds.append(kind)
        assert "CollectiveTimeoutError" in kinds, kinds
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


@ALLREDUCES
def test_survivors_of_a_killed_peer_fail_cleanly_and_regroup(server, shared_memory, algorithm,
                                                             hosts, transport):
    ranks = Ranks(4, server, "allreduce_forever", shared_memory=shared_memory,
                  algorithm=algorithm, hosts=hosts)
    try:
        for rank in range(4):
            assert ranks.expect(rank, "connected")[2] == transport
        for rank in range(4):
            ranks.expect(rank, "running")
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        ranks.procs[2].join(30)
        survivors = [0, 1, 3]
        # The controller's part: abort every survivor (some may already have seen the
        # connection reset by themselves).
        for rank in survivors:
            ranks.send(rank, "abort")
        for rank in survivors:
            _, kind, is_collective_error = ranks.expect(rank, "error")
            assert is_collective_error, kind
        # Survivor processes are alive and form generation 1 with new ranks.
        for new_rank, rank in enumerate(survivors):
            assert ranks.procs[rank].is_alive()
            ranks.send(rank, ("regen", new_rank, 3, 1))
        for new_rank, rank in enumerate(survivors):
            _, got_rank, values = ranks.expect(rank, "regen_result")
            assert got_rank == new_rank
            assert values == [6.0] * 1001
        for rank in survivors:
            ranks.procs[rank].join(30)
            assert ranks.procs[rank].exitcode == 0
    finally:
        ranks.close()


@pytest.mark.parametrize(("algorithm", "hosts", "transport"), [
    ("ring", None, "shared_memory"), ("direct", None, "shared_memory"),
    ("direct+registered", None, "shared_memory"), ("hierarchical", 2, "shared_memory+gloo"),
    ("hierarchical+registered", 2, "shared_memory+gloo"),
], ids=["ring", "direct", "registered", "hierarchical", "hierarchical-registered"])
def test_shared_memory_survivors_notice_a_killed_peer_without_being_aborted(server, algorithm,
                                                                            hosts, transport):
    # Nobody plays the controller here: every survivor (neighbours of the dead rank or not)
    # must fail on its own with a CollectiveError that is not the 300 s collective timeout.
    # Hierarchical (ranks 0-1 and 2-3 as two hosts): rank 0 sees its host peer die, rank 3
    # loses its network partner, and each host's failure reaches the other rank of the host.
    ranks = Ranks(4, server, "allreduce_forever", shared_memory=True, algorithm=algorithm,
                  hosts=hosts)
    try:
        for rank in range(4):
            assert ranks.expect(rank, "connected")[2] == transport
        for rank in range(4):
            ranks.expect(rank, "running")
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        for rank in (0, 2, 3):
            _, kind, is_collective_error = ranks.expect(rank, "error")
            assert (kind, is_collective_error) == ("CollectiveError", True)
    finally:
        ranks.close()


def _send_a_ring_full_then_wait(endpoint: str, secret: bytes, conn: Connection) -> None:
    """Rank 0 of 2 with 4 KiB rings: starts sending 16 KiB (the first 4080 bytes go into the
    ring at once, nothing more unless it waits), reports, and waits to be killed."""
    try:
        config = CollectiveConfig(shm_channel_bytes=4096)
        comm = Communicator(0, 2, Endpoint.parse(endpoint), 0, config, secret=secret)
        comm.exchange([(torch.full((4096,), 2.0), 1)], [])
        conn.send(("sent", comm.transport))
        conn.recv()
    finally:
        os._exit(0)  # see tests.procs.rank_main


def test_a_peer_killed_during_a_reducing_receive_fails_it_and_writes_nothing_more(server):
    # This process is rank 1. Its reducing receive takes the 1020 floats in the ring when
    # posted, then waits for the rest; rank 0 is killed. The wait fails through the pidfd (a
    # plain CollectiveError, not the 300 s timeout), and the tensor keeps what was reduced.
    ctx = warm_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_a_ring_full_then_wait,
                       args=(str(server.endpoint), server.secret, child), daemon=True)
    proc.start()
    try:
        comm = Communicator(1, 2, server.endpoint, 0, CollectiveConfig(shm_channel_bytes=4096),
                            secret=server.secret)
        try:
            assert parent.poll(60)
            assert parent.recv() == ("sent", "shared_memory")
            tensor = torch.ones(4096)
            handles = comm.recv_reduce(tensor, 0, "sum")
            reduced = tensor.clone()
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            with pytest.raises(CollectiveError) as info:
                comm.wait(handles)
            assert type(info.value) is CollectiveError
            assert torch.equal(reduced[:1020], torch.full((1020,), 3.0))
            assert torch.equal(reduced[1020:], torch.ones(4096 - 1020))
            assert torch.equal(tensor, reduced)
        finally:
            comm.close()
    finally:
        proc.kill()
        proc.join(10)
