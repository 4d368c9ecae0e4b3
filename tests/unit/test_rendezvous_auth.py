"""The rendezvous only the run can use: unguessable names, signed values, nothing left over.

The attacker here is a process that reaches the store's port but does not hold the run's
secret. To test the signatures themselves, some tests grant it more than it can get (the
generation's key prefix, which is derived from the secret) and check that its values are
still refused, before anything acts on them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.collective import Communicator, RendezvousServer, shm
from elastic.collective.rendezvous import AuthenticatedStore, generation_prefix
from elastic.config import CollectiveConfig
from elastic.errors import RendezvousError
from tests.threads import run_ranks

pytestmark = pytest.mark.timeout(120)

# Long enough that a rank which waited for it instead of refusing would hit pytest's timeout.
_PATIENT = CollectiveConfig(rendezvous_timeout=timedelta(seconds=600))


def _outsider(server: RendezvousServer) -> dist.TCPStore:
    """A plain store client, as any process that found the port would open."""
    return dist.TCPStore(server.endpoint.host, server.endpoint.port, is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=10))


def _forge(key: str, value: bytes, generation: int, secret: bytes) -> bytes:
    """A value signed with `secret` (the attacker's guess, not the run's)."""
    message = b"%d\0%s\0" % (generation, key.encode()) + value
    return hmac.new(secret, message, hashlib.sha256).digest() + value


def test_prefixes_depend_on_the_secret_and_the_generation():
    a, b = os.urandom(32), os.urandom(32)
    assert generation_prefix(a, 1) != generation_prefix(b, 1)
    assert generation_prefix(a, 1) != generation_prefix(a, 2)
    assert generation_prefix(a, 1) == generation_prefix(a, 1)
    assert "gen" not in generation_prefix(a, 0) and len(generation_prefix(a, 0)) > 32


def test_a_formed_generation_leaves_nothing_in_the_store():
    server = RendezvousServer()
    try:
        probe = _outsider(server)
        baseline = probe.num_keys()
        # shared memory on: gloo addresses, shm offers and answers all pass through the store
        gen_results = run_ranks(server, 3, lambda c: (c.generation, c.transport))
        generation = gen_results[0][0]
        server.forget(generation)
        assert probe.num_keys() == baseline
        # and the names an outsider could guess from the old scheme never existed
        assert not probe.check([f"elastic/gen{generation}/connected",
                                f"elastic/gen{generation}/shm/offer/0"])
    finally:
        server.close()


def test_values_are_bound_to_their_key_and_generation():
    server = RendezvousServer()
    try:
        client = _outsider(server)
        one = AuthenticatedStore(client, server.secret, 1)
        two = AuthenticatedStore(client, server.secret, 2)
        one.set("shm/offer/0", b'{"reason": "x"}')
        assert one.get("shm/offer/0") == b'{"reason": "x"}'
        raw = client.get(generation_prefix(server.secret, 1) + "shm/offer/0")
        # replayed under another key of the same generation
        client.set(generation_prefix(server.secret, 1) + "shm/offer/1", raw)
        with pytest.raises(RendezvousError, match="not signed with this run's secret"):
            one.get("shm/offer/1")
        # replayed into a later generation
        client.set(generation_prefix(server.secret, 2) + "shm/offer/0", raw)
        with pytest.raises(RendezvousError, match="generation 2"):
            two.get("shm/offer/0")
        # too short to carry a tag at all
        client.set(generation_prefix(server.secret, 2) + "short", b"abc")
        with pytest.raises(RendezvousError):
            two.get("short")
        with pytest.raises(NotImplementedError):
            one.add("counter", 1)
    finally:
        server.close()


def test_a_forged_gloo_address_is_refused_without_waiting_out_the_timeout():
    """Rank 1 never comes; the attacker (granted the prefix) plants its gloo address."""
    server = RendezvousServer()
    try:
        generation = 7
        prefix = generation_prefix(server.secret, generation)
        attacker = _outsider(server)
        box: dict[str, BaseException] = {}

        def rank0() -> None:
            try:
                Communicator(0, 2, server.endpoint, generation, _PATIENT, secret=server.secret)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=rank0, daemon=True)
        thread.start()
        attacker.wait([prefix + "0/0"])  # rank 0's own (signed) address is there
        genuine = attacker.get(prefix + "0/0")[32:]
        forged_secret = os.urandom(32)
        attacker.set(prefix + "0/1", _forge("0/1", genuine, generation, forged_secret))
        thread.join(90)
        assert not thread.is_alive()
        assert isinstance(box.get("error"), RendezvousError)
        assert "not signed with this run's secret" in str(box["error"])
    finally:
        server.close()


def test_a_forged_shared_memory_offer_is_refused_before_anything_is_mapped(tmp_path):
    """The forged offer names a file this user owns, of the right size and mode: without the
    signature check it would be mapped and written into."""
    server = RendezvousServer()
    try:
        generation, capacity = 3, 1 << 16
        size = shm._Segment.size(1, capacity, 4 << 20)
        name = f"elastic-shm-{os.getpid()}-{'ab' * 16}"
        target = os.path.join("/dev/shm", name)
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\x00" * size)
        finally:
            os.close(fd)
        try:
            before = open(target, "rb").read()
            nonce = before[:16]
            offer = (f'{{"name": "{name}", "nonce": "{nonce.hex()}", "pid": {os.getpid()}, '
                     f'"size": {size}}}').encode()
            attacker = _outsider(server)
            attacker.set(generation_prefix(server.secret, generation) + "shm/offer/1",
                         _forge("shm/offer/1", offer, generation, os.urandom(32)))
            store = AuthenticatedStore(_outsider(server), server.secret, generation)
            # An honest rank 1 on this host said so; only its offer is forged.
            store.set("shm/host/1", f'{{"host": "{shm._host_identity()}"}}')
            with pytest.raises(RendezvousError, match="shm/offer/1"):
                shm.connect(0, 2, store, capacity)
            assert open(target, "rb").read() == before
        finally:
            os.unlink(target)
    finally:
        server.close()


def test_a_forged_nccl_unique_id_is_refused():
    from elastic.collective import nccl

    server = RendezvousServer()
    try:
        generation = 5
        uid = nccl.encode_unique_id(tuple(range(128)))
        attacker = _outsider(server)
        attacker.set(generation_prefix(server.secret, generation) + nccl._UID_KEY,
                     _forge(nccl._UID_KEY, uid, generation, os.urandom(32)))
        store = AuthenticatedStore(_outsider(server), server.secret, generation)
        store.wait([nccl._UID_KEY], timedelta(seconds=5))
        with pytest.raises(RendezvousError):
            store.get(nccl._UID_KEY)
    finally:
        server.close()


def test_honest_ranks_still_form_after_an_outsider_wrote_guessable_keys():
    server = RendezvousServer()
    try:
        attacker = _outsider(server)
        for g in range(0, 50):
            attacker.set(f"elastic/gen{g}/0/1", b"garbage")
            attacker.set(f"elastic/gen{g}/shm/offer/1", b'{"name": "/etc/passwd"}')
        results = run_ranks(server, 2, lambda c: c.allreduce(torch.ones(4) * (c.rank + 1)))
        assert all(torch.equal(r, torch.full((4,), 3.0)) for r in results)
    finally:
        server.close()


def test_the_secret_is_not_in_the_servers_repr():
    server = RendezvousServer()
    try:
        assert server.secret.hex() not in repr(server) and str(server.endpoint) in repr(server)
        assert len(server.secret) == 32
    finally:
        server.close()


def test_a_pooled_connection_to_a_server_that_went_away_is_replaced():
    """Store connections are pooled by address; a new server on a port an old one used (the
    OS hands ports out again, as CI saw) must not inherit the old server's dead connection."""
    from elastic.collective import rendezvous

    old, new = RendezvousServer(), RendezvousServer()
    try:
        with rendezvous.generation_store(old.endpoint, 1, timedelta(seconds=30), old.secret):
            pass
        stale = rendezvous._POOL._idle.pop(old.endpoint)
        old.close()
        rendezvous._POOL._idle[new.endpoint] = stale  # as if `new` had taken old's port
        with rendezvous.generation_store(new.endpoint, 1, timedelta(seconds=30), new.secret) as s:
            s.set("k", b"v")
            assert s.get("k") == b"v"
        assert run_ranks(new, 2, lambda c: c.world_size) == [2, 2]
    finally:
        new.close()
