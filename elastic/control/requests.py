"""Control requests: what a caller asks of a live run's controller (`elastic.status`,
`events`, `scale`, `kill`, `stop`, `drain`), one frozen record per kind.

The controller dispatches on the record's type (`Controller.answer`), never on a name. They
travel pickled through Ray, and on the fast channel (`elastic.control.channel`) as a JSON line
`{"method": VERB, "args": [FIELDS...]}`: `encode` and `decode` map each kind to its verb
through one closed table, so an unknown verb is refused before it reaches the controller,
and the line has the shape it always had (a controller and a caller of an earlier version
still understand each other).

No Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass
from typing import Any, ClassVar

from elastic.errors import ControllerError


@dataclass(frozen=True)
class Status:
    """A snapshot of the run (answered as the record of `elastic.control.status.RunStatus`)."""

    verb: ClassVar[str] = "status"


@dataclass(frozen=True)
class Events:
    """Every event of the run so far."""

    verb: ClassVar[str] = "events"


@dataclass(frozen=True)
class Scale:
    """Sets the target world size to `num_workers`, within [min_workers, max_workers]."""

    num_workers: int
    verb: ClassVar[str] = "scale"


@dataclass(frozen=True)
class Kill:
    """Kills the worker at `rank` of the generation that trains (a drill)."""

    rank: int
    verb: ClassVar[str] = "kill"


@dataclass(frozen=True)
class Stop:
    """Ends the run gracefully after the step the workers are in."""

    verb: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Drain:
    """The worker at `rank`, or every worker on Ray node `node_id`, leaves the run at the next
    step boundary (a planned departure), within `deadline_s` seconds if given (else killed
    then, and the run recovers as from a failure)."""

    rank: int | None = None
    node_id: str | None = None
    deadline_s: float | None = None
    verb: ClassVar[str] = "drain"


Request = Status | Events | Scale | Kill | Stop | Drain

KINDS: dict[str, type[Request]] = {kind.verb: kind
                                   for kind in (Status, Events, Scale, Kill, Stop, Drain)}
"""Each request kind by its verb on the wire."""


def encode(request: Request) -> dict[str, Any]:
    """The JSON message of `request` on the control channel."""
    return {"method": type(request).verb, "args": list(astuple(request))}


def decode(message: Mapping[str, Any]) -> Request:
    """The request a control channel message encodes.

    Raises:
        ControllerError: the verb names no request kind.
        TypeError: the arguments do not fit the kind's fields.
        KeyError: the message has no verb.
    """
    verb = message["method"]
    kind = KINDS.get(verb) if isinstance(verb, str) else None
    if kind is None:
        raise ControllerError(f"unknown control method {verb!r}")
    return kind(*message.get("args", []))
