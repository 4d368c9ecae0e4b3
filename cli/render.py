"""Events as text for the command line: `elastic.progress.describe` says what an event
means; `log_line` is how `elastic logs` prints one. `run` shows its progress through
`elastic.progress` (as `elastic.fit` does), `demo` prints `describe` lines after the run.

`describe` leaves out events not worth a line of their own while a run goes on (a state
change, a new generation, ...); `elastic logs` prints every event with `log_description`.
"""

from __future__ import annotations

from elastic.events import Event
from elastic.progress import describe, log_description

__all__ = ["describe", "log_description", "log_line"]


def log_line(event: Event) -> str:
    """The line `elastic logs` prints for `event`: its kind, then what it means."""
    return f"{event.kind:>16}  {log_description(event)}"
