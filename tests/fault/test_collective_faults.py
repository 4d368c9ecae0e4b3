"""Abort and peer death with real processes: survivors always get a CollectiveError, never
a hang or a crash, and can form a new generation on the same endpoint."""

import os
import signal

import pytest

from elastic.collective import RendezvousServer
from tests.procs import Ranks

pytestmark = pytest.mark.fault


@pytest.fixture
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


def test_abort_wakes_a_recv_that_would_wait_forever(server):
    ranks = Ranks(2, server.endpoint, "recv_forever")
    try:
        ranks.expect(0, "connected")
        ranks.expect(1, "connected")
        ranks.send(1, "abort")
        assert ranks.expect(1, "error")[1:] == ("CollectiveAbortedError", True)
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


def test_operation_past_its_timeout_raises_collective_timeout(server):
    ranks = Ranks(2, server.endpoint, "recv_forever", timeout_s=0.5)
    try:
        ranks.expect(0, "connected")
        ranks.expect(1, "connected")
        assert ranks.expect(1, "error")[1:] == ("CollectiveTimeoutError", True)
    finally:
        ranks.send(0, ("exit",))
        ranks.close()


def test_abort_cuts_a_rendezvous_short_when_a_member_never_comes(server):
    ranks = Ranks(3, server.endpoint, "recv_forever", start=[0, 1])
    try:
        for rank in (0, 1):
            ranks.send(rank, "abort")
        for rank in (0, 1):
            assert ranks.expect(rank, "error")[1:] == ("CollectiveAbortedError", True)
    finally:
        ranks.close()


def test_survivors_of_a_killed_peer_fail_cleanly_and_regroup(server):
    ranks = Ranks(4, server.endpoint, "allreduce_forever")
    try:
        for rank in range(4):
            ranks.expect(rank, "connected")
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
