"""Rendezvous: where the ranks of a generation meet.

A `RendezvousServer` hosts a key-value store (torch's TCPStore) on a free port. Every
generation of a communicator uses its own key prefix in that store, so a new generation on the
same endpoint never sees the keys of an old one. The server normally lives in the controller,
which outlives every worker; tests host it in the test process.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic.errors import RendezvousError


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

    def close(self) -> None:
        """Stops serving. Communicators of live generations lose their store."""
        del self._store


def generation_prefix(generation: int) -> str:
    """The key prefix of one generation; distinct generations never share a key."""
    return f"elastic/gen{generation}/"


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

    def acquire(self, endpoint: Endpoint, timeout: timedelta) -> dist.TCPStore:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        return dist.TCPStore(
            endpoint.host, endpoint.port, is_master=False, wait_for_workers=False, timeout=timeout
        )

    def release(self, endpoint: Endpoint, client: dist.TCPStore) -> None:
        with self._lock:
            self._idle.setdefault(endpoint, []).append(client)


_POOL = _ClientPool()


@contextmanager
def generation_store(endpoint: Endpoint, generation: int, timeout: timedelta) -> Iterator[dist.Store]:
    """A store connection scoped to one generation, for the duration of a rendezvous.

    Raises:
        RendezvousError: the store cannot be reached within `timeout`.
    """
    try:
        client = _POOL.acquire(endpoint, timeout)
        client.set_timeout(timeout)
        # A cheap round trip: a pooled client whose server went away fails here, not later.
        client.add(f"{generation_prefix(generation)}connected", 1)
    except (RuntimeError, OSError) as e:
        raise RendezvousError(
            f"cannot reach the rendezvous store at {endpoint} within {timeout}: {e}",
            generation=generation,
        ) from e
    ok = False
    try:
        yield dist.PrefixStore(generation_prefix(generation), client)
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
