"""The shared-memory transport: what it agrees on, what it refuses, what it leaves behind.

Correctness of every algorithm over it is in test_collective.py (hypothesis draws the
transport); killed peers and abort with real processes are in tests/fault."""

import contextlib
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.collective import RendezvousServer, shm, shm_segments
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveAbortedError, CollectiveError, CollectiveTimeoutError
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


@pytest.mark.parametrize("peer_host", [
    {"reason": "shared-memory transfers need Linux x86_64"},
    {"host": "another-host"},
    {"nonsense": 1},
], ids=["peer-cannot", "other-host", "malformed"])
def test_every_rank_falls_back_when_one_cannot_join(peer_host):
    store = dist.HashStore()
    store.set("shm/host/1", json.dumps(peer_host))
    assert shm.connect(0, 2, store, 4096) is None
    assert _own_segments() == []


def test_a_rank_that_cannot_map_its_hosts_segment_turns_shared_memory_off_everywhere():
    # Rank 1 shares rank 0's host but offers a segment that does not exist: rank 0 cannot
    # map it, so both (and every other rank) fall back, and nothing is left in /dev/shm.
    store = dist.HashStore()
    store.set("shm/host/1", json.dumps({"host": shm_segments._host_key(0, 2, None)}))
    store.set("shm/offer/1", json.dumps({"name": f"elastic-shm-1-{'cd' * 16}", "nonce": "00",
                                         "pid": 1, "size": 1}))
    store.set("shm/mapped/1", "ok")
    assert shm.connect(0, 2, store, 4096) is None
    assert "cannot map the segment of rank 1" in store.get("shm/mapped/0").decode()
    assert _own_segments() == []


def test_simulated_hosts_share_memory_only_inside_each_block(server):
    # 5 ranks as 2 hosts: ranks 0-2 and 3-4. Each rank maps only its own host's segments and
    # has no byte ring at all: point-to-point transfers go over gloo.
    def body(comm):
        transport = comm._transport
        return (comm.transport, transport.local, len(transport._segments), transport._outbound,
                comm.allreduce(torch.full((10,), float(comm.rank)), "sum", "direct").tolist())

    results = run_ranks(server, 5, body, CollectiveConfig(simulated_hosts=2))
    for rank, (name, local, segments, rings, total) in enumerate(results):
        assert name == "shared_memory+gloo"
        assert local == ([0, 1, 2] if rank < 3 else [3, 4])
        assert segments == len(local)
        assert rings == {}
        assert total == [10.0] * 10
    assert _own_segments() == []


def _body_waiting_for(absent: threading.Event):
    """Rank 0 stays out of the allreduce until `absent` is set; the others run it."""

    def body(comm):
        if comm.rank == 0:
            absent.wait(30)
            return None
        data = torch.full((4096,), 3.0)
        try:
            comm.allreduce(data, "sum", "direct")
        except CollectiveError as e:
            return type(e), bool(torch.all(data == 3.0))
        finally:
            absent.set()
        return None, True

    return body


def test_abort_from_another_thread_wakes_a_direct_allreduce(server):
    # Rank 1 waits in stage 1 for rank 0, which never comes; another thread aborts it once
    # the stage is posted. The caller's tensor is left as it was.
    absent = threading.Event()
    inner = _body_waiting_for(absent)

    def body(comm):
        if comm.rank == 1:
            def abort_once_waiting() -> None:
                while comm._transport._stage is None:
                    absent.wait(0.001)
                comm.abort()

            threading.Thread(target=abort_once_waiting, daemon=True).start()
        return inner(comm)

    assert run_ranks(server, 2, body)[1] == (CollectiveAbortedError, True)


def test_a_direct_allreduce_past_its_timeout_raises_and_fails_its_host_peers_at_once(server):
    # Rank 1 times out waiting for rank 0 (0.2 s); rank 0 then enters the allreduce and fails
    # at once with a plain CollectiveError (rank 1 gave up), not after its own timeout.
    absent = threading.Event()
    inner = _body_waiting_for(absent)

    def body(comm):
        result = inner(comm)
        if comm.rank == 0:
            with pytest.raises(CollectiveError) as info:
                comm.allreduce(torch.ones(4096), "sum", "direct")
            return type(info.value)
        return result

    config = CollectiveConfig(timeout=timedelta(seconds=0.2))
    assert run_ranks(server, 2, body, config) == [CollectiveError, (CollectiveTimeoutError, True)]


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
            while not comm._transport._inbound[0].queue:
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


