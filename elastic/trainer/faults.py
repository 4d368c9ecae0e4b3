"""Where a replica's step is, and the faults a run injects into it (`FitConfig.chaos`).

`Progress` is read from another thread by the worker's hang watchdog. `FaultInjector` fires
the step's chaos events in the phase each names: 'kill' (SIGKILL of this process, its moment
recorded for the recovery breakdown), 'hang', 'raise' (an error of user code), 'oom' (an
out-of-memory error of user code), 'slow' (the step's compute stretched by a factor, for
as many steps as the event says) and 'preempt' (SIGTERM to this process, a scheduler's notice:
the worker's handler reports it and the step goes on).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from elastic.config import ChaosEvent, ChaosPhase
from elastic.errors import InjectedFault
from elastic.private import ensure_private_dir, write_private


@dataclass
class Progress:
    """Where a replica is, readable from another thread (for the hang watchdog)."""

    step: int = 0
    phase: str = "idle"
    since: float = field(default_factory=time.monotonic)


def chaos_kill(run_dir: str, event: ChaosEvent) -> None:
    """Chaos 'kill': records the moment (for the recovery breakdown), then SIGKILLs this
    process."""
    directory = os.path.join(run_dir, "chaos")
    ensure_private_dir(directory, "run_dir")
    write_private(os.path.join(directory, f"kill-{event.step}-{event.rank}"),
                  repr(time.time()).encode(), fsync=False)
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """One replica's progress and injected faults.

    Args:
        run_dir: where a 'kill' records its moment.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.progress = Progress()
        self._slow: tuple[float, int | None] | None = None  # (factor, last step)

    def enter(self, phase: str) -> None:
        """The step enters `phase` (what the watchdog reads)."""
        self.progress.since = time.monotonic()  # first: see evaluation._enter
        self.progress.phase = phase

    def fire(self, events: Sequence[ChaosEvent], phase: ChaosPhase) -> None:
        """Fires the events of `phase` ('slow' ones are armed by `arm_slow` instead).

        Raises:
            InjectedFault: a 'raise' event.
            torch.OutOfMemoryError: an 'oom' event.
        """
        for event in events:
            if event.phase != phase or event.action == "slow":
                continue
            match event.action:
                case "kill":
                    chaos_kill(self.run_dir, event)
                case "hang":
                    threading.Event().wait()
                case "preempt":  # the process goes on; its SIGTERM handler reports the notice
                    os.kill(os.getpid(), signal.SIGTERM)
                case "raise":
                    raise InjectedFault(
                        f"injected fault at step {event.step}, rank {event.rank}, phase {phase}"
                    )
                case "oom":
                    raise torch.OutOfMemoryError(
                        f"injected out-of-memory error at step {event.step}, rank {event.rank}"
                    )

    def arm_slow(self, events: Sequence[ChaosEvent], step: int) -> None:
        """A 'slow' event among the step's: this step and the event's `steps` - 1 after it
        are stretched (all later ones without `steps`)."""
        for event in events:
            if event.action == "slow":
                self._slow = (event.factor,
                              None if event.steps is None else step + event.steps - 1)

    def stretch(self, step: int, started: float) -> None:
        """Chaos 'slow': this step's compute takes `factor` times as long (a sleep in
        proportion to the time since `started`)."""
        if self._slow is None:
            return
        factor, last = self._slow
        if last is not None and step > last:
            self._slow = None
            return
        time.sleep((factor - 1.0) * (time.perf_counter() - started))
