"""Events as the tests read them: the JSON records of a run (`FitResult.events`,
`elastic.events(name)`, a summary from a child process) parsed into the typed records of
`elastic.events`, the reader that the CLI, `report` and the benches use. A file on disk is read
with `elastic.events.read_events`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from elastic.events import Event, parse

E = TypeVar("E", bound=Event)


def typed(records: Iterable[Mapping[str, Any] | Event]) -> list[Event]:
    """The records as typed events (a record already typed is kept as it is)."""
    return [r if isinstance(r, Event) else parse(r) for r in records]


def of_kind(records: Iterable[Mapping[str, Any] | Event], cls: type[E]) -> list[E]:
    """The events of kind `cls` among `records`, in order."""
    return [e for e in typed(records) if isinstance(e, cls)]


def kinds(records: Iterable[Mapping[str, Any] | Event]) -> list[type[Event]]:
    """The class of each event, in order (for `index`, `count` and order checks)."""
    return [type(e) for e in typed(records)]
