"""The shared-memory transport: what it agrees on, what it refuses, what it leaves behind.

Correctness of every algorithm over it is in test_collective.py (hypothesis draws the
transport); killed peers and abort with real processes are in tests/fault."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from elastic.collective import RendezvousServer, shm
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveAbortedError, CollectiveError
from tests.threads import run_ranks

pytestmark = pytest.mark.skipif(shm.supported() is not None, reason=str(shm.supported()))


@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


def _own_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"elastic-shm-{os.getpid()}-")]


def test_ranks_of_one_host_use_shared_memory_and_leave_no_segment(server):
    names = run_ranks(server, 3, lambda c: c.transport)
    assert names == ["shared_memory"] * 3
    assert _own_segments() == []


def test_turned_off_it_uses_gloo(server):
    names = run_ranks(server, 2, lambda c: c.transport,
                      CollectiveConfig(shared_memory=False))
    assert names == ["gloo"] * 2


@pytest.mark.parametrize("peer_offer", [
    {"reason": "shared-memory transfers need Linux x86_64"},
    {"host": "another-host", "name": "x", "nonce": "00", "pid": 1, "size": 0},
], ids=["peer-cannot", "other-host"])
def test_every_rank_falls_back_when_one_cannot_join(peer_offer):
    store = dist.HashStore()
    store.set("shm/offer/1", json.dumps(peer_offer))
    assert shm.connect(0, 2, store, 4096) is None
    assert _own_segments() == []  # its own segment is gone as well


def test_a_receive_that_does_not_match_the_send_fails_naming_both(server):
    def body(comm):
        if comm.rank == 0:
            comm.send(torch.zeros(8), dst=1, tag=3)
            return None
        expected = "tag 4 from rank 0 but its next message has 32 bytes with tag 3"
        with pytest.raises(CollectiveError, match=expected):
            comm.recv(torch.zeros(8), src=0, tag=4)
        return "refused"

    assert run_ranks(server, 2, body)[1] == "refused"


def test_abort_from_another_thread_wakes_a_waiting_receive(server):
    # Rank 0 never sends. Once rank 1's receive is posted, another thread aborts: the receive
    # must end with CollectiveAbortedError, not wait out the 5-minute collective timeout
    # (pytest-timeout would fail the test first).
    def body(comm):
        if comm.rank == 0:
            return None
        posted = threading.Event()

        def abort_once_posted() -> None:
            while not comm._transport._recvs[0]:
                posted.wait(0.001)
            comm.abort()

        threading.Thread(target=abort_once_posted, daemon=True).start()
        with pytest.raises(CollectiveAbortedError):
            comm.recv(torch.zeros(4), src=0)
        return "woken"

    assert run_ranks(server, 2, body)[1] == "woken"


def test_segments_orphaned_by_a_killed_rank_are_removed_by_the_next_rendezvous(server):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    orphan = f"/dev/shm/elastic-shm-{int(dead.stdout)}-{'ab' * 16}"
    with open(orphan, "wb") as f:
        f.write(b"\0" * 4096)
    run_ranks(server, 2, lambda c: c.allreduce(torch.ones(3)))
    assert not os.path.exists(orphan)