def _segment_file(name: str, size: int, mode: int = 0o600) -> str:
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.ftruncate(fd, size)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


def _our_name() -> str:
    return f"elastic-shm-{os.getpid()}-{os.urandom(16).hex()}"


def test_a_valid_peer_segment_maps():
    path = _segment_file(_our_name(), 4096)
    try:
        assert len(shm_segments._map_peer_segment(os.path.basename(path), 4096)) == 4096
    finally:
        os.unlink(path)


@pytest.mark.parametrize("name", ["/usr/bin/env", "../../etc/passwd", "elastic-shm-1-../x", 42, "other-file"])
def test_an_offer_naming_a_path_or_a_foreign_name_is_refused_before_opening(name):
    with pytest.raises(OSError, match="not a name of ours"):
        shm_segments._map_peer_segment(name, 4096)


def test_a_symlink_a_hard_link_a_wrong_mode_or_size_or_another_owner_is_refused(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"\x7fELF" + bytes(4092))
    made = []
    try:
        link = os.path.join("/dev/shm", _our_name())
        os.symlink(target, link)
        made.append(link)
        with pytest.raises(OSError):  # ELOOP from O_NOFOLLOW
            shm_segments._map_peer_segment(os.path.basename(link), 4096)

        hard = _segment_file(_our_name(), 4096)
        made.append(hard)
        extra = hard + "-second-link"
        os.link(hard, extra)
        made.append(extra)
        with pytest.raises(OSError, match="2 links"):
            shm_segments._map_peer_segment(os.path.basename(hard), 4096)

        loose = _segment_file(_our_name(), 4096, mode=0o666)
        made.append(loose)
        with pytest.raises(OSError, match="mode 666"):
            shm_segments._map_peer_segment(os.path.basename(loose), 4096)

        small = _segment_file(_our_name(), 1024)
        made.append(small)
        with pytest.raises(OSError, match="1024 bytes"):
            shm_segments._map_peer_segment(os.path.basename(small), 4096)

        if os.getuid() == 0:
            foreign = _segment_file(_our_name(), 4096)
            made.append(foreign)
            os.chown(foreign, 65534, 65534)
            with pytest.raises(OSError, match="owned by uid 65534"):
                shm_segments._map_peer_segment(os.path.basename(foreign), 4096)
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert target.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create another user's file")
def test_orphan_cleanup_leaves_another_users_segment_alone():
    # A name of ours whose "creator" pid cannot exist, owned by someone else.
    name = f"elastic-shm-{2**22 + 7}-{os.urandom(16).hex()}"
    path = _segment_file(name, 64)
    try:
        os.chown(path, 65534, 65534)
        shm_segments._remove_orphans()
        assert os.path.exists(path)
        os.chown(path, os.getuid(), os.getgid())
        shm_segments._remove_orphans()
        assert not os.path.exists(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.mark.parametrize(("first", "direct"), [
    (torch.arange(250, dtype=torch.float32), True),
    (torch.ones(3, dtype=torch.bfloat16), False),
], ids=["aligned", "after-an-odd-bfloat16-message"])
def test_a_reducing_receive_that_wraps_around_the_rings_end_is_exact(server, first, direct):
    # A 4 KiB ring. After the first message (1000 or 6 bytes), the second one's 4064 payload
    # bytes start at stream byte 1032 (or 38) and end past 4096: one reducing receive takes
    # them all in two pieces, straight from the ring through typed views where they start at
    # a multiple of 4, through staging where an odd bfloat16 message left them unaligned.
    values = torch.arange(1016, dtype=torch.float32) * 3
    consumed, sent = threading.Event(), threading.Event()

    def body(comm):
        if comm.rank == 0:
            comm.send(first, dst=1)
            consumed.wait(30)  # the ring is empty again: the second message goes in whole
            comm.send(values, dst=1)
            sent.set()
            return None
        comm.recv(torch.empty_like(first), src=0)
        consumed.set()
        sent.wait(30)
        total = torch.ones(1016)
        comm.wait(comm.recv_reduce(total, 0, "sum"))
        receiver = comm._transport._inbound[0]
        return total, receiver.position, receiver._staging is None

    total, position, unstaged = run_ranks(server, 2, body, CollectiveConfig(shm_channel_bytes=4096))[1]
    assert torch.equal(total, values + 1)
    assert position == 16 + first.numel() * first.element_size() + 16 + 4064 > 4096
    assert unstaged is direct


def test_abort_during_a_reducing_receive_stops_writing_into_the_tensor(server):
    # Rank 0 starts a 16 KiB send into a 4 KiB ring: the first 4080 bytes go in at once, and
    # rank 1's reducing receive reduces them into its tensor when posted, then sleeps waiting
    # for the rest. Another thread aborts it. Rank 0 then fills the ring again: its bytes
    # stay there, and the tensor stays as it was at the abort, however often the
    # aborted handle is polled.
    pushed, aborted, refilled = threading.Event(), threading.Event(), threading.Event()

    def body(comm):
        if comm.rank == 0:
            pending = comm.exchange([(torch.full((4096,), 2.0), 1)], [])
            pushed.set()
            aborted.wait(30)
            assert not pending[0].is_done()  # one pass: fills the space rank 1 freed
            refilled.set()
            return None
        transport = comm._transport
        pushed.wait(30)
        tensor = torch.ones(4096)
        handles = comm.recv_reduce(tensor, 0, "sum")

        def abort_once_asleep() -> None:
            while not transport._sleeping.value:
                aborted.wait(0.001)
            comm.abort()

        threading.Thread(target=abort_once_asleep, daemon=True).start()
        with pytest.raises(CollectiveAbortedError):
            comm.wait(handles)
        at_abort = tensor.clone()
        aborted.set()
        refilled.wait(30)
        receiver = transport._inbound[0]
        unread = receiver.ring.tail.value - receiver.position
        assert not handles[0].is_done()
        assert not handles[0].wait(0.01)
        return at_abort, tensor, unread

    at_abort, tensor, unread = run_ranks(server, 2, body, CollectiveConfig(shm_channel_bytes=4096))[1]
    assert torch.equal(at_abort[:1020], torch.full((1020,), 3.0))
    assert torch.equal(at_abort[1020:], torch.ones(4096 - 1020))
    assert unread == 4096
    assert torch.equal(tensor, at_abort)


def test_a_receive_fails_at_once_when_its_host_peer_gives_up_alive(server):
    # Rank 0 gives up on the generation (its abort, a timeout or an error on it alone) and
    # stays alive. Rank 1's receive from it must fail within the liveness check, not wait
    # out the 5-minute collective timeout (pytest-timeout would fail the test first): before,
    # a point-to-point wait looked only at whether peer processes had exited.
    def body(comm):
        if comm.rank == 0:
            comm.abort()
            return None
        with pytest.raises(CollectiveError, match="rank 0 of this host gave up"):
            comm.recv(torch.zeros(4), src=0)
        return "failed"

    assert run_ranks(server, 2, body)[1] == "failed"


@pytest.mark.parametrize("collective", ["broadcast", "barrier", "native_allreduce"])
def test_a_collective_through_gloo_fails_at_once_when_a_host_peer_gives_up_alive(server,
                                                                                collective):
    # The state broadcast of a forming generation, barriers and the 'native' allreduce go
    # through gloo beside the shared-memory rings. Rank 0 gives up and stays alive: rank 1
    # must fail within the liveness check; before, it waited out gloo's timeout (the
    # 5-minute collective timeout; pytest-timeout fails the test first).
    def body(comm):
        if comm.rank == 0:
            comm.abort()
            return None
        with pytest.raises(CollectiveError, match="rank 0 of this host gave up"):
            if collective == "broadcast":
                comm.broadcast(torch.zeros(4), src=0)
            elif collective == "barrier":
                comm.barrier()
            else:
                comm.allreduce(torch.zeros(4), algorithm="native")
        return "failed"

    assert run_ranks(server, 2, body)[1] == "failed"
