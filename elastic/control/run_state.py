"""The labels of a run's lifecycle (`elastic.control.states` holds the state classes).

No Ray here.
"""

from __future__ import annotations

from enum import Enum


class RunState(Enum):
    """Lifecycle of a run. Terminal states end the control loop."""

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHING = "finishing"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED)
