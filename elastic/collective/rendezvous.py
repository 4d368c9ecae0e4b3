"""Rendezvous: where the ranks of a generation meet.

A `RendezvousServer` hosts a key-value store (torch's TCPStore) on a free port of one address
and creates the run's secret: 32 random bytes that reach the ranks only as an argument of an
authenticated call (Ray's, in a run), never on a command line, in the environment or in a file.

The store itself takes anyone who can reach its port (TCPStore has no authentication). What
makes it the run's own is `AuthenticatedStore`, the only view ranks use:

- every generation's keys live under a prefix derived from the secret (HMAC), so a process
  without the secret cannot name, read or pre-seed a key of any generation;
- every value carries an HMAC-SHA256 tag over (generation, key, value): a forged value, or a
  value replayed from another key or generation, is refused with `RendezvousError`, before
  anything acts on it (a shared-memory offer, a gloo address, an NCCL unique id);
- once every rank has built its transport, each deletes the keys it wrote, and the server
  deletes the generation's bookkeeping keys (`RendezvousServer.forget`).

HMAC over a shared store was chosen over moving the exchange onto the controller actor: the
communicator stays free of Ray (tests and benches run it bare), gloo and NCCL keep blocking
`wait`s on a store built for them, and no call of a rendezvous ever queues behind the
controller's own work. What an outsider can still do is make the port busy (denial of service),
as with any listening socket; see docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic.errors import RendezvousError

SECRET_BYTES = 32
_TAG_BYTES = 32  # HMAC-SHA256


@dataclass(frozen=True)
class Endpoint:
    """Address of a rendezvous store."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parses `host:port`.

        Raises:
            ValueError: `text` is not of the form `host:port`.
        """
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"rendezvous endpoint {text!r} is not of the form host:port")
        return cls(host=host, port=int(port))


class RendezvousServer:
    """Hosts the rendezvous store on a free port of `host`.

    Args:
        host: the address to serve on; other nodes must be able to reach it.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        # TCPStore alone listens on every interface; it is handed a socket bound to `host`
        # only, so the control port is not exposed on other networks of the node.
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        self._socket = socket.socket(family, kind, proto)
        self._socket.bind(address)
        self._socket.listen(1024)
        port = self._socket.getsockname()[1]
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=self._socket.fileno())
        self._socket.detach()  # the store owns the descriptor now and closes it
        self.endpoint = Endpoint(host=host, port=port)
        self.secret = secrets.token_bytes(SECRET_BYTES)

    def __repr__(self) -> str:  # never the secret
        return f"RendezvousServer({self.endpoint})"

    def forget(self, generation: int) -> None:
        """Deletes the bookkeeping keys of `generation` (the ranks delete their own values
        once the generation has formed). Call it once every rank has connected or given up."""
        prefix = generation_prefix(self.secret, generation)
        for key in _BOOKKEEPING:
            self._store.delete_key(prefix + key)

    def close(self) -> None:
        """Stops serving. Communicators of live generations lose their store."""
        del self._store


# Keys every rank of a generation touches and no rank can delete alone.
_CONNECTED = "connected"
_FORMED = "formed"
_FORMED_ALL = "formed/all"
_BOOKKEEPING = (_CONNECTED, _FORMED, _FORMED_ALL)


def generation_prefix(secret: bytes, generation: int) -> str:
    """The key prefix of one generation: unguessable without the run's secret, and distinct
    generations never share a key."""
    digest = hmac.new(secret, b"elastic generation %d" % generation, hashlib.sha256).hexdigest()
    return f"elastic/{digest[:32]}/"


