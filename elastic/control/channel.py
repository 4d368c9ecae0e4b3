"""A run's control channel on its controller's host: `status`, `events`, `scale`, `kill` and
`stop` answered in milliseconds, without starting a Ray driver (which costs seconds).

The controller listens on a Linux abstract Unix socket with a random name that it publishes
in the run's private record (`elastic.registry`). No port and no file is opened, and the
server answers only processes of its own user: it checks the caller's uid with
`SO_PEERCRED`, so knowing the name alone gives another local user nothing. Elsewhere (not
Linux) there is no channel and callers go through Ray.

One request per connection: a request record (`elastic.control.requests`) as a JSON line
(`encode`: `{"method": ..., "args": [...]}`), answered by `{"result": ...}` or
`{"error": {"type": ..., "message": ...}}`.

No Ray here.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic import errors
from elastic.control.requests import Request, decode, encode
from elastic.errors import ControllerError, ElasticError

logger = logging.getLogger(__name__)

_MAX_REQUEST = 1 << 16
_MAX_REPLY = 256 << 20  # a long run's events
_TIMEOUT_S = 10.0


class ControlUnavailable(Exception):
    """Nobody answers at the address: the controller is gone (internal; callers fall back)."""


class ControlBusy(ControlUnavailable):
    """The controller took the call but did not answer in time: it is there, and busy (a
    caller must not take it for gone)."""


class ControlServer:
    """Serves `handler(request)` on an abstract Unix socket until `close`.

    Args:
        handler: called on a server thread for each request, decoded into its record (an
            unknown kind is refused before); its `ElasticError`s are sent back to the caller
            and raised there with the same type and message.
    """

    def __init__(self, handler: Callable[[Request], Any]) -> None:
        self.handler = handler
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if not sys.platform.startswith("linux"):
            return
        address = f"elastic-{secrets.token_hex(16)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + address)
        sock.listen(16)
        self._sock, self.address = sock, address
        threading.Thread(target=self._accept, args=(sock,), name="elastic-control", daemon=True).start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="elastic-control-call",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(_TIMEOUT_S)
            try:
                if _peer_uid(conn) != os.getuid():
                    return  # another user: no answer at all
                request = decode(json.loads(_read_line(conn)))
                reply: dict[str, Any] = {"result": self.handler(request)}
            except ElasticError as e:
                reply = {"error": {"type": type(e).__name__, "message": str(e)}}
            except Exception as e:  # a malformed request or a bug of ours: the caller hears of it
                logger.exception("control request failed")
                reply = {"error": {"type": "ControllerError", "message": f"{type(e).__name__}: {e}"}}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass  # the caller went away

    def close(self) -> None:
        """Stops answering: the name is released at once and later callers are refused."""
        if self._sock is not None:
            # close() alone does not wake a thread blocked in accept(); shutdown() does, and
            # only then is the abstract name released.
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None


def call(address: str, request: Request, timeout: float = _TIMEOUT_S) -> Any:
    """Sends `request` to the controller listening at `address` and returns its answer.

    Only a listener of this user is talked to: after a controller's death its name is free,
    and another user could bind it.

    Raises:
        ControlUnavailable: nobody of this user answers there (the controller is gone), or the
            answer was not one.
        ControlBusy: the controller took the call but its answer did not come within
            `timeout` (a `ControlUnavailable` too).
        ElasticError: what the controller raised, with its type and message.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    connected = False
    with sock:
        try:
            sock.connect("\0" + address)
            if _peer_uid(sock) != os.getuid():
                raise ControlUnavailable(f"{address} is held by another user")
            connected = True
            sock.sendall(json.dumps(encode(request)).encode() + b"\n")
            line = _read_line(sock, limit=_MAX_REPLY, deadline=deadline)
            reply = json.loads(line) if line else None
        except TimeoutError as e:
            if connected:  # its listener took the call: the controller is alive
                raise ControlBusy(f"{address}: no answer in {timeout:g} s") from e
            raise ControlUnavailable(f"{address}: {e}") from e
        except (OSError, ValueError) as e:  # refused, reset, oversized, not JSON
            raise ControlUnavailable(f"{address}: {e}") from e
    if not isinstance(reply, dict):  # closed without an answer
        raise ControlUnavailable(address)
    if "error" in reply:
        raise _error(reply["error"]["type"], reply["error"]["message"])
    return reply["result"]


def _error(type_name: str, message: str) -> ElasticError:
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, ElasticError):
        try:
            return cls(message)
        except TypeError:  # needs fields a message alone does not give
            pass
    return ControllerError(f"{type_name}: {message}")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _read_line(conn: socket.socket, limit: int = _MAX_REQUEST, deadline: float | None = None) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("no whole answer in time")
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > limit:
            raise ValueError(f"control message over {limit} bytes")
    return b"".join(chunks)