class AuthenticatedStore(dist.Store):
    """One generation's view of the rendezvous store: namespaced, signed and verified.

    Gloo, NCCL and the shared-memory exchange use only `set`, `get`, `wait` and `check`;
    counters (`add`) cannot be signed and are refused, so nothing can come to rely on one.

    Args:
        client: a connection to the store.
        secret: the run's secret (`RendezvousServer.secret`).
        generation: the generation this view belongs to.
    """

    def __init__(self, client: dist.Store, secret: bytes, generation: int) -> None:
        super().__init__()
        if len(secret) < 16:
            raise ValueError("the rendezvous secret must be at least 16 random bytes")
        self._client = client
        self._secret = secret
        self.generation = generation
        self._prefix = generation_prefix(secret, generation)
        self._written: set[str] = set()

    def _tag(self, key: str, value: bytes) -> bytes:
        message = b"%d\0%s\0" % (self.generation, key.encode()) + value
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._client.set(self._prefix + key, self._tag(key, data) + data)
        self._written.add(key)

    def get(self, key: str) -> bytes:
        raw = bytes(self._client.get(self._prefix + key))
        tag, data = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        if len(raw) < _TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, data)):
            raise RendezvousError(
                f"the rendezvous value {key!r} of generation {self.generation} is not signed "
                "with this run's secret and was refused: another process wrote to the "
                "rendezvous store (see the security section of docs/reliability.md)",
                generation=self.generation,
            )
        return data

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._prefix + k for k in keys]
        if timeout is None:
            self._client.wait(names)
        else:
            self._client.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._client.check([self._prefix + k for k in keys]))

    def add(self, key: str, amount: int) -> int:
        raise NotImplementedError("counters cannot be authenticated; exchange signed values")

    def formed(self, world_size: int) -> None:
        """Called by every rank once its transport is built: waits until all have, then
        deletes the values this rank wrote (nobody reads them any more)."""
        if self._client.add(self._prefix + _FORMED, 1) == world_size:
            self.set(_FORMED_ALL, b"1")
        self.wait([_FORMED_ALL])
        self.get(_FORMED_ALL)
        for key in self._written - {_FORMED_ALL}:
            self._client.delete_key(self._prefix + key)


class _ClientPool:
    """Reuses store connections across generations.

    Opening a TCPStore connection stalls for 5 s now and then (measured here, about one
    connect in 25: torch resolves the peer's name and the resolver times out); a worker that
    reconnected on every recovery would pay that in its recovery time. A client blocks other
    users while it waits for a key, so each connecting rank checks one out for the duration
    of its rendezvous and returns it afterwards (gloo needs the store only while connecting).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Endpoint, list[dist.TCPStore]] = {}

    def acquire(self, endpoint: Endpoint, timeout: timedelta,
                fresh: bool = False) -> tuple[dist.TCPStore, bool]:
        """A client of `endpoint` and whether it was pooled (`fresh`: never a pooled one)."""
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle and not fresh:
                return idle.pop(), True
        return dist.TCPStore(
            endpoint.host, endpoint.port, is_master=False, wait_for_workers=False, timeout=timeout
        ), False

    def release(self, endpoint: Endpoint, client: dist.TCPStore) -> None:
        with self._lock:
            self._idle.setdefault(endpoint, []).append(client)


_POOL = _ClientPool()


@contextmanager
def generation_store(
    endpoint: Endpoint, generation: int, timeout: timedelta, secret: bytes
) -> Iterator[AuthenticatedStore]:
    """A store connection scoped to one generation, for the duration of a rendezvous.

    Raises:
        RendezvousError: the store cannot be reached within `timeout`.
    """
    for fresh in (False, True):
        pooled = False
        try:
            client, pooled = _POOL.acquire(endpoint, timeout, fresh)
            client.set_timeout(timeout)
            # A cheap round trip: a pooled client whose server went away (or was replaced by
            # another one on the same port) fails here, and a fresh connection is tried once.
            client.add(generation_prefix(secret, generation) + _CONNECTED, 1)
            break
        except (RuntimeError, OSError) as e:
            if pooled:
                continue
            raise RendezvousError(
                f"cannot reach the rendezvous store at {endpoint} within {timeout}: {e}",
                generation=generation,
            ) from e
    ok = False
    try:
        yield AuthenticatedStore(client, secret, generation)
        ok = True
    finally:
        if ok:
            _POOL.release(endpoint, client)


def local_address_towards(host: str) -> str:
    """The address of this machine on the route to `host` (no packet is sent).

    The communicator listens on this address, not on all interfaces.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
